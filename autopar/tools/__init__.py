"""Reading plans: the summary, diff, the HTML report and the command line.

``groups.py`` turns a plan's leaves into one row per parameter (gradient
and optimizer state beside it, repeated layers collapsed); ``summary.py``,
``diff.py``, ``explain.py`` and ``report.py`` build on it; ``cli.py`` is
the ``autopar`` command. Only ``cli.py`` imports ``autopar.plan`` at run
time: the plan module uses the others.
"""
