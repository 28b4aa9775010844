"""How a plan is solved again with extra pins (``Plan.replan``), for
``plan.explain`` and ``plan.cost_if`` (``autopar/tools/explain.py``): the
ILPs the planner solved, kept with the plan, solved again with leaves
pinned; where none can hold the pins, the step planned again."""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

from jax.sharding import PartitionSpec

from autopar.errors import PlanError
from autopar.text import axes_str

if TYPE_CHECKING:
  from autopar.plan import Plan


class SolvedProblem(Protocol):
  """What a plan keeps of an ILP solved while planning, as ``Replanner``
  uses it (``planner.shard.SolvedProblem`` is one)."""
  objective: float
  batch_axes: tuple[str, ...]
  kept_axes: tuple[str, ...]

  def can_pin(self, path: str, spec: PartitionSpec) -> bool: ...
  def pinned(self, path: str) -> bool: ...
  def plan(self, pins: Mapping[str, PartitionSpec], *, above: float | None = None
           ) -> "Plan | None": ...

__all__ = ["Replanner", "SolvedProblem"]


@dataclasses.dataclass(eq=False)
class Replanner:
  """How a plan is solved again with extra pins (``Plan.replan``):
  :meth:`plan`.

  Attributes:
    problems: the ILPs solved while planning
      (:class:`~autopar.planner.shard.SolvedProblem`, one per choice of batch
      axes; the plan's first), solved again with the pins; empty for a plan
      read from the plan cache until :meth:`solved` plans the step again.
    step_ref: a weak reference to the step (its ``ParallelizedFunction``;
      ``step.plan`` sets it), for what no problem can answer: a plan is
      data and keeps no step alive.
    args: the step's arguments, as shapes.
    pins: the pins (path -> spec) the plan was made with.
  """
  problems: "tuple[SolvedProblem, ...]" = ()
  step_ref: Callable[[], Any] | None = None
  args: tuple = ()
  pins: Mapping[str, PartitionSpec] = dataclasses.field(default_factory=dict)
  _lock: Any = dataclasses.field(default_factory=threading.Lock, repr=False)
  _tried: bool = dataclasses.field(default=False, repr=False)

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
          f"from get_executable, does not name it). Fix: keep the step alive while "
          f"you read the plan step.plan(...) returns, or {fix}.")
    return step

  def solved(self) -> "tuple[SolvedProblem, ...]":
    """The problems. For a plan read from the plan cache, the step planned
    again once without the cache for them (needs the step); () where
    planning makes no ILP (a step without a gradient marker)."""
    with self._lock:
      if not self.problems and not self._tried:
        self._tried = True
        again = self.replan(
            {}, "this plan, read from the plan cache, keeps no ILP to solve again",
            "plan with AutoShardingOption(plan_cache=False): such a plan keeps it")
        self.problems = again.replan.problems if again.replan is not None else ()
      return self.problems

  def holding(self, pins: Mapping[str, PartitionSpec]) -> "list[SolvedProblem]":
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
    """:meth:`plan`, and the problem it solved (None: planned again)."""
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
    return best

  def replan(self, pins: Mapping[str, PartitionSpec],
             why: str = "this plan keeps no ILP to solve again",
             fix: str = "plan again with the pins (AutoShardingOption(pins=...))"
             ) -> "Plan":
    """The step planned again with ``pins`` added to its method's (every
    choice of batch axes; no plan cache: what-if plans are not kept)."""
    step = self.step(why, fix)
    option = dataclasses.replace(step.method.option, plan_cache=False,
                                 pins={**step.method.option.pin_map, **pins})
    return step.with_method(dataclasses.replace(step.method, option=option)).plan(
        *self.args)
