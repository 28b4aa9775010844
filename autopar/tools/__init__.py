"""Reading plans: the summary, diff, the HTML report and the command line.

``groups.py`` turns a plan's leaves into one row per parameter (gradient
and optimizer state beside it, repeated layers collapsed); ``summary.py``,
``diff.py``, ``explain.py`` and ``report.py`` build on it; ``cli.py`` is
the ``autopar`` command. Nothing below imports them: a ``Plan``'s reading
methods (``summary``, ``explain``, ``cost_if``, ``check``, ``to_html``,
``stage_table``) call
the reader this package registers with ``autopar.plan`` when imported.
"""

from autopar import plan as plan_data
from autopar.tools import check, explain, report, summary


class Reader:
  """``autopar.plan.PlanReader``: the tools behind a plan's reading
  methods."""

  @staticmethod
  def summary(plan):
    return summary.summary(plan)

  @staticmethod
  def explain(plan, path):
    return explain.explain(plan, path)

  @staticmethod
  def cost_if(plan, pins):
    return explain.cost_if(plan, pins)

  @staticmethod
  def check(plan, executable):
    return check.check(plan, executable)

  @staticmethod
  def stage_table(plan):
    return summary.stage_lines(plan)

  @staticmethod
  def to_html(plan, title):
    return report.to_html(plan, title=title)


plan_data.use_reader(Reader())
