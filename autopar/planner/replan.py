"""How a plan is solved again with extra pins (``Plan.replan``), for
``plan.explain`` and ``plan.cost_if`` (``autopar/tools/explain.py``): the
ILPs the planner solved, kept with the plan or read back from its JSON
(``solved.py``), solved again with leaves pinned; where none can hold the
pins, the step planned again."""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, Any, Callable, Mapping

from jax.sharding import PartitionSpec

from autopar.errors import PlanError
from autopar.plan import SavedILPs, spec_to_json
from autopar.planner.cache import planner_digest
from autopar.planner.solved import READ_FIX, SolvedProblem, decode, encode
from autopar.text import axes_str

if TYPE_CHECKING:
  from autopar.plan import Plan

__all__ = ["Replanner"]


@dataclasses.dataclass(eq=False)
class Replanner:
  """How a plan is solved again with extra pins (``Plan.replan``):
  :meth:`plan`.

  Attributes:
    problems: the ILPs solved while planning (:class:`SolvedProblem`, one
      per choice of batch axes; the plan's first), solved again with the
      pins; empty until :meth:`solved` reads ``saved`` (or plans the step
      again, for a plan that keeps none).
    saved: the problems as the plan's JSON saved them (a plan read from
      JSON or from the plan cache), read on first use.
    step_ref: a weak reference to the step (its ``ParallelizedFunction``;
      ``step.plan`` sets it), for what no problem can answer: a plan is
      data and keeps no step alive.
    args: the step's arguments, as shapes.
    pins: the pins (path -> spec) the plan was made with.
    added: the pins ``cost_if`` added (path -> spec), for the plan it
      returns: solving this plan again holds them too.
  """
  problems: tuple[SolvedProblem, ...] = ()
  saved: SavedILPs | None = None
  step_ref: Callable[[], Any] | None = None
  args: tuple = ()
  pins: Mapping[str, PartitionSpec] = dataclasses.field(default_factory=dict)
  added: Mapping[str, PartitionSpec] = dataclasses.field(default_factory=dict)
  _lock: Any = dataclasses.field(default_factory=threading.Lock, repr=False)
  _tried: bool = dataclasses.field(default=False, repr=False)
  _text: str | None = dataclasses.field(default=None, repr=False)

  @staticmethod
  def of(plan: "Plan") -> "Replanner | None":
    """The plan's replanner: its own, or one of the ILPs its JSON saved
    (read once, whichever copy of the plan asks); None if it keeps none."""
    return _of(plan.replan)

  @staticmethod
  def with_step(replan, step_ref: Callable[[], Any], args: tuple,
                pins: Mapping[str, PartitionSpec]) -> "Replanner":
    """``replan`` (a plan's: a Replanner, saved ILPs or None) with a weak
    reference to the step and its arguments (``step.plan``)."""
    r = _of(replan) or Replanner()
    with r._lock:
      text = r._text           # (written once, whichever replanner asks)
    return Replanner(problems=r.problems, saved=r.saved, step_ref=step_ref, args=args,
                     pins=pins, added=r.added, _text=text)

  def to_json(self) -> dict:
    """What ``Plan.to_json`` saves of it: ``"ilp"``, the problems
    (``solved.encode``), and ``"ilp_pins"``, the pins ``cost_if`` added; {}
    if there are no problems."""
    with self._lock:
      if self._text is None:
        if self.saved is not None and (not self.problems or
                                       self.problems is self.saved.read):
          self._text = self.saved.text       # (as read: written again unchanged)
        elif self.problems and all(p.problem.memory_budget is None for p in self.problems):
          # (A problem solved within a memory budget holds it with the
          # copies a plan makes of the pass's values, which only the
          # traced step gives: it is not saved.)
          self._text = encode(self.problems, planner_digest())
      text = self._text
    if text is None:
      return {}
    return {"ilp": text, **({"ilp_pins": {k: spec_to_json(v) for k, v in
                                          self.added.items()}} if self.added else {})}

  def what_if(self, pins: Mapping[str, PartitionSpec]) -> "Replanner":
    """The replanner of the plan solved with ``pins`` added (``cost_if``'s):
    the same problems, the pins held in every solve after."""
    with self._lock:
      text = self._text
    return Replanner(problems=self.problems, saved=self.saved, step_ref=self.step_ref,
                     args=self.args, pins=self.pins, added={**self.added, **pins},
                     _text=text)

  @property
  def problem(self) -> "SolvedProblem | None":
    """The plan's own problem (None if it keeps none)."""
    return self.problems[0] if self.problems else None

  def step(self, why: str, fix: str):
    """The step; PlanError if it is gone (``why``: what needs it)."""
    step = self.step_ref() if self.step_ref is not None else None
    if step is None:
      raise PlanError(
          f"explain / cost_if: {why}, which plans the step this plan was made from "
          f"again, and that step (its ParallelizedFunction) is gone (or the plan, "
          f"from get_executable or from JSON, does not name it). Fix: {fix}.")
    return step

  def solved(self) -> tuple[SolvedProblem, ...]:
    """The problems: the planner's, or those the plan's JSON saved, read
    here once. A plan with none (saved by an older autopar, or read by
    another) has the step planned again once, without the plan cache, for
    them (which needs the step); () where planning makes no ILP (a step
    without a gradient marker)."""
    with self._lock:
      unread = None
      if not self.problems and self.saved is not None:
        try:
          self.problems = _read(self.saved)
        except PlanError as e:
          unread = e
      if not self.problems and not self._tried:
        if unread is not None and (self.step_ref is None or self.step_ref() is None):
          raise PlanError(f"explain / cost_if: {unread}") from None
        self._tried = True
        why = ("this plan keeps no ILP to solve again" if unread is None else
               f"this plan's saved ILPs cannot be read "
               f"({str(unread).removesuffix(' ' + READ_FIX)})")
        again = self.replan(
            {}, why, "make the plan again with this autopar (step.plan(*args) with "
            "ShardParallel) and explain that plan, or save it (Plan.to_json()) and "
            "explain the file: a plan keeps its ILPs")
        again_r = Replanner.of(again)
        self.problems = again_r.solved() if again_r is not None else ()
      return self.problems

  def holding(self, pins: Mapping[str, PartitionSpec]) -> list[SolvedProblem]:
    """The problems some choice of which gives every pin."""
    return [p for p in self.solved()
            if all(p.can_pin(path, spec) for path, spec in pins.items())]

  def why_not(self, path: str) -> str:
    """Why no problem gives the leaf ``path`` a spec, for a person."""
    if self.problems[0].pinned(path):
      return "the leaf is pinned (AutoShardingOption(pins=...))"
    tried = "; ".join(axes_str(p.batch_axes) + (
        f" (splits over {axes_str(p.kept_axes)} kept from a plan)" if p.kept_axes
        else "") for p in self.problems)
    return f"no ILP solved while planning gives it (batch over {tried})"

  def plan(self, pins: Mapping[str, PartitionSpec]) -> "Plan":
    """The plan with ``pins`` added: the cheapest of the problems that can
    hold them solved again (each pin holds its leaf's class there, see
    ``SolvedProblem.sharing``), as planning chose; else the step planned
    again."""
    return self.solve(pins)[0]

  def solve(self, pins: Mapping[str, PartitionSpec]
            ) -> "tuple[Plan, SolvedProblem | None]":
    """:meth:`plan` (with the pins ``added`` held too), and the problem it
    solved (None: planned again)."""
    pins = {**self.added, **pins}
    problems = self.solved()
    if not problems:
      return self.replan(pins), None
    holding = self.holding(pins)
    if not holding:
      alone = [(p, s) for p, s in pins.items() if not any(q.can_pin(p, s)
                                                          for q in problems)]
      why = (f"{alone[0][0]} = {alone[0][1]}: {self.why_not(alone[0][0])}" if alone
             else "no one ILP solved while planning gives every pin")
      return self.replan(pins, why, "plan again with the pins "
                                    "(AutoShardingOption(pins=...))"), None
    best, error = None, None
    for problem in sorted(holding, key=lambda p: p.objective):   # (stable: own first)
      if best is not None and problem.objective >= best[0].objective:
        break          # pinned, a problem costs at least what it did without pins
      try:
        plan = problem.plan(pins, above=best[0].objective if best else None)
      except PlanError as e:
        error = error or e
        continue
      if plan is not None and (best is None or plan.objective < best[0].objective):
        best = (plan, problem)
    if best is None:
      raise error
    plan, problem = best
    return dataclasses.replace(plan, replan=self.what_if(pins)), problem

  def replan(self, pins: Mapping[str, PartitionSpec],
             why: str = "this plan keeps no ILP to solve again",
             fix: str = "plan again with the pins (AutoShardingOption(pins=...))"
             ) -> "Plan":
    """The step planned again with ``pins`` added to its method's (every
    choice of batch axes; no plan cache: what-if plans are not kept)."""
    step = self.step(why, f"keep the step alive while you read the plan "
                          f"step.plan(...) returns, or {fix}")
    option = dataclasses.replace(step.method.option, plan_cache=False,
                                 pins={**step.method.option.pin_map, **self.added,
                                       **pins})
    return step.with_method(dataclasses.replace(step.method, option=option)).plan(
        *self.args)


def _of(replan) -> Replanner | None:
  """A ``Plan.replan`` value as a Replanner (:meth:`Replanner.of`)."""
  if replan is None or isinstance(replan, Replanner):
    return replan
  return Replanner(saved=replan, added=replan.pins)


def _read(saved: SavedILPs) -> tuple[SolvedProblem, ...]:
  """The problems ``saved`` holds, read once for every plan that shares it
  (``solved.decode``; PlanError if they cannot be read here)."""
  with saved.lock:
    if saved.read is None:
      saved.read = decode(saved.text, planner_digest())
    return saved.read
