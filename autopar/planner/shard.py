"""Choose a :class:`~autopar.plan.Plan` for a split step under a method:
the helpers every planner shares, and ``ShardParallel``'s.

The preset methods (DataParallel, ZeRO-2, ZeRO-3) are planned in
``preset.py``. ``ShardParallel`` is planned by :func:`plan_auto`: one ILP
(``ilp.py``) per choice of batch axes, the cheapest solution becoming the
plan. A step without a grad marker is planned as data parallel over the
largest set of axes that divides its batch.

Donated inputs are paired with the outputs that replace them (the new train
state), and each pair gets one sharding, so that XLA can update in place.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import math
import sys
import time
from typing import Sequence

from jax.extend.core import Literal, Var
from jax.sharding import PartitionSpec

from autopar import jax_compat as jc
from autopar.costs.cost_model import MeshCost, assumed_costs, dtype_name
from autopar.costs.devices import platform_of
from autopar.errors import InputError, PlanError
from autopar.frontend.hints import check_hints, check_pins, entry_axes, model_axes
# Imported here, not where it is used: importing PuLP keeps the tracebacks of
# the solver libraries it fails to import, and through them every frame on
# the stack at the time; from inside plan_auto that would keep its problem
# and traced step alive for the rest of the process.
from autopar.planner.ilp import ShardingProblem
from autopar.method import (ParallelMethod, ShardParallel, axis_names_of,
                            axis_sizes_of, check_axes, split_axes_of)
from autopar.plan import Plan
from autopar.frontend.pytrees import key_parts
from autopar.frontend.split import (OutputKind, SizedOutputs, SplitStep, leaf_gather_sites,
                                    leaves_read_by_compute,
                                    outputs_at)
from autopar.costs.strategies import (grad_sync_costs, grad_sync_latency,
                                      missing_rules, warn_missing_rules)
from autopar.costs.strategies.dot import dot_flops
from autopar.planner.ilp_saved import Aval
from autopar.planner.replan import Replanner
from autopar.planner.solved import PlanTemplate, Program, SolvedProblem, spec_axes
from autopar.frontend.trace import TracedStep, eqns_by_path

__all__ = ["plan_auto", "plan_template", "sharding_problem", "price_layout", "LayoutPrices",
           "donation_pairs", "grad_inputs",
           "batch_axes_for", "shard_first_divisible",
           "candidate_batch_axes", "keeps_batch_whole"]


def batch_axes_for(method: ParallelMethod, mesh, hints=()) -> tuple[str, ...]:
  """The mesh axes a preset method splits the batch over: its ``batch_axes``,
  by default every axis of size > 1 (``split_axes_of``) that no sharding
  hint of the gradient computation needs for a dimension other than the
  rows (``hints.model_axes``). Axes the user names are kept as named, those
  of size 1 included."""
  axes = getattr(method, "batch_axes", None)
  if isinstance(method, ShardParallel):
    axes = method.option.forced_batch_axes(mesh)
  if axes is None:
    taken = model_axes({h.path: h for h in hints if h.part == "compute"})
    return tuple(a for a in split_axes_of(mesh) if a not in taken)
  check_axes(axes, mesh, f"{method.name}: batch axes")
  return tuple(axes)


def shard_first_divisible(shape: Sequence[int], axes: Sequence[str],
                          sizes: dict[str, int]) -> PartitionSpec:
  """Spec splitting the first dimension of ``shape`` that ``axes`` divide."""
  p = math.prod(sizes[a] for a in axes)
  if not axes or p == 1:
    return PartitionSpec()
  for d, n in enumerate(shape):
    if n % p == 0 and n >= p:
      entry = axes[0] if len(axes) == 1 else tuple(axes)
      return PartitionSpec(*([None] * d), entry)
  return PartitionSpec()


def grad_inputs(split: SplitStep) -> tuple[str, ...]:
  """Per gradient, the path of the argument leaf it is the gradient of ("" if
  none is found), for a person reading the plan: the leaf whose path ends
  with the gradient's (``grad['params']['w']`` -> ``...['params']['w']``) at
  a key boundary, of its shape, preferring one the gradient computation
  reads (the parameter, not its optimizer state).

  The leaves are indexed by every tail of their key paths, so each gradient
  is one lookup (matching every gradient against every leaf is quadratic
  in the depth: a million comparisons for a 48-layer GPT)."""
  leaves = split.traced.leaves
  read = leaves_read_by_compute(split)
  names = split.grad_names
  by_tail: dict[tuple, list[int]] = {}
  for k, leaf in enumerate(leaves):
    keys = key_parts(leaf.path)
    for t in range(1, len(keys) + 1):
      by_tail.setdefault((tuple(leaf.shape), keys[-t:]), []).append(k)
  out = []
  for name, aval in zip(names, split.grad_avals if split.has_marker else (), strict=True):
    if len(names) == 1:
      found = [k for k, leaf in enumerate(leaves) if tuple(leaf.shape) == tuple(aval.shape)]
    else:
      keys = key_parts(name[len("grad"):] if name.startswith("grad") else name)
      found = by_tail.get((tuple(aval.shape), keys), []) if keys else []
    found = sorted(found, key=lambda k: k not in read)
    out.append(leaves[found[0]].path if found else "")
  return tuple(out)


def donation_pairs(traced: TracedStep, out_avals=None) -> dict[int, int]:
  """Output leaf index -> donated input leaf index it replaces (traced
  leaves both).

  A donated argument is paired with the whole result, an element of it, or
  an element of one (``(new_state, loss)``; an argument updated in place),
  that has the same pytree structure, the same static leaves' places, and
  the same shapes and dtypes (the new state returned in place of the old).
  ``out_avals``: the outputs' avals, if not those of ``traced``'s jaxpr
  (which may have a symbolic batch size).
  """
  leaves = traced.leaves
  ins, outs = traced.inputs, traced.outputs
  out_avals = [(tuple(a.shape), a.dtype) for a in (
      out_avals or [v.aval for v in traced.jaxpr.jaxpr.outvars])]

  def traced_index(mask):
    """Per leaf, its index among the traced leaves (None: static)."""
    out, k = [], 0
    for d in mask:
      out.append(k if d else None)
      k += d
    return out
  in_index, out_index = traced_index(ins.dynamic), traced_index(outs.dynamic)

  candidates = []                # (first leaf, treedef) of the result's subtrees

  def walk(td, first, depth):
    candidates.append((first, td))
    if depth < 2:
      for child in td.children():
        walk(child, first, depth + 1)
        first += child.num_leaves
  walk(outs.treedef, 0, 0)

  pairs: dict[int, int] = {}
  start = 0
  for td in ins.treedef.children():      # one per non-static argument
    count = td.num_leaves
    mine = [in_index[start + j] for j in range(count)]
    if any(k is not None and leaves[k].is_donated for k in mine):
      for first, out_td in candidates:
        if out_td != td or outs.dynamic[first:first + count] != \
            ins.dynamic[start:start + count]:
          continue
        theirs = [out_index[first + j] for j in range(count)]
        if all(k is None or out_avals[o] == (leaves[k].shape, leaves[k].dtype)
               for k, o in zip(mine, theirs)):
          for k, o in zip(mine, theirs):
            if k is not None:
              pairs.setdefault(o, k)
          break
    start += count
  return pairs


# -- ShardParallel: the ILP ---------------------------------------------------------

def candidate_batch_axes(method: ShardParallel, mesh, micro_batch_size: int,
                         hints=(), *, whole: bool = False) -> list[tuple[str, ...]]:
  """Choices of batch axes to try: every subset of the mesh's axes of size
  > 1 (``split_axes_of``: an axis of size 1 splits nothing, and each one
  would double the choices) that divides the micro-batch, leaves at most
  ``option.max_model_axes`` axes to plan and none that a sharding hint
  needs away from the rows (or the forced one, as the user names it).
  ``whole``: the batch must stay whole (:func:`keeps_batch_whole`): no axis."""
  names = split_axes_of(mesh)
  sizes = axis_sizes_of(mesh)
  option = method.option
  taken = model_axes({h.path: h for h in hints if h.part == "compute"}) & set(names)
  if option.force_data_parallel:
    return [tuple(a for a in names if a not in taken)]
  forced = option.forced_batch_axes(mesh)
  if forced is not None:
    return [forced]
  if whole:
    return [()]
  out = []
  for mask in range(1 << len(names)):
    axes = tuple(a for i, a in enumerate(names) if mask >> i & 1)
    if set(axes) & taken:
      continue
    if len(names) - len(axes) > max(option.max_model_axes, len(taken)):
      continue
    p = math.prod(sizes[a] for a in axes)
    if micro_batch_size and micro_batch_size % p == 0:
      out.append(axes)
    elif not micro_batch_size and not axes:
      out.append(axes)
  # A batch too small to split over enough axes: plan every axis.
  return out or [()]


def keeps_batch_whole(split: SplitStep, method) -> bool:
  """Whether ``method`` must keep the batch whole on ``split``: one
  micro-batch, and a loss or an output that cannot be split over devices
  (it mixes rows, as in-batch negatives do, or is not derived from
  reductions over them; ``loss.py``, ``combine.py``). The planner then
  splits the batch's dimensions like any other, which is exact."""
  loss = split.loss
  return method.micro_batches == 1 and (
      any(k is OutputKind.OTHER for k in split.out_kinds) or
      loss is not None and bool(loss.mixing or (loss.why and loss.how is None)))


class Progress:
  """Planning stages and their times; printed to stderr when planning is long."""

  def __init__(self, name: str, verbose: bool | None, quiet_seconds: float = 2.0):
    self.name = name
    self.verbose = verbose
    self.quiet_seconds = quiet_seconds
    self.start = time.perf_counter()
    self.timings: dict[str, float] = {}

  def add(self, stage: str, seconds: float, detail: str = "") -> None:
    self.timings[stage] = self.timings.get(stage, 0.0) + seconds
    elapsed = time.perf_counter() - self.start
    if self.verbose or (self.verbose is None and elapsed > self.quiet_seconds):
      print(f"autopar: planning {self.name}: {stage} {seconds:.2f} s"
            f"{' (' + detail + ')' if detail else ''}, {elapsed:.1f} s so far",
            file=sys.stderr, flush=True)

  def total(self) -> dict[str, float]:
    return {**self.timings, "total": time.perf_counter() - self.start}


def plan_auto(split: SplitStep, method: ShardParallel, mesh, *, batch_size: int,
              trace_local, outputs: SizedOutputs | None = None,
              progress: Progress | None = None,
              any_batch: SplitStep | None = None) -> Plan:
  """Plans ``split`` with the ILP, trying every choice of batch axes.

  ``split``: the step split at ``batch_size`` rows, or at a symbolic batch
  size (``any_batch``); each choice is planned on the step at its rows per
  device, which ``trace_local(rows)`` returns.
  ``outputs``: the step's outputs at the whole batch (default: ``split``'s
  at ``batch_size``).
  ``any_batch``: the step split at a symbolic batch size, if it could be
  traced so; it bounds the cost of a choice before its problem is built.
  """
  progress = progress or Progress("step", method.option.verbose)
  sizes = axis_sizes_of(mesh)
  # The axes planned: those of size > 1 (an axis of size 1 splits nothing,
  # and each one would multiply every value's choices).
  split_axes = split_axes_of(mesh)
  n = method.micro_batches
  option = method.option
  cost = MeshCost(sizes, option.alpha, option.beta)
  micro = batch_size // n if batch_size else 0
  matmul_flops = _matmul_flops(any_batch) if any_batch is not None else None
  best, errors = None, []
  pending = []
  solved = []         # (objective, S, planned axes, decisions) of each solve
  others = []         # (objective, S, local, problem, rank) of each solve, for explain
  extending = (option.extend_model_axes and not option.force_data_parallel
               and option.forced_batch_axes(mesh) is None)
  # The plan kept: the cheapest, and of plans that cost the same (within
  # what the model can tell apart, ``_cheaper``) the one of lowest rank:
  # the larger batch splits first (their gradients cross devices once a
  # step, whatever the number of micro-batches), then the extended plans
  # in the order they were tried. It does not depend on the order in which
  # choices are solved (the most promising first).
  ranks = itertools.count()

  def settle():
    """Waits for the solves in flight and keeps the best."""
    nonlocal best
    for S, local, problem, future, r in pending:
      try:
        objective = future.result()
      except PlanError as e:
        errors.append((problem, e))
        continue
      finally:
        progress.add("solve", getattr(problem, "solve_seconds", 0.0),
                     f"batch over {S or 'no axes'}: {problem.num_variables} variables")
      others.append((objective, S, local, problem, r))
      if extending:
        solved.append((objective, S, problem.A, problem.decisions()))
    pending.clear()
    if others:
      least = min(o[0] for o in others)
      objective, S, local, problem, r = min(
          (o for o in others if not _cheaper(least, o[0])), key=lambda o: o[4])
      best = (S, objective, local, problem, r)

  def could_win(bound: float, r: int) -> bool:
    """Whether a choice of rank ``r`` whose plans cost at least ``bound``
    could be kept over (or instead of) the plans solved."""
    if best is None:
      return True
    least = min(o[0] for o in others)
    return bound < least or (not _cheaper(least, bound) and r < best[4])

  def start(S, A, d, r, keep=None):
    """Builds the problem of batch axes ``S`` (planned axes ``A``, ``d``
    devices over ``S``, rank ``r``) and hands it to the solver thread
    (nothing, the error kept, if a pin cannot be met or the step cannot be
    made at its rows per device)."""
    t0 = time.perf_counter()
    try:
      local = trace_local(micro // d)
    except InputError as e:
      # The step cannot run at these rows per device (traced at concrete
      # sizes, its program there is not the micro-batch's): another choice
      # of batch axes is planned; the error is raised if none can be.
      errors.append((None, e))
      progress.add("skipped", time.perf_counter() - t0,
                   f"batch over {S}: {micro // d} rows per device: {e}")
      return
    if d > 1:
      progress.add("trace", time.perf_counter() - t0, f"{micro // d} rows per device")
    problem = sharding_problem(local, method, S, A, sizes, cost, micro // d,
                               pins={k: spec_axes(spec) for k, spec in pins.items()},
                               keep=keep)
    try:
      problem.build()
    except PlanError as e:        # a pin no sharding with these batch axes meets
      errors.append((None, e))
      return
    where = f"batch over {S or 'no axes'}"
    progress.add("strategies", problem.timings["strategies"],
                 f"{where}: {len(problem.nodes)} nodes")
    progress.add("classes", problem.timings["classes"],
                 f"{problem.num_classes} classes")
    progress.add("build", problem.timings["build"])
    pending.append((S, local, problem, solver.submit(problem.solve), r))

  def extend(full):
    """Tries each solved plan with one of its batch axes planned as well,
    its planned axes' decisions kept (2-D tensor parallelism from the 1-D
    plans), and so on from those. Each try is a problem about the size of
    the one solved, not the full problem over more axes (ten times larger
    per axis); a try whose cost bound cannot beat the best is skipped, and
    so is one whose batch axes were solved in full (``full``)."""
    tried, done = set(), 0
    while done < len(solved):
      todo = sorted(solved[done:], key=lambda s: s[0])
      done = len(solved)
      for _, S0, A0, decisions in todo:
        for a in S0:
          S = tuple(b for b in S0 if b != a)
          if S in full or (S, S0) in tried:
            continue
          tried.add((S, S0))
          A = tuple(b for b in split_axes if b not in S)
          d = math.prod(sizes[b] for b in S)
          # (No check_hints: S is inside S0, whose check passed.)
          bound = _cost_lower_bound(split, matmul_flops, S, A, sizes, cost, option, n,
                                    micro // d)
          r = next(ranks)
          if not could_win(bound, r):
            continue
          start(S, A, d, r, (A0, decisions))
      settle()

  # Each problem is solved on a worker thread while the next one is built:
  # HiGHS runs without holding the GIL, so building and solving overlap.
  with concurrent.futures.ThreadPoolExecutor(max_workers=1) as solver:
    hints = {h.path: h for h in split.hints}
    pins = check_pins(option.pin_map, split.traced.leaves, sizes) if option.pins else {}
    # Ranked larger batch splits first (``ranks``).
    candidates = sorted(candidate_batch_axes(method, mesh, micro, split.hints,
                                             whole=keeps_batch_whole(split, method)),
                        key=lambda S: -math.prod(sizes[a] for a in S))
    tries = []
    for S in _distinct_up_to_axis_names(candidates, split_axes, sizes, option):
      check_hints(hints, sizes, S, f"the plan with batch axes {S}")
      A = tuple(a for a in split_axes if a not in S)
      d = math.prod(sizes[a] for a in S)
      tries.append((_cost_lower_bound(split, matmul_flops, S, A, sizes, cost, option, n,
                                      micro // d), next(ranks), S, A, d))
    # The most promising choice first (the lowest bound), so that its plan
    # lets the bound skip the choices that cannot beat it.
    for bound, r, S, A, d in sorted(tries, key=lambda t: t[:2]):
      if bound > 0:
        # Every plan with these batch axes costs at least ``bound``. Building
        # its problem takes about as long as the solve in flight: wait for
        # that, and skip this choice if it could not be kept.
        settle()
        if not could_win(bound, r):
          progress.add("skipped", 0.0,
                       f"batch over {S}: its gradient sync and matmuls alone cost "
                       f"at least {bound:.3g} s a step, the plan with batch over "
                       f"{best[0] or 'no axes'} {best[1]:.3g} s")
          continue
      start(S, A, d, r)
    settle()
    if extending and best is not None:
      extend(set(candidates))
  if best is None and option.memory_budget_per_device is None:
    raise errors[0][1]
  if best is None and all(p is None for p, _ in errors):
    raise errors[0][1]
  if best is None:
    need = min(p.min_memory() for p, _ in errors if p is not None)
    raise PlanError(
        f"autopar: no sharding of the step fits memory_budget_per_device="
        f"{option.memory_budget_per_device} bytes on mesh {sizes} with any choice "
        f"of batch axes; the smallest budget that fits is about {need:.0f} bytes. "
        f"Fix: raise memory_budget_per_device to at least {need:.0f}, or use more "
        f"micro-batches or a larger mesh.")
  S, _, local, problem, _ = best
  warn_missing_rules(missing_rules(local.compute, local.apply), "ShardParallel's plan")
  sol = problem.solution()
  outputs = outputs or outputs_at(split, batch_size)
  paths = grad_inputs(split)

  def template(loc, p):
    return plan_template(split, outputs, loc, method, mesh, p.solution_keys(), paths)
  chosen = template(local, problem)
  plan = chosen.plan(S, sol, _stats(local, problem), progress.total(),
                     in_tree=split.traced.inputs, mesh=mesh)
  # Every problem solved (the plan's first) stays with the plan: explain and
  # cost_if solve them again with pins, as planning chose among them, each
  # with the template its plans are made from (Plan.to_json saves both).
  kept = tuple(SolvedProblem(p, objective, chosen if p is problem else template(loc, p),
                             _stats(loc, p), in_tree=split.traced.inputs, mesh=mesh)
               for objective, _, loc, p, _ in sorted(
                   others, key=lambda o: (o[3] is not problem, o[4])))
  return dataclasses.replace(plan, replan=Replanner(problems=kept))


def _stats(local: SplitStep, problem: ShardingProblem) -> dict[str, int]:
  """The size of ``problem`` and its program, for ``SolverStats``."""
  return dict(num_equations=len(local.compute.jaxpr.eqns) + len(local.apply.jaxpr.eqns),
              num_nodes=len(problem.nodes), num_classes=problem.num_classes)


def sharding_problem(local: SplitStep, method, S, A, sizes, cost: MeshCost, rows: int,
                     *, pins=None, keep=None, option=None) -> ShardingProblem:
  """The sharding ILP (unbuilt) of ``local`` (the step split at ``rows`` rows
  per device and micro-batch) with batch axes ``S`` and planned axes ``A``,
  under ``method``'s costs (its option's; the defaults for a method without
  one). Every method's plan is priced by this one problem: the ILP's
  (``plan_auto``), and the presets' with every leaf pinned
  (``preset.py``)."""
  from autopar.method import AutoShardingOption
  option = option or getattr(method, "option", None) or AutoShardingOption()
  traced = local.traced
  arguments = dict(
      compute=local.compute, apply=local.apply, num_consts=len(local.consts),
      leaf_avals=[l.abstract((rows, *l.shape[1:]) if l.is_batch else None)
                  for l in traced.leaves],
      batch_leaves=[l.is_batch for l in traced.leaves],
      donation=_apply_donation(local), num_micro_batches=method.micro_batches,
      batch_axes=S, planned_axes=A, sizes=sizes, cost=cost,
      seconds_per_flop=option.flop_seconds,
      seconds_per_byte=option.byte_seconds,
      flop_rates=option.dtype_flop_seconds,
      platform=platform_of(option.device_kind),
      allow_all_gather=option.allow_all_gather,
      allow_all_to_all=option.allow_all_to_all,
      memory_budget=option.memory_budget_per_device,
      read_by_compute=leaf_gather_sites(local),
      share_layers=option.share_layers, pins=pins or {},
      accumulate=method.grad_accumulation_dtype, grad_sync=method.grad_sync,
      leaf_names=[l.path for l in traced.leaves], keep=keep)
  problem = ShardingProblem(**arguments)
  problem.arguments = arguments
  return problem


def _same_but_pins(built: ShardingProblem, problem: ShardingProblem) -> bool:
  """Whether ``built``, a problem planning built and solved, is
  ``problem`` but for its pins: made by :func:`sharding_problem` from the
  same program (the same jaxpr objects) with equal arguments, with no pins,
  memory budget or kept decisions of its own."""
  a, b = built.arguments, problem.arguments
  if a is None or b is None or a.keys() != b.keys() or built.pins or \
      built.memory_budget is not None or built.keep is not None:
    return False
  return all(a[k] is b[k] if k in ("compute", "apply") else a[k] == b[k]
             for k in a if k not in ("pins", "memory_budget"))


def price_layout(local: SplitStep, method, mesh, batch_axes, in_specs,
                 rows: int, option=None, built: Sequence[ShardingProblem] = ()
                 ) -> tuple[float, dict]:
  """(objective, stage times) of the plan that splits the batch over
  ``batch_axes`` and gives each leaf its spec in ``in_specs``, under the
  model the ILP minimises: a preset's plan priced as ShardParallel's is,
  so that objectives compare across methods (``autopar.diff``).

  ``built``: problems planning built and solved; one that is this layout's
  but for the pins (the same program, batch axes and planned axes) prices
  it solved again with the pins (``ShardingProblem.price_pinned``) instead
  of a problem built anew, a pass over the whole program."""
  sizes = axis_sizes_of(mesh)
  option = option or getattr(method, "option", None)
  cost = MeshCost(sizes, option.alpha if option else {}, option.beta if option else {})
  problem = sharding_problem(
      local, method, tuple(batch_axes), (), sizes, cost, rows, option=option,
      pins={k: spec_axes(spec) for k, (l, spec) in
            enumerate(zip(local.traced.leaves, in_specs)) if not l.is_batch})
  if problem.memory_budget is not None:
    problem.memory_budget = None       # priced, not planned: the budget is not its
  same = next((p for p in built if _same_but_pins(p, problem)), None)
  if same is not None:
    return same.price_pinned(problem.pins)
  problem.build()
  objective = problem.solve()
  return objective, problem.stage_times()


class LayoutPrices:
  """Layouts' stage times (:func:`price_layout`) shared by the calls that
  price one step with one option: ZeRO-2's and ZeRO-3's layouts are one
  problem, priced once; and priced on ``problems`` (those planning built
  and solved) where one is the layout's but for its pins."""

  def __init__(self, problems: Sequence[ShardingProblem] = ()):
    self.problems = tuple(problems)
    self._times: dict = {}

  def stage_times(self, local: SplitStep, method, mesh, batch_axes, in_specs,
                  rows: int, option=None) -> dict:
    """The stage times of :func:`price_layout` (its arguments), priced once."""
    key = (tuple(batch_axes), tuple(map(str, in_specs)), rows, method.micro_batches)
    if key not in self._times:
      self._times[key] = price_layout(local, method, mesh, batch_axes, in_specs, rows,
                                      option=option, built=self.problems)[1]
    return self._times[key]


def _cheaper(a: float, b: float) -> bool:
  """Whether cost ``a`` is below ``b`` by more than the model can tell
  apart (0.1 %): of plans that cost the same, ``plan_auto`` keeps the one
  of lowest rank (the larger batch split)."""
  return a < b * (1 - 1e-3) - 1e-15


def _cost_lower_bound(split: SplitStep, matmul_flops, S, A, sizes, cost: MeshCost,
                      option, n: int, rows: int) -> float:
  """Seconds a step costs at least under any plan with batch axes ``S`` and
  planned axes ``A`` (``rows`` per device and micro-batch): its gradient
  sync, and its matmuls split over every planned axis."""
  bound = _sync_lower_bound(split, S, A, sizes, cost)
  if matmul_flops is not None:
    compute, apply = matmul_flops(rows)
    bound += option.flop_seconds * (n * compute + apply) / math.prod(
        sizes[a] for a in A)
  return bound


def _sync_lower_bound(split: SplitStep, S, A, sizes, cost: MeshCost) -> float:
  """Seconds that any plan with batch axes ``S`` spends at least on the
  gradient sync: each gradient all-reduced over ``S``, split over the planned
  axes ``A`` as finely as its shape allows (the ILP charges each gradient
  its all-reduce at the spec it chooses, ``grad_sync_costs``, and every
  other cost is >= 0)."""
  if not S or not split.has_marker:
    return 0.0
  total, seen = 0.0, {}
  for aval in split.grad_avals:
    key = (tuple(aval.shape), aval.dtype)
    if key not in seen:
      if not all(isinstance(d, int) for d in key[0]):
        seen[key] = 0.0
      else:
        seen[key] = min(grad_sync_costs(aval, A, S, sizes, cost)[1])
    total += seen[key]
  return total + grad_sync_latency(S, cost)


def _matmul_flops(any_batch: SplitStep):
  """``rows -> (compute_grad, apply_grad)`` flops of their top-level
  dot_generals at ``rows`` per micro-batch, counted as the ILP counts them
  (see strategies/dot.py). A strategy divides them by at most the product of
  the planned axes, so with the gradient sync they bound a plan's cost from
  below. Equations inside loops and calls are left out (a lower bound still).
  """
  def dots(closed) -> list:
    """Per dot_general: (lhs shape, output shape, contracting dims)."""
    return [(eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape,
             eqn.params["dimension_numbers"][0][0])
            for eqn in (closed.jaxpr.eqns if closed is not None else ())
            if eqn.primitive.name == "dot_general"]
  parts = dots(any_batch.compute), dots(any_batch.apply)

  def at(rows: int) -> tuple[float, float]:
    env = {"autopar_rows": rows}
    dims: dict = {}           # symbolic dim -> its value (a few distinct ones)
    def dim(d):
      if type(d) is int:
        return d
      v = dims.get(d)
      if v is None:
        v = dims[d] = jc.evaluate_dim(d, env)
      return v
    def shape(s):
      return tuple(map(dim, s))
    return tuple(float(sum(dot_flops(shape(lhs), shape(out), lc)
                           for lhs, out, lc in part))
                 for part in parts)
  return at


def _distinct_up_to_axis_names(candidates, names, sizes, option):
  """Drops batch-axes choices that differ from an earlier one only by the
  names of axes of equal size and cost: their problems are the same up to
  renaming, so their best objectives are equal (e.g. "data" or "model" of an
  8 x 8 mesh with default costs). An axis a pin names is told apart by its
  name: the pin is not renamed with it."""
  alpha, beta = option.alpha, option.beta
  pinned = {a for spec in option.pin_map.values() for e in spec for a in entry_axes(e)}
  def axis(a):
    return (sizes[a], alpha.get(a), beta.get(a), a if a in pinned else "")
  seen, out = set(), []
  for S in candidates:
    sig = (tuple(sorted(axis(a) for a in S)),
           tuple(sorted(axis(a) for a in names if a not in S)))
    if sig not in seen:
      seen.add(sig)
      out.append(S)
  return out


def plan_template(split: SplitStep, outputs: SizedOutputs, local: SplitStep,
                  method: ShardParallel, mesh, keys, grad_paths) -> PlanTemplate:
  """What turns a solution of ``local``'s problem into the plan of
  ``split`` (``solved.PlanTemplate``).

  ``split``: the step, possibly at a symbolic batch size; ``outputs``: its
  outputs and gradients at the whole batch (``outputs_at``); ``local``: the
  step at the rows per device the problem was built at; ``keys``: the
  problem's ``solution_keys()``; ``grad_paths``: ``grad_inputs(split)``."""
  traced = split.traced
  out_avals, out_kinds, grad_avals = outputs
  sizes = axis_sizes_of(mesh)
  option = method.option
  pairs = donation_pairs(traced, out_avals)
  kind_names = {OutputKind.APPLY: "apply", OutputKind.CONCAT: "concat"}
  outs = tuple(
      (path, _aval(a), kind_names.get(kind, "other"), idx,
       split.out_dims[j].dim if kind is OutputKind.CONCAT else None, pairs.get(j))
      for j, (path, a, kind, idx) in enumerate(zip(
          traced.out_paths, out_avals, out_kinds, split.out_index, strict=True)))
  nconst = len(local.consts)
  return PlanTemplate(
      method=method.name, axis_names=axis_names_of(mesh), sizes=sizes,
      num_micro_batches=method.micro_batches,
      prefer_reduce_scatter=bool(option.prefer_reduce_scatter),
      costs=assumed_costs(sizes, option), grad_inputs=tuple(grad_paths),
      has_marker=split.has_marker, grad_sync=method.grad_sync,
      leaves=tuple((l.path, tuple(map(int, l.shape)), dtype_name(l.dtype), l.is_batch)
                   for l in traced.leaves),
      read=frozenset(leaves_read_by_compute(local)),
      pins=check_pins(option.pin_map, traced.leaves, sizes) if option.pins else {},
      grads=tuple((name, _aval(a)) for name, a in zip(split.grad_names, grad_avals,
                                                      strict=True)),
      outputs=outs,
      programs={part: _program(closed.jaxpr, nconst, len(traced.leaves), keys[part])
                for part, closed in (("compute", local.compute), ("apply", local.apply))})


def _aval(a) -> Aval:
  return Aval(tuple(map(int, a.shape)), dtype_name(a.dtype))


def _program(jaxpr, nconst: int, num_leaves: int, keys) -> Program:
  """The equations of one part of the step as a plan names its
  intermediates (``solved.Program``); ``keys``: that part's
  ``ShardingProblem.solution_keys()``."""
  specs, strategies, regions = keys
  ins = jaxpr.invars[nconst:]
  assert len(ins) >= num_leaves, (len(ins), num_leaves)
  number: dict = {}
  for v in ins:                  # the leaves, then (apply_grad) the gradients
    number.setdefault(v, len(number))
  count = len(ins)
  eqns = [(i, eqn) for i, eqn in eqns_by_path(jaxpr) if i in specs]
  for _, eqn in eqns:
    for o in eqn.outvars:
      number.setdefault(o, count)
      count += 1
  entries = tuple(
      (i, tuple(_aval(o.aval) for o in eqn.outvars),
       tuple((number.get(v, -1) if isinstance(v, Var) else -1, _aval(v.aval))
             for v in eqn.invars) if i in strategies else None)
      for i, eqn in eqns)
  paths = dict(eqns_by_path(jaxpr))
  enter = []
  for i, ins_keys in regions.items():
    for key in ins_keys:
      v = paths[i].invars[int(key.lstrip("inx"))]
      if not isinstance(v, Literal):
        shape = v.aval.shape[1:] if key.startswith("x") else v.aval.shape
        enter.append((i, key, Aval(tuple(map(int, shape)), dtype_name(v.aval.dtype))))
  return Program(len(ins), entries, tuple(enter))


def _apply_donation(split: SplitStep) -> dict[int, int]:
  """apply_grad output index -> donated leaf it replaces."""
  pairs = donation_pairs(split.traced)
  return {split.out_index[j]: k for j, k in pairs.items()
          if split.out_kinds[j] is OutputKind.APPLY}
