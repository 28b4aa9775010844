"""``plan.explain(path)`` and ``plan.cost_if(pins)``: why a spec, and what
another would cost.

Both re-plan the step (the ILP, ``ShardParallel``) with leaves pinned, so
they need the step the plan was made from: a plan returned by
``step.plan(...)`` carries it (``Plan.replan``); a plan loaded from JSON
does not. ``explain`` pins the leaf to each spec it could have, re-plans,
and lists each candidate's objective split into its collectives'
predicted time (communication) and the rest (compute, resharding and
other costs), and its memory per device; the chosen spec is marked and the
deciding term named: a user pin, the memory budget, cheaper communication
or less compute. The numbers of each row add up to that plan's objective.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import TYPE_CHECKING, Any, Callable, Mapping

from jax.sharding import PartitionSpec

from autopar.errors import AutoparError, PlanError
from autopar.strategies import enumerate_specs
from autopar.tools.diff import PlanDiff, diff
from autopar.tools.groups import param_rows, path_str
from autopar.tools.summary import collective_rows
from autopar.tools.text import canonical_str, format_bytes, format_rows, same_spec

if TYPE_CHECKING:
  from autopar.plan import Plan, ValuePlan

__all__ = ["Replanner", "Candidate", "Explanation", "CostIf", "explain", "cost_if",
           "find_leaves"]


@dataclasses.dataclass(frozen=True)
class Replanner:
  """Plans a ``ShardParallel`` step again with extra pins: ``plan(pins)``.

  Attributes:
    step_ref: a weak reference to the step (its ``ParallelizedFunction``):
      a plan is data and keeps no step alive.
    args: the step's arguments, as shapes.
    pins: the pins (path -> spec) the plan was made with.
  """
  step_ref: Callable[[], Any]
  args: tuple
  pins: Mapping[str, PartitionSpec]

  def step(self):
    step = self.step_ref()
    if step is None:
      raise PlanError("explain / cost_if re-plan the step this plan was made from, and "
                      "that step (its ParallelizedFunction) is gone. Fix: keep the step "
                      "alive while you read its plan, or plan again with step.plan(...).")
    return step

  def plan(self, pins: Mapping[str, PartitionSpec]) -> "Plan":
    """The step's plan with ``pins`` added to its method's (no plan cache:
    what-if plans are not kept)."""
    step = self.step()
    option = dataclasses.replace(step.method.option, plan_cache=False,
                                 pins={**step.method.option.pin_map, **pins})
    return step.with_method(dataclasses.replace(step.method, option=option)).plan(
        *self.args)


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One spec a leaf could have, and the plan re-solved with it pinned."""
  spec: PartitionSpec
  objective: float | None        # None: no plan with this spec (see ``note``)
  communication: float = 0.0     # the collectives' predicted seconds
  other: float = 0.0             # compute, resharding, the rest of the objective
  memory: int = 0
  note: str = ""
  error: str = ""                # why there is no plan with this spec


@dataclasses.dataclass(frozen=True)
class Explanation:
  """Why ``leaf`` has its spec (``str()``: a table)."""
  leaf: str
  shape: tuple
  chosen: PartitionSpec
  candidates: tuple[Candidate, ...]
  decided_by: str
  also: tuple[str, ...] = ()     # other leaves the pattern matched

  def __str__(self) -> str:
    lines = [f"{self.leaf}  shape {self.shape}: chosen {canonical_str(self.chosen)}"]
    rows = [("", "spec", "objective", "communication", "compute and other",
             "memory/device", "")]
    for c in self.candidates:
      mark = "*" if same_spec(c.spec, self.chosen) else ""
      if c.objective is None:
        rows.append((mark, canonical_str(c.spec), "-", "-", "-", "-", c.note))
      else:
        rows.append((mark, canonical_str(c.spec), _ms(c.objective), _ms(c.communication),
                     _ms(c.other), format_bytes(c.memory), c.note))
    lines += format_rows(rows)
    lines.append(f"decided by: {self.decided_by}")
    if self.also:
      lines.append(f"(the pattern also matches {len(self.also)} other leaf(s), e.g. "
                   f"{self.also[0]})")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class CostIf:
  """The plan re-solved with ``pins``: objectives before and after, and the
  difference between the plans."""
  pins: Mapping[str, PartitionSpec]
  before: float
  after: float
  plan: "Plan"
  diff: PlanDiff

  @property
  def change(self) -> float:
    return self.after - self.before

  def __str__(self) -> str:
    pins = ", ".join(f"{k} = {canonical_str(v)}" for k, v in self.pins.items())
    rel = f" ({self.change / self.before:+.1%})" if self.before else ""
    return (f"with {pins}: objective {_ms(self.before)} -> {_ms(self.after)}"
            f"{rel}\n\n{self.diff}")


def _ms(t: float) -> str:
  return f"{t * 1e3:.4g} ms"


def find_leaves(plan: "Plan", pattern: str) -> list["ValuePlan"]:
  """The plan's inputs whose pytree path (``state.params['params']...``) or
  its slash form (``state/params/params/...``) is ``pattern``, or matches it
  as a glob; of those, the parameters if any match (a glob such as
  ``*Block_*/kernel`` also matches the optimizer state's paths); else the
  intermediates named so."""
  exact = [v for v in plan.inputs if pattern in (v.name, path_str(v.name))]
  if exact:
    return exact
  found = [v for v in plan.inputs if fnmatch.fnmatchcase(v.name, pattern) or
           fnmatch.fnmatchcase(path_str(v.name), pattern)]
  params = {r.value.name for r in param_rows(plan)}
  if any(v.name in params for v in found):
    found = [v for v in found if v.name in params]
  if found:
    return found
  return [v for v in plan.intermediates if fnmatch.fnmatchcase(v.name, pattern)]


def _replanner(plan: "Plan", what: str) -> Replanner:
  if plan.replan is None:
    raise PlanError(
        f"{what} re-plans the step, and this plan does not carry it (a plan loaded "
        f"from JSON, or one a method other than ShardParallel made). Fix: call it on "
        f"the plan from step.plan(*args) with a ShardParallel step (or `autopar "
        f"explain plan.json PATH --step module:function --args module:make_args`).")
  plan.replan.step()          # (the step must still be there)
  return plan.replan


def cost_if(plan: "Plan", pins: Mapping[str, Any]) -> CostIf:
  """The plan re-solved with ``pins`` (input path or glob -> spec) added; a
  glob pins the parameters it matches (not their optimizer state), or the
  inputs it matches if it matches no parameter."""
  r = _replanner(plan, "cost_if")
  exact = {}
  for pattern, spec in pins.items():
    leaves = [v for v in find_leaves(plan, pattern) if v in plan.inputs]
    if not leaves:
      raise PlanError(f"cost_if: {pattern!r} names no input of the plan. Fix: use a "
                      f"path from plan.inputs (e.g. {plan.inputs[0].name!r}) or a glob.")
    for v in leaves:
      exact[v.name] = spec if isinstance(spec, PartitionSpec) else PartitionSpec(*spec)
  other = r.plan(exact)
  return CostIf(pins=exact, before=plan.objective, after=other.objective, plan=other,
                diff=diff(plan, other))


def _candidate(r: Replanner, leaf: "ValuePlan", spec) -> Candidate:
  try:
    p = r.plan({leaf.name: spec})
  except AutoparError as e:
    return Candidate(spec, None, note="no plan", error=str(e).splitlines()[0])
  comm = sum(row["seconds"] for row in collective_rows(p))
  return Candidate(spec, p.objective, comm, p.objective - comm, p.memory_per_device)


def explain(plan: "Plan", pattern: str, *, max_candidates: int = 16) -> Explanation:
  """Why the leaf ``pattern`` names has its spec (see the module docstring)."""
  leaves = find_leaves(plan, pattern)
  if not leaves:
    raise PlanError(f"explain: {pattern!r} names no leaf of the plan. Fix: use a path "
                    f"from plan.inputs (e.g. {plan.inputs[0].name!r}), its slash form, "
                    f"or a glob such as '*Block_0*kernel'.")
  leaf, also = leaves[0], tuple(v.name for v in leaves[1:])
  if leaf not in plan.inputs:
    return Explanation(leaf.name, tuple(leaf.shape), leaf.spec, (),
                       "an intermediate value: the ILP chose it with its equation; "
                       "candidates are listed for argument leaves only", also)
  r = _replanner(plan, "explain")
  specs = enumerate_specs(leaf.shape, plan.mesh_axis_names, plan.axis_sizes)
  if not any(same_spec(s, leaf.spec) for s in specs):
    specs = [leaf.spec] + list(specs)
  specs = sorted(specs, key=lambda s: not same_spec(s, leaf.spec))
  left_out = max(0, len(specs) - max_candidates)
  specs = specs[:max_candidates]
  comm = sum(row["seconds"] for row in collective_rows(plan))
  candidates = []
  for s in specs:
    if same_spec(s, leaf.spec):
      candidates.append(Candidate(s, plan.objective, comm, plan.objective - comm,
                                  plan.memory_per_device, "chosen"))
    else:
      candidates.append(_candidate(r, leaf, s))
  decided = _decided_by(plan, r, leaf, candidates)
  if left_out:
    decided += f" (among the first {max_candidates} specs; {left_out} more not tried)"
  return Explanation(leaf.name, tuple(leaf.shape), leaf.spec, tuple(candidates),
                     decided, also)


def _decided_by(plan, r: Replanner, leaf, candidates) -> str:
  if leaf.name in r.pins:
    return "a user pin (AutoShardingOption(pins=...))"
  chosen = candidates[0]
  others = [c for c in candidates[1:] if c.objective is not None]
  budget = (plan.costs or {}).get("memory_budget_per_device")
  over = [c for c in candidates[1:] if c.objective is None and "memory" in c.error]
  if not others:
    return "the only spec with a plan" + (
        f" ({len(over)} other(s) exceed the memory budget)" if over else "")
  best = min(others, key=lambda c: c.objective)
  if best.objective < chosen.objective * (1 - 1e-6):
    # Pinned alone, the leaf can leave the choice it shares with the leaves
    # of its shape and role (the repeated layers'); or the solver stopped
    # short of the optimum.
    return (f"not the cheapest by this measure: pinned alone, "
            f"{canonical_str(best.spec)} plans at {_ms(best.objective)} (the leaf's "
            f"choice is shared with the leaves like it, or the solver's tolerance)")
  d_comm = best.communication - chosen.communication
  d_other = best.other - chosen.other
  term = ("cheaper communication" if d_comm >= d_other else
          "less compute and resharding")
  if over and budget:
    term += f"; {len(over)} spec(s) exceed the memory budget ({format_bytes(budget)})"
  return (f"{term}: the next best, {canonical_str(best.spec)}, costs "
          f"{_ms(best.objective - chosen.objective)} more ({_ms(d_comm)} in "
          f"collectives, {_ms(d_other)} in compute and other)")
