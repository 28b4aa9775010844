"""The few PuLP calls the planner's ILP makes, for PuLP 3 and PuLP 4.

PuLP 4 (2026) rebuilt its model in Rust: variables are made by their problem
(``prob.add_variable``), an expression is no longer built from a dict
(``LpAffineExpression(dict)``; ``lpSum_vars_coefs`` builds one in one call),
``prob.solve`` returns an ``LpSolveStats`` instead of a status code and the
problem keeps no ``status``, and CBC is no longer bundled
(``PULP_CBC_CMD``). PuLP 3.3 has ``add_variable`` too and warns on
``LpVariable(...)``. This module is the one place that knows; the ILP
(``ilp.py``, ``ilp_memory.py``) calls only these functions.

Supported: PuLP 3.3 and later 3.x, 4.x (``setup.py``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import sys
import threading
from typing import Iterable, Mapping

import pulp

from autopar.errors import PlanError

__all__ = ["PULP_MAJOR", "RESOLVES", "Status", "problem", "variable", "set_bounds", "linear",
           "solve", "resolve", "solver", "value", "value_of", "moved"]

PULP_MAJOR = int(pulp.__version__.split(".")[0])
# Whether :func:`resolve` can solve a problem again in the HiGHS model an
# earlier solve left: PuLP 4's model does not number the variables.
RESOLVES = PULP_MAJOR < 4
_OPTIMAL = 1        # LpStatusOptimal in PuLP 3, LpSolveStatus.Optimal in PuLP 4


@dataclasses.dataclass(frozen=True)
class Status:
  """How a solve ended: ``name`` as PuLP says it ("Optimal", "Infeasible", ...)."""
  code: int
  name: str

  @property
  def optimal(self) -> bool:
    return self.code == _OPTIMAL


def problem(name: str) -> pulp.LpProblem:
  """A new minimisation problem."""
  return pulp.LpProblem(name, pulp.LpMinimize)


def variable(prob: pulp.LpProblem, name: str, lowBound=None, cat: str = "Continuous",
             upBound=None):
  """A new variable of ``prob`` (``cat``: "Binary", "Integer" or "Continuous")."""
  add = getattr(prob, "add_variable", None)
  if add is not None:
    return add(name, lowBound=lowBound, upBound=upBound, cat=cat)
  return pulp.LpVariable(name, lowBound=lowBound, upBound=upBound, cat=cat)


def set_bounds(x, lowBound=None, upBound=None) -> None:
  """Sets variable ``x``'s bounds (None: none), for the next solve."""
  x.bounds(lowBound, upBound)


def linear(terms: Mapping | Iterable):
  """``Σ coef · var`` for ``terms`` (a mapping var -> coef, or (var, coef)
  pairs; a variable twice adds up), built in one call, not term by term."""
  pairs = terms.items() if isinstance(terms, Mapping) else terms
  merged: dict = {}
  for x, a in pairs:
    merged[x] = merged.get(x, 0.0) + float(a)
  if PULP_MAJOR >= 4:
    return pulp.lpSum_vars_coefs(list(merged.items())) if merged else pulp.lpSum([])
  return pulp.LpAffineExpression(merged)


def solve(prob: pulp.LpProblem, solver_) -> Status:
  """Solves ``prob`` with ``solver_``; how it ended."""
  result = prob.solve(solver_)
  if PULP_MAJOR >= 4:
    return Status(int(result.status), result.status.name)
  return Status(int(result), pulp.LpStatus[result])


def resolve(prob: pulp.LpProblem, model, bounds: Iterable) -> Status | None:
  """Solves ``prob`` again in ``model``, the HiGHS model of it that an
  earlier solve left (``prob.solverModel`` then), from that solve's basis,
  with the bounds of some variables changed for this solve (``bounds``:
  (variable, lower, upper), None for no bound), and sets every variable's
  value; the model's bounds are put back after. After an LP solve, a few
  changed bounds take the dual simplex a few iterations, where a new solve
  builds the model and starts over.

  None where there is no such model (CBC, PuLP 4): the caller then solves
  ``prob`` anew (:func:`solve`, the bounds set on the variables).
  """
  variables = prob.variables()
  if model is None or not hasattr(model, "changeColBounds") or \
      any(getattr(x, "index", None) is None for x in variables):
    return None           # (PuLP 4's HiGHS model does not number the variables)
  import highspy          # (there is a HiGHS model: PuLP found highspy)
  inf = highspy.kHighsInf
  changed = [(x.index, x.lowBound, x.upBound, low, up) for x, low, up in bounds]
  bound = lambda b, default: default if b is None else float(b)
  try:
    for i, _, _, low, up in changed:
      model.changeColBounds(i, bound(low, -inf), bound(up, inf))
    model.run()
    status = model.getModelStatus()
    if status == highspy.HighsModelStatus.kOptimal:
      values = model.getSolution().col_value
      for x in variables:
        x.varValue = values[x.index]
      return Status(_OPTIMAL, "Optimal")
    return Status(0, model.modelStatusToString(status))
  finally:
    for i, low, up, _, _ in changed:
      model.changeColBounds(i, bound(low, -inf), bound(up, inf))


def value(x) -> float | None:
  """The value of a variable or expression in the last solution."""
  return pulp.value(x)


def value_of(terms: Mapping) -> float:
  """``Σ coef · var`` over ``terms`` (var -> coef) at the last solution (a
  variable without a value counts 0), without building the expression."""
  return sum((a * (x.varValue or 0.0) for x, a in terms.items()), 0.0)


def solver(*, gap: float, time_limit: float | None = None, relax: bool = False):
  """(a solver, its name): HiGHS through highspy, else CBC where PuLP has
  it (bundled with PuLP 3). ``relax``: the LP relaxation, with HiGHS's
  presolve off (on these problems it costs more than it saves)."""
  kw = {"gapRel": gap}
  if time_limit is not None:
    kw["timeLimit"] = time_limit
  if relax:
    kw["mip"] = False
  highs = pulp.HiGHS(msg=False, **kw, **({"presolve": "off"} if relax else {}))
  if highs.available():
    _highs_banner_shown()
    return highs, "HiGHS"
  cbc = getattr(pulp, "PULP_CBC_CMD", None) or getattr(pulp, "COIN_CMD", None)
  if cbc is not None and cbc(msg=False).available():
    return cbc(msg=False, **kw), "CBC"
  raise PlanError("autopar: no LP solver is available to PuLP. Fix: pip install "
                  "highspy (installed with autopar).")


_BANNER = threading.Lock()
_banner_done = False


def _highs_banner_shown() -> None:
  """Makes HiGHS's one banner of the process ("Running HiGHS 1.16.0 ...
  Copyright ...") go nowhere: HiGHS writes it to file descriptor 1 from C++
  when the process's first model is made, whatever ``msg=False`` says, so
  the first model is made here with that descriptor on /dev/null (for that
  instant, another thread's writes to it are lost too)."""
  global _banner_done
  with _BANNER:
    if _banner_done:
      return
    _banner_done = True
    import highspy
    if sys.stdout is not None:
      sys.stdout.flush()
    try:
      saved = os.dup(1)
    except OSError:          # no descriptor 1 to print to: nothing to hide
      return
    try:
      null = os.open(os.devnull, os.O_WRONLY)
      try:
        os.dup2(null, 1)
        highspy.Highs()
      finally:
        os.dup2(saved, 1)
        os.close(null)
    finally:
      os.close(saved)


def moved(prob: pulp.LpProblem, expr, twins: dict):
  """``expr`` (a number, variable or expression of another problem) written
  in ``prob``'s variables: each variable gets one twin in ``prob``, kept in
  ``twins`` (PuLP 4 holds a variable to the problem that made it)."""
  if isinstance(expr, numbers.Number):
    return float(expr)
  if isinstance(expr, pulp.LpVariable):
    twin = twins.get(expr.name)
    if twin is None:
      # (PuLP 4 reads an unbounded side back as infinite, and takes only None.)
      low, up = (b if b is not None and math.isfinite(b) else None
                 for b in (expr.lowBound, expr.upBound))
      twin = twins[expr.name] = variable(prob, expr.name, lowBound=low, upBound=up,
                                         cat=expr.cat)
    return twin
  return linear((moved(prob, x, twins), a) for x, a in expr.items()) + float(expr.constant)
