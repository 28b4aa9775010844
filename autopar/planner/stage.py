"""Each stage's sharding plan: one ILP per stage, on its own submesh.

A stage's ILP (``ilp.ShardingProblem``, the one ``ShardParallel`` solves)
plans the stage's joint program: its forward pass, then its backward pass
(``stages.forward_backward``), as the ILP's per-micro-batch part, and its
share of the update (``apply_segments.py``) as the once-per-step part. Its inputs
(the ILP's "leaves") are, in order::

    first_row | roots | acts_in | leaves | update inputs | cotangents in

``first_row`` (where a device's rows start, for random draws), the stage's
roots and argument leaves, the activations it receives, what its part of the
update reads besides (optimizer state, reductions, values other stages'
parts of the update send), and the cotangents of the activations it sends
(and the loss's seed). Activations, cotangents and batch leaves are split
over the stage's batch axes along their rows; the ILP plans the rest.

The objective splits into the per-micro-batch time ``t`` (forward and
backward, with the resharding inside them) and the per-step time ``u``
(gradient sync and the update), which the stage search combines as a
pipeline does (``stage_search.py``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Var

from autopar import jax_compat as jc
from autopar.costs.cost_model import MeshCost
from autopar.costs.devices import platform_of
from autopar.errors import InputError, PlanError
from autopar.frontend.hints import check_pins, entry_axes
from autopar.frontend.cut import Cut, stage_functions
from autopar.frontend.evaluate import gather_sites
from autopar.frontend.pipeline import Context
from autopar.frontend.program import Analysis, Program
from autopar.frontend.stages import StageFunctions, StageProgram, split_input_weight
from autopar.planner.ilp import ShardingProblem

__all__ = ["StageIO", "StageSolution", "solve_stage", "stage_batch_axes", "update_inputs",
           "act_name"]


# -- the stage's problem ---------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StageIO:
  """The inputs of a stage's joint program (the ILP's leaves), in order.

  Per input: ``kind`` ("first_row", "root", "act", "leaf", "update",
  "cotangent", "seed"), ``ref`` (the root / argument leaf index, the
  activation (a variable of ``P``), the update's variable, or the seeded
  output), its name, whether it is split by rows (``batch``), and its row
  dimension.
  """
  kinds: tuple[str, ...]
  refs: tuple
  names: tuple[str, ...]
  batch: tuple[bool, ...]
  row_dims: tuple[int | None, ...]

  def index(self, kind: str) -> list[int]:
    return [k for k, x in enumerate(self.kinds) if x == kind]


@dataclasses.dataclass
class StageSolution:
  """The ILP's answer for one stage, one submesh, one choice of batch axes."""
  batch_axes: tuple[str, ...]
  rows: int                      # per device and micro-batch
  objective: float
  per_micro_batch: float         # t: forward + backward of one micro-batch
  per_step: float                # u: gradient sync and the update
  state_bytes: float
  peak_bytes: float
  residual_bytes: float          # stored per micro-batch in flight
  io: StageIO
  fns: StageFunctions
  problem: ShardingProblem
  joint: ClosedJaxpr
  update: ClosedJaxpr
  num_forward_eqns: int
  segments: tuple                # this stage's update segments (apply.Segment)
  segment_offsets: tuple[int, ...]   # where each starts in `update`
  # Under a schedule that splits the backward: what its B computes for its W,
  # held per micro-batch between the two (0 otherwise).
  carried_bytes: float = 0.0


def act_name(program: Program, analysis: Analysis, v) -> str:
  """A name for activation ``v`` that stays the same from trace to trace."""
  i = analysis.producer[v]
  return f"P/{i}/{program.eqns[i].outvars.index(v)}"


def stage_batch_axes(ctx: Context, sizes: dict[str, int]) -> list[tuple[str, ...]]:
  """The choices of batch axes for a stage on a submesh of ``sizes``: each
  set of its axes (of size > 1, none of ``ctx.hint_axes``: a sharding hint
  splits another dimension over it) whose devices divide the micro-batch,
  and that leaves at most ``option.max_model_axes`` axes to plan (besides
  the hinted ones, which are planned whatever that says). Where the step
  holds an op JAX lowers with the devices in hand (``ctx.whole_batch``:
  a host callback, a ``custom_partitioning`` op), every axis or none (the
  axes of size 1 with the others): JAX lowers those only in a computation
  manual over all of its mesh's axes or none."""
  micro, option, taken = ctx.micro, ctx.option, ctx.hint_axes
  every = [a for a, s in sizes.items() if s > 1]
  names = [a for a in every if a not in taken]
  whole = lambda axes: not ctx.whole_batch or not axes or set(axes) == set(every)
  if option.force_data_parallel:
    axes = tuple(names)
    return [axes] if micro % math.prod(sizes[a] for a in names) == 0 and whole(axes) \
        else [()]
  forced = option.forced_batch_axes(jax.sharding.AbstractMesh(
      tuple(sizes.values()), tuple(sizes)))
  out = []
  for mask in range(1 << len(names)):
    axes = tuple(a for i, a in enumerate(names) if mask >> i & 1)
    if forced is not None and set(axes) != set(forced) & set(names):
      continue
    if len(names) - len(axes) > option.max_model_axes:
      continue
    if micro % math.prod(sizes[a] for a in axes) == 0 and whole(axes):
      out.append(axes)
  if ctx.whole_batch:
    # Manual over every axis means the axes of size 1 too (JAX counts one
    # left automatic as a partly manual computation).
    out = [tuple(a for a in sizes if a in axes or sizes[a] == 1) if axes else ()
           for axes in out]
  if not out and forced and not whole(tuple(a for a in forced if a in names)):
    raise InputError(
        f"{ctx.program.fn_name}: AutoShardingOption(force_batch_dim_to_mesh_dim="
        f"{tuple(forced)}) splits a pipeline stage's batch over some of its submesh's "
        f"axes {tuple(every)} and not others, and the step holds an op JAX lowers "
        f"only in a computation split by hand over every mesh axis or none (a host "
        f"callback: jax.debug.print, pure_callback, io_callback; or a "
        f"custom_partitioning op). Fix: force all of the stage's axes or none, or "
        f"drop force_batch_dim_to_mesh_dim.")
  return out or [()]


def _io(ctx: Context, cut_: Cut, s: int, fns: StageFunctions, update_inputs) -> StageIO:
  program, analysis = ctx.program, ctx.analysis
  st = cut_.stages[s]
  kinds, refs, names, batch, rows = [], [], [], [], []

  def add(kind, ref, name, is_batch, row):
    kinds.append(kind)
    refs.append(ref)
    names.append(name)
    batch.append(is_batch)
    rows.append(row)
  add("first_row", None, "first_row", False, None)
  for k in st.roots:
    leaf = program.roots[k].leaf
    add("root", k, ctx.leaf_names[leaf] if leaf is not None else f"root[{k}]", False,
        None)
  for v, r in zip(st.acts_in, st.row_in, strict=True):
    add("act", v, "activation " + act_name(program, analysis, v), True, r)
  for leaf in st.leaves:
    info = program.leaves[leaf]
    add("leaf", leaf, ctx.leaf_names[leaf], info.is_batch, 0 if info.is_batch else None)
  for v, name in update_inputs:
    add("update", v, name, False, None)
  for k, (v, t) in enumerate(zip(st.acts_out, st.tangent_out, strict=True)):
    if t:
      add("cotangent", v, "cotangent of " + act_name(program, analysis, v), True,
          st.row_out[k])
  for j in st.seeded_finals:
    add("seed", j, f"seed of output {j}", False, None)
  return StageIO(tuple(kinds), tuple(refs), tuple(names), tuple(batch), tuple(rows))


def _joint(fns: StageFunctions, st: StageProgram) -> tuple[Jaxpr, list, int]:
  """The forward then the backward pass as one jaxpr for the ILP.

  Invars: (constants, first_row, roots, acts_in, leaves, cotangents);
  outvars: (gradients of the roots, forward outputs, cotangents of the
  tangent acts_in). Returns it, the constants' values, and how many
  equations are the forward pass's."""
  fwd, bwd = fns.forward, fns.backward
  fj, bj = fwd.jaxpr, bwd.jaxpr
  nr, na, nl, nc, nk = st.input_groups
  n_main = 1 + nr + na + nl               # first_row .. leaves
  consts_in = list(fj.invars[n_main:])    # step consts, F consts
  fconst = [Var(v.aval) for v in fj.constvars]
  bconst = [Var(v.aval) for v in bj.constvars]
  sub_f = dict(zip(fj.constvars, fconst))
  n_out = fns.num_outputs
  outs = fj.outvars
  res_in = bj.invars[:len(fns.residuals.sources)]
  ct_in = bj.invars[len(fns.residuals.sources):]
  sub_b = dict(zip(bj.constvars, bconst))
  for v, (kind, k) in zip(res_in, fns.residuals.sources, strict=True):
    if kind == "stored":
      sub_b[v] = outs[n_out + k]
    elif kind == "input":
      sub_b[v] = fj.invars[k]
    elif kind == "output":
      sub_b[v] = outs[k]
    else:
      sub_b[v] = Literal(np.asarray(k, v.aval.dtype), v.aval)
  new_ct = [Var(v.aval) for v in ct_in]
  sub_b.update(zip(ct_in, new_ct))

  def rename(eqns, sub):
    out = []
    for e in eqns:
      ins = [sub.get(a, a) if isinstance(a, Var) else a for a in e.invars]
      out.append(e if all(a is b for a, b in zip(ins, e.invars)) else e.replace(invars=ins))
    return out
  read_b = lambda a: sub_b.get(a, a) if isinstance(a, Var) else a
  eqns = rename(fj.eqns, sub_f) + rename(bj.eqns, sub_b)
  nr_ = nr
  grads = [read_b(v) for v in bj.outvars[:nr_]]
  ct_tin = [read_b(v) for v in bj.outvars[nr_:]]
  outvars = grads + [sub_f.get(v, v) if isinstance(v, Var) else v
                     for v in outs[:n_out]] + ct_tin
  invars = [*fconst, *bconst, *consts_in, *fj.invars[:n_main], *new_ct]
  jaxpr = Jaxpr([], invars, outvars, eqns, fj.effects | bj.effects,
                jc.debug_info("pipeline stage", len(invars), len(outvars)))
  return jaxpr, [*fwd.consts, *bwd.consts], len(fj.eqns)


def update_inputs(ctx: Context, cut_: Cut, s: int) -> tuple[list, list, list]:
  """(this stage's segments, the update inputs its ILP plans besides its
  roots and leaves as (variable, name), the update's own variable for each
  of its roots' gradients (None: homed elsewhere))."""
  program = ctx.program
  aj = ctx.apply.jaxpr
  nc, nl = ctx.num_consts, len(program.leaves)
  st = cut_.stages[s]
  segments = cut_.apply.of_stage(s)
  made = {v for g in segments for v in g.jaxpr.outvars}
  made |= {v for g in segments for e in g.jaxpr.eqns for v in e.outvars}
  grad_vars = aj.invars[nc + nl:nc + nl + len(program.grad_roots)]
  root_grad = {}
  for v, k in zip(grad_vars, program.grad_roots, strict=True):
    root_grad.setdefault(k, v)
  covered = {aj.invars[nc + l] for l in st.leaves}
  covered |= {aj.invars[nc + program.roots[k].leaf] for k in st.roots
              if program.roots[k].leaf is not None}
  consts = set(aj.invars[:nc])
  extra = []
  seen = set()
  for g in segments:
    for v in g.inputs:
      if v in made or v in covered or v in consts or v in seen:
        continue
      if v in root_grad.values() and any(root_grad.get(k) is v for k in st.roots):
        continue
      seen.add(v)
      extra.append((v, _update_name(ctx, v)))
  grads = [root_grad.get(k) if cut_.root_home.get(k) == s else None for k in st.roots]
  return segments, extra, grads


def _update_name(ctx: Context, v) -> str:
  aj = ctx.apply.jaxpr
  nc, nl = ctx.num_consts, len(ctx.program.leaves)
  try:
    k = aj.invars.index(v)
  except ValueError:
    return f"update value {v}"
  if nc <= k < nc + nl:
    return ctx.leaf_names[k - nc]
  ng = len(ctx.program.grad_roots)
  if k < nc + nl + ng:
    return ctx.grad_names[k - nc - nl]
  return f"reduction[{k - nc - nl - ng}]"


def _update_jaxpr(ctx: Context, cut_: Cut, s: int, io: StageIO, segments, grads,
                  num_consts: int) -> tuple[Jaxpr, dict[int, int], list[int]]:
  """The stage's segments of the update as one jaxpr for the ILP.

  Invars: (placeholders for the joint program's constants, one per ILP
  leaf, the gradients of the stage's roots); outvars: the segments'
  outputs. Returns it, its donation (output index -> leaf index) and where
  each segment's equations start."""
  aj = ctx.apply.jaxpr
  nc = ctx.num_consts
  program = ctx.program
  leaf_vars = []
  used = set()
  for kind, ref in zip(io.kinds, io.refs, strict=True):
    v = None
    if kind == "leaf":
      v = aj.invars[nc + ref]
    elif kind == "root" and program.roots[ref].leaf is not None:
      v = aj.invars[nc + program.roots[ref].leaf]
    elif kind == "update":
      v = ref
    if v is None or v in used:
      v = Var(_aval_of(io, kind, ref))
    used.add(v)
    leaf_vars.append(v)
  grad_vars = []
  for g, k in zip(grads, cut_.stages[s].roots, strict=True):
    grad_vars.append(g if g is not None and g not in used else
                     Var(aj.invars[nc + len(program.leaves) + program.grad_roots.index(k)].aval
                         if k in program.grad_roots else leaf_vars[0].aval))
  eqns, seen, offsets, outs = [], set(), [], []
  for g in segments:
    offsets.append(len(eqns))
    for e in g.jaxpr.eqns:
      if id(e) not in seen:
        seen.add(id(e))
        eqns.append(e)
    outs.extend(v for v in g.outputs if v not in outs)
  consts = [Var(v.aval) for v in aj.invars[:nc]]
  const_sub = dict(zip(aj.invars[:nc], consts))
  eqns = [e.replace(invars=[const_sub.get(a, a) if isinstance(a, Var) else a
                            for a in e.invars]) if any(
      isinstance(a, Var) and a in const_sub for a in e.invars) else e for e in eqns]
  placeholders = [Var(jc.ShapedArray((), np.float32)) for _ in range(num_consts)]
  # The ILP reads its leading invars as the joint program's constants: the
  # update's own constants stand in for as many of them as there are.
  head = [*consts, *placeholders][:num_consts] if num_consts >= nc else consts
  invars = [*head, *leaf_vars, *grad_vars]
  donation = {}
  leaf_index = {v: k for k, v in enumerate(leaf_vars)}
  for j, leaf in ctx.donation.items():
    out_v = aj.outvars[j]
    if out_v in outs and cut_.apply.out_home[j] == s:
      k = leaf_index.get(aj.invars[nc + leaf])
      if k is not None:
        donation[outs.index(out_v)] = k
  jaxpr = Jaxpr([], invars, outs, eqns, aj.effects,
                jc.debug_info("pipeline update", len(invars), len(outs)))
  return jaxpr, donation, offsets


def _aval_of(io: StageIO, kind, ref):
  """The aval of a stand-in update input for an ILP leaf the update does not
  read (a root that is no argument leaf, an activation, a cotangent): the
  update jaxpr needs one invar per leaf, and no equation reads these."""
  return jc.ShapedArray((), np.float32)


def solve_stage(ctx: Context, cut_: Cut, s: int, sizes: dict[str, int],
                batch_axes: tuple[str, ...], *, in_flight: int = 1,
                awaiting: int | None = None, cost: MeshCost | None = None,
                tighter: float = 0.0) -> StageSolution:
  """Plans stage ``s`` of ``cut_`` on a submesh of ``sizes`` with the batch
  split over ``batch_axes``; ``in_flight``: how many micro-batches'
  residuals the schedule keeps (they count against the memory budget; 0:
  the caller counts them); ``awaiting``: under a schedule that splits the
  backward, how many micro-batches' values its B computes for its W the
  schedule keeps (counted likewise; the solution's ``carried_bytes``);
  ``tighter``: bytes to plan under the budget besides."""
  st = cut_.stages[s]
  d = math.prod(sizes[a] for a in batch_axes)
  rows = ctx.micro // d
  fns = stage_functions(ctx, st, rows)
  segments, extra, grads = update_inputs(ctx, cut_, s)
  io = _io(ctx, cut_, s, fns, extra)
  joint, joint_consts, num_fwd = _joint(fns, st)
  nr, na, nl, nsc, nk = st.input_groups
  num_consts = len(joint.invars) - (1 + nr + na + nl) - sum(io.kinds.count(k) for k in (
      "cotangent", "seed"))
  # Put the update inputs among the joint program's leaves (it does not read them).
  main = joint.invars[num_consts:num_consts + 1 + nr + na + nl]
  cts = joint.invars[num_consts + 1 + nr + na + nl:]
  update_vars = [Var(_local_aval(v)) for v, _ in extra]
  joint = joint.replace(invars=[*joint.invars[:num_consts], *main, *update_vars, *cts])
  assert len(joint.invars) - num_consts == len(io.kinds), (len(joint.invars), len(io.kinds))
  # The cotangents from the next stages, kept from a B until its W as well.
  ct_leaves = [v for v, kind in zip(joint.invars[num_consts:], io.kinds) if kind == "cotangent"]
  if num_consts < ctx.num_consts:
    # The ILP reads as many leading constants in both programs: the update
    # has the step's, the stage's pass may read fewer. Unread stand-ins.
    pad = [Var(jc.ShapedArray((), np.float32))
           for _ in range(ctx.num_consts - num_consts)]
    joint = joint.replace(invars=[*joint.invars[:num_consts], *pad,
                                  *joint.invars[num_consts:]])
    num_consts = ctx.num_consts
  update, donation, offsets = _update_jaxpr(ctx, cut_, s, io, segments, grads, num_consts)
  names = tuple(sizes)
  planned = tuple(a for a in names if a not in batch_axes and sizes[a] > 1)
  option = ctx.option
  cost = cost or MeshCost(sizes, option.alpha, option.beta)
  leaf_avals = [v.aval for v in joint.invars[num_consts:]]
  read = set()
  for e in joint.eqns:
    read.update(a for a in e.invars if isinstance(a, Var))
  read_by = _gather_sites(fns, {k for k, v in enumerate(joint.invars[num_consts:])
                                if v in read}, 1 + nr + na + nl)
  pins = {}
  if option.pins:
    leaves_for_pins = [_PinLeaf(io.names[k], tuple(a.shape)) for k, a in
                       enumerate(leaf_avals)]
    wanted = {p: spec for p, spec in option.pin_map.items() if p in io.names}
    pins = {k: tuple(entry_axes(e) for e in spec) for k, spec in
            check_pins(wanted, leaves_for_pins, sizes).items()}
  # Against a budget, the residuals of the micro-batches in flight count
  # with the state, in the specs the plan gives them (as the search counts
  # a stage: state + in flight x residuals + the pass's peak); ``tighter``
  # leaves room besides where the ILP's peaks differ from that count
  # (``stage_search._within_budget``).
  stored = [v for v in fns.forward.jaxpr.outvars[fns.num_outputs:] if isinstance(v, Var)]
  # What a B keeps for its W: the values its equations make that W reads
  # (the backward's equations keep their results' variables in the joint
  # program) and the cotangents from the next stages (the runtime keeps
  # them until the W).
  carried = [] if awaiting is None else [
      *(v for v in split_input_weight(fns.backward, nr).carried if isinstance(v, Var)),
      *ct_leaves]
  budget = option.memory_budget_per_device
  if budget is not None:
    budget = budget - tighter
    if budget <= 0:
      raise PlanError(f"autopar: stage {s} with {in_flight} micro-batches in flight "
                      f"{f'({awaiting} between their B and W) ' if awaiting else ''}"
                      f"cannot fit memory_budget_per_device="
                      f"{option.memory_budget_per_device}: the activations they keep "
                      f"take it all. Fix: raise the budget, use more stages or more "
                      f"micro-batches with 1F1B, or remat.")
  problem = ShardingProblem(
      compute=ClosedJaxpr(joint, ()), apply=ClosedJaxpr(update, ()),
      num_consts=num_consts, leaf_avals=leaf_avals, batch_leaves=list(io.batch),
      donation=donation, num_micro_batches=ctx.n, batch_axes=batch_axes,
      planned_axes=planned, sizes=sizes, cost=cost,
      seconds_per_flop=option.flop_seconds,
      seconds_per_byte=option.byte_seconds,
      flop_rates=option.dtype_flop_seconds,
      platform=platform_of(option.device_kind),
      allow_all_gather=option.allow_all_gather, allow_all_to_all=option.allow_all_to_all,
      memory_budget=budget, read_by_compute=read_by,
      share_layers=option.share_layers, pins=pins, accumulate=ctx.accumulate,
      leaf_names=list(io.names),
      held=[*((v, in_flight) for v in stored if in_flight),
            *((v, awaiting) for v in carried if awaiting)] if budget is not None else ())
  problem.build()
  objective = problem.solve()
  parts = problem.cost_by_part()
  state, peak = problem.memory_at_solution()
  # What the schedule keeps of a micro-batch for its backward pass, in the
  # specs the plan gives it.
  kept = sum(problem.bytes_at_solution(v) for v in stored)
  return StageSolution(
      batch_axes=tuple(batch_axes), rows=rows, objective=objective,
      per_micro_batch=parts["compute"] / ctx.n,
      per_step=parts["apply"] + parts["sync"] + parts["state"],
      state_bytes=state, peak_bytes=peak, residual_bytes=float(kept),
      io=io, fns=fns, problem=problem, joint=ClosedJaxpr(joint, joint_consts),
      update=ClosedJaxpr(update, ()), num_forward_eqns=num_fwd,
      segments=tuple(segments), segment_offsets=tuple(offsets),
      carried_bytes=float(sum(problem.bytes_at_solution(v) for v in carried)))


def _gather_sites(fns: StageFunctions, read: set[int], n_main: int) -> dict[int, int]:
  """Per ILP leaf the stage's passes read, how many all-gathers each
  micro-batch makes of it where it is split over the batch axes (ZeRO-3):
  the forward's and the backward's (``evaluate.gather_sites``; two
  executables, so the two passes gather apart). Leaves ``[0, n_main)`` are
  the forward's first inputs (first row, roots, activations, leaves)."""
  fj, bj = fns.forward.jaxpr, fns.backward.jaxpr
  fwd = gather_sites(fj, fj.invars[:n_main])
  bwd_of: dict[int, list] = {}
  for (kind, k), v in zip(fns.residuals.sources, bj.invars):
    if kind == "input":
      bwd_of.setdefault(k, []).append(v)
  bwd = gather_sites(bj, [v for vs in bwd_of.values() for v in vs])
  return {k: max(1, fwd.get(fj.invars[k], 0) + sum(bwd.get(v, 0) for v in bwd_of.get(k, ())))
          if k < n_main else 1 for k in read}


def _local_aval(v):
  return v.aval


@dataclasses.dataclass(frozen=True)
class _PinLeaf:
  path: str
  shape: tuple
