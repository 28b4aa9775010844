"""The stage search: how many stages, which layers, which submeshes.

Alpa's two-level search, with the link between stages priced:

1. **Layer costs.** Each layer is planned alone as a stage (``stage.
   solve_stage``, the intra-stage ILP) on every submesh shape
   (``submesh.block_shapes``) and every choice of batch axes there. Layers
   that compute alike (same stage program, same update) are solved once.
   Per layer, shape and batch axes: ``t`` (forward + backward of one
   micro-batch), ``u`` (gradient sync and update, once per step) and its
   memory (state, residuals per micro-batch held, peak).
2. **Stages.** A stage is consecutive layers ``[a, b)`` on a block of
   devices; its time per micro-batch is the sum of its layers' ``t`` (one
   batch-axes choice for the whole stage) plus the time to send its
   activations to the next stage and get their cotangents back, α + β ×
   bytes / devices over the mesh axis the link between the two blocks
   crosses (``submesh.link_axis``). A dynamic program over (first layer,
   first device) minimises ``Σ t_s`` subject to ``t_s ≤ t_max`` for each
   ``t_max`` on the grid of stage times, and the step time

       T = Σ t_s + (n - 1) × max t_s + max u_s

   (:func:`schedule_seconds`: under ZB-H1 a third of the fill and drain,
   interleaved over ``v`` stages a submesh ``1 / v`` of it)

   picks the best (plus, where the loss's gradient reads sums that depend
   on the parameters, the first pass: the forward passes alone of the
   stages that lead to them, ``Σ f_s + (n - 1) × max f_s``, each priced by
   :func:`forward_seconds`); a stage whose memory (state + residuals × micro-batches
   it holds under the schedule + peak) exceeds ``memory_budget_per_device``
   (with ``v`` stages a submesh, ``1 / v`` of it) is not a candidate.
3. **Stage plans.** The chosen stages are planned whole by the ILP on their
   submeshes (stages that compute alike solved once); their specs are the
   plan.

With ``num_stages=1`` or when one stage on the whole mesh is best, the
result has one stage, which ``api.py`` runs as ``ShardParallel``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time
import warnings

import jax
import numpy as np

from autopar.costs.cost_model import DEFAULT_ALPHA, DEFAULT_BETA
from autopar.errors import InputError, PlanError
from autopar.costs.schedule import (awaiting_weights_at_most, bubble, held_at_most,
                                    simulate, splits_backward, stage_tasks,
                                    stages_on, submesh_of)
from autopar.method import accumulation_dtype, axis_sizes_of
from autopar.plan import CollectivePlan
from autopar.frontend.cut import cut
from autopar.planner.solved import divisible_dim, with_batch_dim
from autopar.planner.stage import update_inputs, solve_stage, stage_batch_axes
from autopar.planner.layers import value_bytes
from autopar.frontend.program import sizer
from autopar.costs.submesh import block_shapes, fits, link_axis, tile
from autopar.costs.strategies import (local_bytes, missing_rules, to_partition_spec,
                                      warn_missing_rules)

__all__ = ["search", "SearchResult", "Candidate", "StageChoice", "forward_seconds",
           "first_pass_time", "schedule_seconds"]

# A stage's forward pass alone, as a share of its forward and backward
# passes: the backward's matmuls are twice the forward's (the cotangents of
# their inputs and of their weights).
FORWARD_SHARE = 1 / 3


class BubbleWarning(UserWarning):
  """Fewer micro-batches than pipeline submeshes: most of a step is bubble."""


def forward_seconds(t: float, send_seconds: float) -> float:
  """A stage's forward pass alone for one micro-batch (the first pass),
  from its time per micro-batch ``t`` (forward and backward, its
  activations sent and their cotangents received, ``send_seconds`` each):
  :data:`FORWARD_SHARE` of the compute, one send."""
  return (t - 2 * send_seconds) * FORWARD_SHARE + send_seconds


# Of a backward pass, the share that is its weights' gradient (``W`` where a
# schedule splits it from the cotangents of the stage's inputs): the two
# matmuls of each weight's product take alike.
WEIGHT_SHARE = 1 / 2


def schedule_seconds(schedule: str, times, n: int, virtual_stages: int = 1) -> float:
  """``n`` micro-batches through stages whose forward and backward take
  ``times`` each: the busiest submesh's ``n`` micro-batches, and the time
  the others' fill and drain add, all of it under 1F1B and GPipe; under
  ZB-H1 its share ``(F + B - W) / (F + B + W)`` (a third), the weights'
  gradients filling the rest; interleaved (each submesh runs
  ``virtual_stages`` stages, ``submesh_of``), ``1 / virtual_stages`` of it;
  ZB-V: its order replayed on the times (``costs/schedule.py``)."""
  if not times:
    return 0.0
  S = len(times) // virtual_stages
  if schedule == "zb-v":
    return _replayed(schedule, tuple(times), n, virtual_stages)
  busy = [sum(on) for on in stages_on(schedule, S, times)]
  fill = sum(times) - max(busy)
  if splits_backward(schedule):
    fill *= FORWARD_SHARE + (1 - FORWARD_SHARE) * (1 - 2 * WEIGHT_SHARE)
  return n * max(busy) + fill / virtual_stages


def _replayed(schedule: str, times: tuple, n: int, virtual_stages: int) -> float:
  """The step time of ``schedule``'s order replayed on the stages' times
  (each split into F, B and W by the shares above)."""
  backward = 1 - FORWARD_SHARE
  share = {"F": FORWARD_SHARE, "B": backward * (1 - WEIGHT_SHARE),
           "W": backward * WEIGHT_SHARE}
  tasks = stage_tasks(schedule, len(times) // virtual_stages, n, virtual_stages)
  return simulate(tasks, lambda t: times[t.stage] * share[t.kind]).makespan


def first_pass_time(times, n: int) -> float:
  """The first pass of ``n`` micro-batches through stages whose forward
  passes take ``times``: pipelined as GPipe's forward half."""
  return sum(times) + (n - 1) * max(times) if times else 0.0


@dataclasses.dataclass(frozen=True)
class StageChoice:
  """What the stage search decided for one stage."""
  layers: tuple[int, int]
  offset: int
  shape: tuple[int, ...]
  batch_axes: tuple[str, ...]
  root_specs: tuple            # per StageProgram root
  leaf_specs: tuple            # per StageProgram leaf
  grad_specs: tuple = ()       # per root: its gradient's spec (default: the root's)
  update_specs: dict = dataclasses.field(default_factory=dict)  # update-only leaves
  pins: tuple = ({}, {})
  time_per_micro_batch: float = 0.0
  time_per_step: float = 0.0
  memory: float = 0.0
  send_bytes: float = 0.0
  send_seconds: float = 0.0
  collectives: tuple = ()      # CollectivePlan: the pass's, the gradient sync, the update's

MAX_DP_LAYERS = 32


@dataclasses.dataclass(frozen=True)
class Candidate:
  """A stage the dynamic program may pick."""
  layers: tuple[int, int]
  offset: int
  shape: tuple[int, ...]
  batch_axes: tuple[str, ...]
  t: float                 # per micro-batch, sends included
  u: float
  memory: float
  send_bytes: float
  send_seconds: float


@dataclasses.dataclass(frozen=True)
class SearchResult:
  """The stages picked, and the step time of the best plan per stage count."""
  stages: tuple[Candidate, ...]
  step_time: float
  by_num_stages: dict          # S -> (step time, stages)
  seconds: float


def _groups(num_layers: int, k: int) -> list[int]:
  """Starts of ``k`` (or fewer) groups of consecutive layers of about equal count."""
  return sorted({round(i * num_layers / k) for i in range(k)})


def _send(ctx, position: int) -> float:
  """Bytes of the activations that cross ``position`` of ``P``, one
  micro-batch, all devices."""
  size = sizer(ctx.micro)
  return float(sum(value_bytes(v, size) for v in ctx.analysis.crossing(position)))


def _solve_layers(ctx, groups, shapes, names):
  """costs[(g, shape, axes)] = (t, u, state, residual bytes, peak, what
  ZeRO-2 would save and cost: ``_zero_state``, and what ZeRO-3 would save
  besides and cost per micro-batch: ``_zero_params``, and 1 where the layer
  alone has no plan within the budget on that submesh, else 0) per DP layer
  group ``g`` (layers ``groups[g]..groups[g+1]``). (Kept in ``ctx``: they
  do not depend on the schedule, so searches under several reuse them.)"""
  L = ctx.num_layers
  bounds = [*groups, L]
  memo: dict = ctx.cache.setdefault("layer costs", {})
  out: dict = {}
  for g in range(len(groups)):
    a, b = bounds[g], bounds[g + 1]
    ranges = [r for r in [(0, a), (a, b), (b, L)] if r[0] < r[1]]
    s = ranges.index((a, b))
    c = cut(ctx, ranges)
    st = c.stages[s]
    key_prog = st.signature + "|" + "|".join(str(seg.jaxpr) for seg in c.apply.of_stage(s))
    for shape in shapes:
      sizes = dict(zip(names, shape))
      for axes in stage_batch_axes(ctx, sizes):
        key = (key_prog, shape, axes)
        if key not in memo:
          try:      # (the micro-batches in flight are counted by the search)
            sol = solve_stage(ctx, c, s, sizes, axes, in_flight=0)
          except PlanError:
            if ctx.option.memory_budget_per_device is None:
              raise
            memo[key] = (0.0,) * 9 + (1.0,)
          else:
            memo[key] = (sol.per_micro_batch, sol.per_step, sol.state_bytes,
                         sol.residual_bytes, sol.peak_bytes, *_zero_state(sol, sizes, axes),
                         *_zero_params(sol, sizes, axes), 0.0)
        out[(g, shape, axes)] = memo[key]
  return out


def _zero_state(sol, sizes, axes) -> tuple[float, float]:
  """What splitting the layer's optimizer state (what only its update reads)
  over the batch axes ``axes`` (ZeRO-2) would save of its state's bytes per
  device, and cost per step in gathering the updated values back (the
  layer's ILP solution replicates it there: it costs time, and saves only
  memory, which the search weighs against the budget)."""
  d = math.prod(sizes[a] for a in axes)
  if d == 1:
    return 0.0, 0.0
  problem, solution = sol.problem, sol.problem.solution()
  saved = gather = 0.0
  for k in sol.io.index("update"):
    aval, spec = problem.leaf_avals[k], solution.leaf_specs[k]
    if _may_split(problem, solution, k) and \
        divisible_dim(aval.shape, spec, d, sizes) is not None:
      b = local_bytes(aval, spec, sizes)
      saved += b * (1 - 1 / d)
      gather += problem.cost.all_gather(b / d, axes)
  return saved, gather


def _zero_params(sol, sizes, axes) -> tuple[float, float]:
  """What splitting the layer's parameters (and the other leaves its passes
  read) over the batch axes ``axes`` as well (ZeRO-3) would save of its
  bytes per device, and cost per micro-batch in gathering them for each
  reader in the forward and the backward pass. A reader's gathered copy
  takes memory while it runs: the largest is taken off what it saves."""
  d = math.prod(sizes[a] for a in axes)
  if d == 1:
    return 0.0, 0.0
  problem, solution = sol.problem, sol.problem.solution()
  saved = gather = largest = 0.0
  for k in [*sol.io.index("root"), *sol.io.index("leaf")]:
    aval, spec = problem.leaf_avals[k], solution.leaf_specs[k]
    sites = problem.gathers_of.get(k, 0)
    if sites and not problem.batch_leaves[k] and _may_split(problem, solution, k) and \
        divisible_dim(aval.shape, spec, d, sizes) is not None:
      b = local_bytes(aval, spec, sizes)
      saved += b * (1 - 1 / d)
      largest = max(largest, b)
      gather += sites * problem.cost.all_gather(b / d, axes)
  return max(0.0, saved - largest), gather


def _may_split(problem, solution, k: int) -> bool:
  """Whether the layer's plan leaves leaf ``k`` whole over the batch axes,
  where the search may count splitting it: not split already, not pinned."""
  return solution.leaf_batch_dims[k] is None and k not in problem.pins


def search(pre, method, mesh):
  """The stages for ``method`` on ``mesh`` (see the module docstring):
  ``(cut, choices)`` for ``pipeline.py``."""
  t0 = time.perf_counter()
  ctx = pre.ctx
  sizes = axis_sizes_of(mesh)
  names = tuple(sizes)
  mesh_shape = tuple(sizes.values())
  total = math.prod(mesh_shape)
  L = ctx.num_layers
  fixed_S = None if method.num_stages == "auto" else int(method.num_stages)
  if fixed_S is not None and fixed_S > L:
    raise InputError(
        f"{ctx.program.fn_name}: num_stages={fixed_S} but the forward pass has only "
        f"{L} layer(s) to group into stages ({_layer_note(method)}). Fix: use at most "
        f"{L} stages, num_stages='auto', or mark more boundaries with "
        f"autopar.mark_pipeline_boundary() and layers='manual'.")
  fixed_shapes = None if method.stage_mesh_shapes == "auto" else \
      [tuple(s) for s in method.stage_mesh_shapes]
  v = method.virtual_stages
  if v > 1 and fixed_shapes is None:
    return _each_uniform_shape(pre, method, mesh, fixed_S)
  if fixed_shapes is not None:
    tile(mesh_shape, fixed_shapes)
    if v > 1:
      # Interleaved: v stages on each submesh, the mesh tiled v times over
      # (the search walks a mesh v times as long on its first axis).
      if method.schedule == "interleaved-1f1b" and ctx.n % len(fixed_shapes):
        raise InputError(
            f"{ctx.program.fn_name}: schedule='interleaved-1f1b' runs micro-batches in "
            f"groups of the number of submeshes ({len(fixed_shapes)}); num_micro_batches="
            f"{ctx.n} is not a multiple of it. Fix: use a multiple of {len(fixed_shapes)}.")
      fixed_shapes = [fixed_shapes[submesh_of(method.schedule, len(fixed_shapes), k)]
                      for k in range(len(fixed_shapes) * v)]
      mesh_shape = (mesh_shape[0] * v, *mesh_shape[1:])
      total *= v
    fixed_S = len(fixed_shapes)
    if fixed_S > L and v > 1:
      raise InputError(
          f"{ctx.program.fn_name}: {fixed_S // v} submeshes x virtual_stages={v} = "
          f"{fixed_S} stages, but the forward pass has only {L} layer(s) "
          f"({_layer_note(method)}). Fix: lower num_stages or virtual_stages.")
    if fixed_S > L:
      raise InputError(
          f"{ctx.program.fn_name}: {fixed_S} stage_mesh_shapes but the forward pass "
          f"has only {L} layer(s) ({_layer_note(method)}). Fix: give at most {L} "
          f"shapes.")
  groups = _groups(L, min(L, MAX_DP_LAYERS)) if L > MAX_DP_LAYERS else list(range(L))
  G = len(groups)
  shapes = sorted(set(fixed_shapes) if fixed_shapes else set(block_shapes(mesh_shape)),
                  key=math.prod)
  costs = _solve_layers(ctx, groups, shapes, names)
  bounds = [*groups, L]
  n = ctx.n
  # With several stages a submesh, each stage is held to an even share of
  # the budget, so that their sum (what the submesh holds) is within it.
  whole_budget = ctx.option.memory_budget_per_device
  budget = None if whole_budget is None else whole_budget / v
  option = ctx.option
  alpha, beta = option.alpha, option.beta
  send_bytes = [_send(ctx, ctx.layers[bounds[g]]) if g < G else 0.0
                for g in range(G + 1)]
  # Prefix sums per (shape, axes) of t, u, state, residual; max of peak by range.
  prefix = {}
  for shape in shapes:
    for axes in stage_batch_axes(ctx, dict(zip(names, shape))):
      rows = np.array([costs[(g, shape, axes)] for g in range(G)])
      prefix[(shape, axes)] = (np.vstack([np.zeros(10), np.cumsum(rows, axis=0)]), rows)

  refused: set = set()     # (a, b, shape, batch axes) no plan fits
  # ZB-V's turn: the stage after the first pass over the mesh runs on the
  # same submesh, so nothing crosses a link there.
  turn = total // v if method.schedule == "zb-v" else None

  @functools.lru_cache(maxsize=None)
  def stage(a: int, b: int, offset: int, shape, held: int):
    """The best candidate for layers [a, b) on the block of ``shape`` at
    ``offset``, holding ``held`` micro-batches' activations, or None."""
    best = None
    devices = math.prod(shape)
    end = offset + devices
    axis = link_axis(mesh_shape, names, end) if b < G and end != turn else None
    for axes in axes_of[shape]:
      if (a, b, shape, axes) in refused:
        continue
      cum, rows = prefix[(shape, axes)]
      if cum[b, 9] > cum[a, 9]:          # a layer alone has no plan in the budget
        continue
      t, u, state, resid = (cum[b, :4] - cum[a, :4])
      zero_saved, zero_gather, params_saved, params_gather = cum[b, 5:9] - cum[a, 5:9]
      peak = rows[a:b, 4].max()
      sb = send_bytes[b] if b < G else 0.0
      sec = 0.0
      if axis is not None and sb:
        sec = (alpha.get(axis, DEFAULT_ALPHA) +
               beta.get(axis, DEFAULT_BETA) * sb / devices)
      mem = state + held * resid + peak
      if budget is not None and mem > budget:
        # The optimizer state split over the batch axes (ZeRO-2) may fit,
        # or that and the parameters (ZeRO-3, gathered in every pass).
        if mem - zero_saved <= budget:
          mem, u = mem - zero_saved, u + zero_gather
        elif mem - zero_saved - params_saved <= budget:
          mem, u = mem - zero_saved - params_saved, u + zero_gather
          t = t + params_gather
        else:
          continue
      cand = Candidate(layers=(a, b), offset=offset, shape=shape, batch_axes=axes,
                       t=t + 2 * sec, u=u, memory=mem, send_bytes=sb, send_seconds=sec)
      if best is None or cand.t + cand.u / max(n, 1) < best.t + best.u / max(n, 1):
        best = cand
    return best

  def held_at(S_total, k) -> int:
    """Micro-batches stage k holds (``held_at_most``); the number of stages
    unknown, n."""
    if S_total is None:
      return n
    return held_at_most(method.schedule, S_total // v, n, v)[k]

  axes_of = {shape: stage_batch_axes(ctx, dict(zip(names, shape))) for shape in shapes}
  fit = {(off, shape): fits(mesh_shape, off, shape) for off in range(total)
         for shape in shapes}

  def solve_dp(t_max: float, S_total: int | None):
    """Min Σ t over stage sequences with every t ≤ t_max (and S_total stages
    if given): the list of candidates, or None."""
    @functools.lru_cache(maxsize=None)
    def best(a: int, offset: int, k: int):
      if a == G and offset == total:
        return (0.0, ()) if S_total is None or k == S_total else None
      if a == G or offset == total:
        return None
      if S_total is not None and k >= S_total:
        return None
      result = None
      for shape in shapes:
        if fixed_shapes is not None and (k >= len(fixed_shapes) or
                                         shape != fixed_shapes[k]):
          continue
        if not fit[(offset, shape)]:
          continue
        held = held_at(S_total, k)
        for b in range(a + 1, G + 1):
          c = stage(a, b, offset, shape, held)
          if c is None or c.t > t_max * (1 + 1e-9):
            continue
          rest = best(b, offset + math.prod(shape), k + 1)
          if rest is None:
            continue
          total_t = c.t + rest[0]
          if result is None or total_t < result[0]:
            result = (total_t, (c, *rest[1]))
      return result
    return best(0, 0, 0)

  def step_time(cands) -> float:
    ts = [c.t for c in cands]
    first = [forward_seconds(c.t, c.send_seconds) for c in cands
             if ctx.layers[bounds[c.layers[0]]] < ctx.first_until]
    return schedule_seconds(method.schedule, ts, n, v) + max(c.u for c in cands) + \
        first_pass_time(first, n)

  # t_max candidates: stage times of single-layer-group stages up to whole ranges.
  grid = set()
  for shape in shapes:
    for (sh, axes), (cum, rows) in prefix.items():
      if sh == shape:
        for a in range(G):
          for b in range(a + 1, G + 1):
            grid.add(float(cum[b, 0] - cum[a, 0]))
  grid = sorted(grid)
  if len(grid) > 16:
    grid = sorted(set(np.quantile(grid, np.linspace(0, 1, 16)).tolist()) | {grid[-1]})
  # Sends make stages slower than their layers: widen the thresholds.
  sends = max((send_bytes[g] for g in range(G)), default=0.0)
  slack = max(alpha.values(), default=DEFAULT_ALPHA) * 2 + \
      max(beta.values(), default=DEFAULT_BETA) * 2 * sends
  plans: dict = {}

  def plans_of(c, s, cand, held, awaiting):
    """Stage ``s`` of cut ``c`` planned whole (stages that compute alike
    once); a PlanError under the budget is a :class:`_Refused`."""
    st = c.stages[s]
    # The number of micro-batches held matters only against a memory budget.
    key = (st.signature, cand.shape, cand.batch_axes,
           (held, awaiting) if budget is not None else awaiting is None,
           "|".join(str(seg.jaxpr) for seg in c.apply.of_stage(s)))
    if key not in plans:
      try:
        plans[key] = _within_budget(ctx, c, s, dict(zip(names, cand.shape)),
                                    cand.batch_axes, held, awaiting, budget,
                                    share_of=v)
      except PlanError as e:
        plans[key] = e
    if isinstance(plans[key], PlanError):
      raise _Refused(s, plans[key])
    return plans[key]

  # A stage the search takes that its whole plan cannot fit in the budget
  # (the layers' costs add up to less than the stage's plan needs) is
  # refused, and the search runs again without it, a few times at most.
  refusal = None
  for attempt in range(_REPLANS + 1):
    by_S = _by_num_stages(solve_dp, step_time, grid, slack, fixed_S)
    if not by_S:
      if refusal is not None:
        raise refusal
      raise PlanError(
          f"{ctx.program.fn_name}: no pipeline of "
          f"{fixed_S if fixed_S else 'any number of'} stage(s) fits "
          f"memory_budget_per_device={whole_budget}"
          f"{f' (each of a submesh{chr(39)}s {v} stages held to 1/{v} of it)' if v > 1 else ''}"
          f" on the mesh {tuple(sizes.values())} with "
          f"{n} micro-batch(es) under {method.schedule}. Fix: raise the budget, use "
          f"more stages or more micro-batches with 1F1B, or remat.")
    S_best = min(by_S, key=lambda S: by_S[S][0])
    T, cands = by_S[S_best]
    layers = [(bounds[c.layers[0]], bounds[c.layers[1]]) for c in cands]
    c = cut(ctx, layers)
    in_flight = held_at_most(method.schedule, len(cands) // v, n, v)
    awaiting = (awaiting_weights_at_most(method.schedule, len(cands) // v, n, v)
                if splits_backward(method.schedule) else [None] * len(cands))
    try:
      sols = [plans_of(c, s, cand, in_flight[s], awaiting[s])
              for s, cand in enumerate(cands)]
      break
    except _Refused as e:
      refusal = e.error
      if budget is None or attempt == _REPLANS:
        raise refusal from None
      cand = cands[e.stage]
      refused.add((*cand.layers, cand.shape, cand.batch_axes))
      stage.cache_clear()
  if 1 < S_best // v and n < S_best // v:
    S_ = S_best // v
    warnings.warn(BubbleWarning(
        f"autopar: {ctx.program.fn_name}: {n} micro-batch(es) through {S_} "
        f"pipeline submeshes: at most {n} of them work at a time, and "
        f"{bubble(method.schedule, S_, n, virtual_stages=v):.0%} of their time is "
        f"bubble under {method.schedule}. Use num_micro_batches >= {S_} (4 x stages "
        f"or more keeps the bubble small)."), stacklevel=2)
  result = SearchResult(stages=tuple(cands), step_time=T, by_num_stages=by_S,
                        seconds=time.perf_counter() - t0)
  choices = []
  missing: collections.Counter = collections.Counter()   # over the stages
  for s, (cand, sol) in enumerate(zip(cands, sols, strict=True)):
    choices.append(_choice(ctx, c, s, cand, sol, layers[s], in_flight[s], awaiting[s]))
    missing.update(missing_rules(sol.joint, sol.update))
  warn_missing_rules(missing, f"{ctx.program.fn_name}'s pipeline stages")
  if v > 1:
    # The search's offsets run over the mesh v times; each stage goes on
    # its submesh (``submesh_of``), one of the first pass's.
    D = len(choices) // v
    offsets = [ch.offset for ch in choices[:D]]
    choices = [dataclasses.replace(ch, offset=offsets[submesh_of(method.schedule, D, k)])
               for k, ch in enumerate(choices)]
  return c, choices, result


def _each_uniform_shape(pre, method, mesh, num_submeshes):
  """Several stages a submesh with ``stage_mesh_shapes="auto"``: the search with
  the mesh cut into ``num_submeshes`` blocks of each shape that tiles it
  alike, the fastest in the model."""
  sizes = axis_sizes_of(mesh)
  mesh_shape = tuple(sizes.values())
  total = math.prod(mesh_shape)
  best = None
  for shape in block_shapes(mesh_shape):
    if math.prod(shape) * num_submeshes != total:
      continue
    try:
      tile(mesh_shape, [shape] * num_submeshes)
    except (InputError, PlanError):
      continue
    found = search(pre, dataclasses.replace(
        method, stage_mesh_shapes=[shape] * num_submeshes), mesh)
    if best is None or found[2].step_time < best[2].step_time:
      best = found
  if best is None:
    raise InputError(
        f"{pre.ctx.program.fn_name}: schedule={method.schedule!r} with num_stages="
        f"{num_submeshes}: no block shape cuts the mesh {sizes} into {num_submeshes} "
        f"alike. Fix: give stage_mesh_shapes, or another num_stages.")
  return best


# How many times the search runs again without a stage its plan cannot fit.
_REPLANS = 3


class _Refused(Exception):
  """Stage ``stage`` of the search's choice has no plan within the budget."""

  def __init__(self, stage: int, error: PlanError):
    super().__init__(str(error))
    self.stage, self.error = stage, error


def _by_num_stages(solve_dp, step_time, grid, slack, fixed_S) -> dict:
  """Per number of stages, the best (step time, candidates) over the grid
  of stage-time limits."""
  by_S: dict[int, tuple[float, tuple]] = {}
  for t_max in grid:
    r = solve_dp(t_max + slack, fixed_S)
    if r is None:
      continue
    cands = r[1]
    T = step_time(cands)
    S = len(cands)
    if S not in by_S or T < by_S[S][0]:
      by_S[S] = (T, cands)
  return by_S


def _within_budget(ctx, c, s, sizes, axes, in_flight: int, awaiting: int | None, budget,
                   share_of: int = 1):
  """Stage ``s`` planned whole by its ILP; under a budget (``budget``: the
  stage's share, ``1 / share_of`` of the ILP's own), planned again until
  its memory as the search counts it (:func:`_stage_memory`) fits.
  The ILP counts the same (the residuals, and what a B keeps for its W,
  it has values for: ``solve_stage``'s ``held``), at its own peaks; where its count and the search's still differ, each try lowers the
  ILP's budget by the last plan's excess (then the ILP splits the optimizer
  state over the batch axes, ZeRO-2, or the parameters too, ZeRO-3, as the
  search assumed where that was needed); at most six tries, then a
  PlanError."""
  # (The ILP's budget is the option's: lowered to the stage's share.)
  tighter = 0.0 if budget is None else budget * (share_of - 1)
  mem = None
  for _ in range(6):
    try:
      sol = solve_stage(ctx, c, s, sizes, axes, in_flight=in_flight, awaiting=awaiting,
                        tighter=tighter)
    except PlanError:
      if mem is None and share_of == 1:
        raise
      break          # (no plan leaves the room the micro-batches in flight need)
    mem = _stage_memory(sol, in_flight, awaiting)
    if budget is None or mem <= budget:
      return sol
    # Next, the ILP's own count must come down by the excess.
    tighter += mem - budget
  share = (f" / {share_of} (its share: the submesh holds {share_of} stages)"
           if share_of > 1 else "")
  raise PlanError(
      f"{ctx.program.fn_name}: pipeline stage {s} (on a submesh {tuple(sizes.values())}, "
      f"{in_flight} micro-batch(es) in flight) does not fit "
      f"memory_budget_per_device={budget * share_of:.0f}{share}"
      f"{f' (its best plan needs {mem:.0f} bytes per device' if mem else ' ('}: its "
      f"state, the activations of the micro-batches in flight and its peak). Fix: "
      f"raise the budget, use more stages or more micro-batches with 1F1B, or remat.")


def _collectives(ctx, s: int, sol, solution) -> tuple[CollectivePlan, ...]:
  """The collectives stage ``s`` runs in a step, as its ILP solution has
  them: its pass's (each micro-batch's forward and backward), its
  gradients' sum over its batch axes after the last micro-batch (the
  partial sums at the accumulation dtype, ``stage_executables.sync``), and
  its update's. Over the axes of its submesh (``CollectivePlan.submesh``)."""
  sizes = sol.problem.sizes
  shape = tuple(sizes.values())
  merged: dict[tuple, float] = {}
  for part, kind, axes, nbytes, mult in solution.collectives:
    name = (f"stage {s} pass (each micro-batch)" if part == "compute_grad" else
            f"stage {s} update")
    key = (name, kind, tuple(axes), int(round(mult)))
    merged[key] = merged.get(key, 0.0) + nbytes
  out = [CollectivePlan(stage=k[0], kind=k[1], axes=k[2], bytes=int(b), per_step=k[3],
                        what="activations / partial sums", submesh=shape)
         for k, b in merged.items()]
  batch = tuple(a for a in sol.batch_axes if sizes[a] > 1)
  if batch and solution.grad_specs:
    # Gradients of parameters split over the batch axes (ZeRO-3) are
    # scattered to them, the others summed whole.
    grads = sol.problem.compute.jaxpr.outvars[:len(solution.grad_specs)]
    by_kind: dict[str, float] = {}
    for v, spec, k in zip(grads, solution.grad_specs, sol.io.index("root"), strict=True):
      kind = "reduce-scatter" if _scattered(solution, spec, k) else "all-reduce"
      by_kind[kind] = by_kind.get(kind, 0.0) + local_bytes(jax.ShapeDtypeStruct(
          v.aval.shape, accumulation_dtype(v.aval.dtype, ctx.accumulate)), spec, sizes)
    out += [CollectivePlan(stage=f"stage {s} gradient sync", kind=kind, axes=batch,
                           bytes=int(nbytes), per_step=1, what="gradients", submesh=shape)
            for kind, nbytes in by_kind.items()]
  return tuple(out)


def _scattered(solution, grad_spec, k: int) -> bool:
  """Whether the gradient of the stage's root (ILP leaf ``k``) is scattered
  over the batch axes as its sync sums it: the root is split over them
  (ZeRO-3) and the gradient is planned as the root is."""
  return solution.leaf_batch_dims[k] is not None and \
      tuple(grad_spec) == tuple(solution.leaf_specs[k])


def _layer_note(method) -> str:
  return ("layers found: the boundaries marked with autopar.mark_pipeline_boundary()"
          if method.layers == "manual" else
          "layers found: the repeated blocks, or cuts of balanced flops")


def _stage_memory(sol, in_flight: int, awaiting: int | None) -> float:
  """A stage's bytes per device as the search counts them: its state, its
  pass's peak, the residuals of the micro-batches in flight, and under a
  schedule that splits the backward what each B awaiting its W keeps."""
  return (sol.state_bytes + sol.peak_bytes + in_flight * sol.residual_bytes +
          (awaiting or 0) * sol.carried_bytes)


def _choice(ctx, c, s, cand, sol, layers, in_flight, awaiting):
  """A StageChoice from the stage's ILP solution."""
  io = sol.io
  solution = sol.problem.solution()
  # A parameter (or another leaf the passes read) the ILP split over the
  # batch axes too is ZeRO-3: gathered where each pass reads it, its
  # gradient summed and scattered to it (``stage_executables``).
  dims = solution.leaf_batch_dims
  specs = [with_batch_dim(x, dims[k], cand.batch_axes)
           for k, x in enumerate(solution.leaf_specs)]
  root_specs = tuple(specs[k] for k in io.index("root"))
  leaf_specs = tuple(specs[k] for k in io.index("leaf"))
  # A solution may be shared by stages that compute alike: take this stage's
  # own update inputs, in the same order.
  own = [v for v, _ in update_inputs(ctx, c, s)[1]]
  # State only the update reads may also be split over the stage's batch
  # axes (ZeRO-2: the ILP weighs the bytes it saves against gathering it).
  update_specs = {v: with_batch_dim(solution.leaf_specs[k], solution.leaf_batch_dims[k],
                                    cand.batch_axes)
                  for v, k in zip(own, io.index("update"), strict=True)}
  grad_specs = tuple(with_batch_dim(g, dims[k], cand.batch_axes)
                     if _scattered(solution, g, k) else to_partition_spec(g)
                     for g, k in zip(solution.grad_specs, io.index("root"), strict=True))
  fwd_pins, bwd_pins = {}, {}
  nf = sol.num_forward_eqns
  for path, outs in solution.compute_specs.items():
    head, _, rest = path.partition(".")
    i = int(head)
    table, j = (fwd_pins, i) if i < nf else (bwd_pins, i - nf)
    key = str(j) + ("." + rest if rest else "")
    table[key] = {o: to_partition_spec(x) for o, x in enumerate(outs)}
  mem = _stage_memory(sol, in_flight, awaiting)
  return StageChoice(collectives=_collectives(ctx, s, sol, solution),layers=layers, offset=cand.offset, shape=tuple(cand.shape),
                     batch_axes=tuple(cand.batch_axes), root_specs=root_specs,
                     leaf_specs=leaf_specs, grad_specs=grad_specs,
                     update_specs=update_specs, pins=(fwd_pins, bwd_pins),
                     time_per_micro_batch=sol.per_micro_batch + 2 * cand.send_seconds,
                     time_per_step=sol.per_step, memory=mem,
                     send_bytes=cand.send_bytes, send_seconds=cand.send_seconds)

