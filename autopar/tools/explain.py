"""``plan.explain(path)`` and ``plan.cost_if(pins)``: why a spec, and what
another would cost.

Both solve again, with leaves pinned, the ILPs the planner solved. A plan
that ``ShardParallel``'s solver made (``step.plan(...)``,
``get_executable``) keeps them (``Plan.replan``: one solved problem per
choice of batch axes tried, the plan's first, each with the template that
turns its solutions into plans; never an array, never the step), and so
does its JSON (``Plan.to_json``'s ``"ilp"``: ``planner/solved.py``). So
both work after the step is gone, on a plan read with ``Plan.from_json``,
from the plan cache or in another process, and fast: nothing is traced; a
plan read back builds its problems again on its first ``explain`` or
``cost_if``, as planning built them; a pin holds the variables of the
leaf's other choices at 0 for one solve (``ShardingProblem.solve_pinned``).
As planning did, the cheapest of the problems that can hold the pins gives
the answer; a problem whose objective without the pins is already dearer
than the best found is not solved again.

``explain`` does so once per spec the leaf could have and lists each
candidate's objective split into its collectives' predicted time
(communication) and the rest (compute, resharding and other costs), its
memory per device, and the batch axes where they are not the plan's; the
chosen spec is marked and the deciding term named: a user pin, a pin of
``cost_if`` (on the plan it returns), the memory budget, cheaper
communication or less compute. The numbers of each row add up to that
solution's objective.

Where a pin holds:
  * a leaf's class: in a problem, the leaves of one class (the same tensor
    of layers alike, ``ShardingProblem._classes``) share their variables,
    so a pin holds the whole class, repeated layers alike; the explanation
    and ``cost_if`` name the leaves held with it.
  * a spec no problem can give (one that needs the batch split over axes
    not tried, or a split the problem kept from another plan) is a row
    without numbers ("not in the ILP"); ``cost_if`` plans the step again
    for it (every choice of batch axes, the leaf pinned alone), which needs
    the step alive.

A plan with no problems to solve raises a ``PlanError`` that says why and
the fix (:func:`no_ilp`): a preset's or a pipeline's plan (no ILP chose its
specs), a step without a grad marker, a plan saved by an autopar from before
plans saved their problems, or problems another autopar saved (their costs
are another cost model's).

Example::

    plan = step.plan(*abstract_args)
    del step
    print(plan.explain("*layers*3*mlp_in*kernel"))
    print(plan.cost_if({"*mlp_in*kernel": P(None, "model")}))
    again = Plan.from_json(plan.to_json())      # (in any process)
    print(again.explain("*layers*3*mlp_in*kernel"))
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import TYPE_CHECKING, Any, Mapping

from jax.sharding import PartitionSpec

from autopar.errors import AutoparError, PlanError
from autopar.planner.replan import Replanner
from autopar.costs.strategies import enumerate_specs, without_unit_axes
from autopar.frontend.hints import entry_axes
from autopar.tools.diff import PlanDiff, diff
from autopar.tools.groups import param_rows, path_str
from autopar.tools.summary import collective_rows
from autopar.text import (axes_str, canonical_str, format_bytes, format_rows,
                                 same_spec)

if TYPE_CHECKING:
  from autopar.plan import Plan, ValuePlan
  from autopar.planner.solved import SolvedProblem

__all__ = ["Candidate", "Explanation", "CostIf", "explain", "cost_if",
           "find_leaves", "no_ilp"]


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
  held: tuple[str, ...] = ()     # the leaves each row pins with it (its class)

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
    if self.held:
      lines.append(f"each row pins it with the {len(self.held)} other leaf(s) that "
                   f"share its choice in the plan's ILP (the same tensor of layers "
                   f"alike), e.g. {self.held[0]}")
    for why in dict.fromkeys(c.error for c in self.candidates if c.note == OUTSIDE):
      specs = ", ".join(canonical_str(c.spec) for c in self.candidates
                        if c.note == OUTSIDE and c.error == why)
      lines.append(f"'{OUTSIDE}' ({specs}): {why}; plan.cost_if({{path: spec}}) plans "
                   f"the step again for one")
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
  held: tuple[str, ...] = ()     # leaves pinned with them (their classes)

  @property
  def change(self) -> float:
    return self.after - self.before

  def __str__(self) -> str:
    pins = ", ".join(f"{k} = {canonical_str(v)}" for k, v in self.pins.items())
    rel = f" ({self.change / self.before:+.1%})" if self.before else ""
    held = (f"\n(held with them: the {len(self.held)} other leaf(s) that share their "
            f"choices in the plan's ILP, e.g. {self.held[0]})" if self.held else "")
    return (f"with {pins}: objective {_ms(self.before)} -> {_ms(self.after)}"
            f"{rel}{held}\n\n{self.diff}")


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
  r = Replanner.of(plan)
  if r is None or not plan.grads and not r.problems:
    raise PlanError(f"{what} solves again the ILPs a plan was solved with, and "
                    f"{no_ilp(plan)}")
  return r


def no_ilp(plan: "Plan") -> str:
  """Why ``plan`` keeps no ILP to solve again, and the fix (a sentence to
  follow "... and")."""
  shard = ("Fix: plan the step with ShardParallel (step.plan(*args)) and explain "
           "that plan; autopar.diff(this_plan, that_plan) compares the two under "
           "one cost model")
  if plan.stages:
    return (f"this {plan.method} plan has none: its stages' specs come from the "
            f"stage search, whose ILPs a pipeline plan does not keep. {shard}.")
  if plan.method != "ShardParallel":
    return (f"this {plan.method} plan has none: the method's rule gives every leaf "
            f"its spec (the ILP only priced that layout), so there are no other "
            f"specs to price. {shard}.")
  if not plan.grads:
    return ("this plan has none: its step has no grad marker, and ShardParallel "
            "plans such a step as data parallel, without an ILP. Fix: compute the "
            "gradients with autopar.grad or autopar.value_and_grad, and plan again.")
  if (plan.costs or {}).get("memory_budget_per_device") is not None:
    return ("this plan keeps none: it was made within memory_budget_per_device, and "
            "the ILPs that hold a budget count the copies a plan makes of the traced "
            "step's values, which a plan's JSON does not keep. Fix: explain it with the "
            "step: `autopar explain plan.json PATH --step module:function --args "
            "module:make_args`, or plan.explain(...) on the plan step.plan(*args) "
            "returns.")
  return ("this plan keeps none: it was saved without them, by an autopar from "
          "before plans saved their ILPs in their JSON (its \"ilp\" entry). Fix: make "
          "the plan again with this autopar (step.plan(*args), or `autopar plan`) and "
          "save it again, or explain it with the step: `autopar explain plan.json PATH "
          "--step module:function --args module:make_args`.")


def _held(problem: "SolvedProblem | None", paths) -> tuple[str, ...]:
  """The leaves ``problem`` pins with ``paths`` (their classes), less those."""
  if problem is None:
    return ()
  paths = set(paths)
  return tuple(dict.fromkeys(k for p in paths for k in problem.sharing(p)
                             if k not in paths))


def cost_if(plan: "Plan", pins: Mapping[str, Any]) -> CostIf:
  """The plan solved again with ``pins`` (input path or glob -> spec) added;
  a glob pins the parameters it matches (not their optimizer state), or the
  inputs it matches if it matches no parameter (see the module docstring)."""
  r = _replanner(plan, "cost_if")
  exact = {}
  for pattern, spec in pins.items():
    leaves = [v for v in find_leaves(plan, pattern) if v in plan.inputs]
    if not leaves:
      raise PlanError(f"cost_if: {pattern!r} names no input of the plan. Fix: use a "
                      f"path from plan.inputs (e.g. {plan.inputs[0].name!r}) or a glob.")
    for v in leaves:
      exact[v.name] = spec if isinstance(spec, PartitionSpec) else PartitionSpec(*spec)
  other, problem = r.solve(exact)
  return CostIf(pins=exact, before=plan.objective, after=other.objective, plan=other,
                diff=diff(plan, other), held=_held(problem, exact))


OUTSIDE = "not in the ILP"


def _communication(plan: "Plan") -> float:
  """The seconds of the plan's objective spent in collectives: the
  model's own (``Plan.predicted_time``, the gradient sync's latency once and
  each collective's its own), or priced from the plan's collectives where
  it has none."""
  if plan.predicted_time:
    return sum(t["collectives"] for t in plan.predicted_time.values())
  return sum(row["seconds"] for row in collective_rows(plan))


def _candidate(r: Replanner, leaf: "ValuePlan", spec, plan: "Plan") -> Candidate:
  if r.problems and not r.holding({leaf.name: spec}):
    return Candidate(spec, None, note=OUTSIDE, error=r.why_not(leaf.name))
  try:
    p = r.plan({leaf.name: spec})
  except AutoparError as e:
    return Candidate(spec, None, note="no plan", error=str(e).splitlines()[0])
  comm = _communication(p)
  got = next(v.spec for v in p.inputs if v.name == leaf.name)
  notes = ([] if same_spec(got, spec) else [f"planned as {canonical_str(got)}"]) + (
      [] if p.batch_axes == plan.batch_axes else
      [f"batch over {axes_str(p.batch_axes)}"])
  note = "; ".join(notes)
  return Candidate(spec, p.objective, comm, p.objective - comm, p.memory_per_device,
                   note)


def explain(plan: "Plan", pattern: str, *, max_candidates: int = 16) -> Explanation:
  """Why the leaf ``pattern`` names has its spec (see the module docstring).

  Example::

      plan = step.plan(*abstract_args)
      print(plan.explain("*layers*3*mlp_in*kernel"))
  """
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
  r.solved()
  # Over the axes of size > 1, as the planner searched (one of size 1 splits
  # nothing, and each would multiply the specs); the leaf's own spec as the
  # plan gives it (a pin may name an axis of size 1).
  sizes = plan.axis_sizes
  split_axes = [a for a, n in sizes.items() if n > 1]
  own = tuple(entry_axes(e) for e in leaf.spec)
  own = without_unit_axes(own + ((),) * (len(leaf.shape) - len(own)), sizes)
  specs = [leaf.spec if s == own else s
           for s in enumerate_specs(leaf.shape, split_axes, sizes)]
  if not any(same_spec(s, leaf.spec) for s in specs):
    specs = [leaf.spec] + list(specs)
  specs = sorted(specs, key=lambda s: not same_spec(s, leaf.spec))
  left_out = max(0, len(specs) - max_candidates)
  specs = specs[:max_candidates]
  comm = _communication(plan)
  candidates = []
  for s in specs:
    if same_spec(s, leaf.spec):
      candidates.append(Candidate(s, plan.objective, comm, plan.objective - comm,
                                  plan.memory_per_device, "chosen"))
    else:
      candidates.append(_candidate(r, leaf, s, plan))
  decided = _decided_by(plan, r, leaf, candidates)
  if left_out:
    decided += f" (among the first {max_candidates} specs; {left_out} more not tried)"
  return Explanation(leaf.name, tuple(leaf.shape), leaf.spec, tuple(candidates),
                     decided, also, held=_held(r.problem, [leaf.name]))


def _decided_by(plan, r: Replanner, leaf, candidates) -> str:
  if leaf.name in r.pins or r.problem is not None and r.problem.pinned(leaf.name):
    return "a user pin (AutoShardingOption(pins=...))"
  if leaf.name in r.added:
    return "a pin of plan.cost_if (this plan is the one cost_if made with it)"
  chosen = candidates[0]
  others = [c for c in candidates[1:] if c.objective is not None]
  budget = (plan.costs or {}).get("memory_budget_per_device")
  over = [c for c in candidates[1:] if c.objective is None and "memory" in c.error]
  if not others:
    return "the only spec with a plan" + (
        f" ({len(over)} other(s) exceed the memory budget)" if over else "")
  best = min(others, key=lambda c: c.objective)
  if best.objective < chosen.objective * (1 - 1e-6):
    # The rows solve again the problems planning chose among: a pin can beat
    # the plan only by what the planner counts as a tie (0.1 %, where it keeps
    # the larger batch split) or by the solver's gap.
    return (f"a tie: {canonical_str(best.spec)} plans at {_ms(best.objective)}, "
            f"within what the planner tells apart (0.1 %: of plans that cost the "
            f"same it keeps the one that splits the batch over more devices) or "
            f"the solver's tolerance")
  d_comm = best.communication - chosen.communication
  d_other = best.other - chosen.other
  term = ("cheaper communication" if d_comm >= d_other else
          "less compute and resharding")
  if over and budget:
    term += f"; {len(over)} spec(s) exceed the memory budget ({format_bytes(budget)})"
  return (f"{term}: the next best, {canonical_str(best.spec)}, costs "
          f"{_ms(best.objective - chosen.objective)} more ({_ms(d_comm)} in "
          f"collectives, {_ms(d_other)} in compute and other)")
