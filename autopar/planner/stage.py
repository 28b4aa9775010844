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
from typing import Any, Sequence

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Var

from autopar import jax_compat as jc
from autopar.costs.cost_model import MeshCost, num_bytes
from autopar.costs.devices import platform_of
from autopar.errors import InputError, PlanError
from autopar.frontend.hints import check_pins, entry_axes
from autopar.planner.ilp import ShardingProblem
from autopar.planner.apply_segments import ApplyPartition, partition_apply
from autopar.frontend.program import Analysis, Program
from autopar.frontend.stages import (StageFunctions, StageProgram, forward_backward,
                                     instantiate_stage, stage_program)

__all__ = ["Context", "Cut", "cut", "StageIO", "StageSolution", "solve_stage",
           "stage_batch_axes"]


@dataclasses.dataclass
class Context:
  """What planning the stages reads of one step.

  Attributes:
    program, analysis: ``P`` and what ``frontend/program.py`` read of it.
    layers: positions of ``P`` where layers start (the first is 0).
    apply: the update (at the whole batch's shapes), its invars the step's
      consts, the argument leaves, the gradients, the reductions.
    num_consts: the step's consts (leading invars of ``P`` and the update).
    consts: their values.
    micro: rows of one micro-batch (all devices); n: micro-batches; batch:
      rows of the whole batch.
    donation: update output index -> the argument leaf it replaces.
    grad_names: per gradient, its name.
    leaf_names: per argument leaf, its path.
    option: the method's AutoShardingOption; accumulate: its
      grad_accumulation_dtype; remat: its remat.
    hint_axes: the mesh axes the step's sharding hints put on dimensions
      that do not hold rows (``hints.model_axes``): no stage splits its
      batch over them.
    first_until: with a first pass through the stages
      (``Program.num_first``), the position of ``P`` after the last
      equation that makes what it computes: the stages that start before
      it run in it; 0 without one.
    whole_batch: the step holds an op JAX lowers with the devices in hand
      (``retype.lowers_with_devices``): a stage's batch is split over
      every axis of its submesh or none (``stage_batch_axes``).
  """
  program: Program
  analysis: Analysis
  layers: tuple[int, ...]
  apply: ClosedJaxpr
  num_consts: int
  consts: tuple
  micro: int
  n: int
  batch: int
  donation: dict
  grad_names: tuple[str, ...]
  leaf_names: tuple[str, ...]
  option: Any
  accumulate: str | None
  remat: Any = "none"
  hint_axes: frozenset = frozenset()
  first_until: int = 0
  whole_batch: bool = False
  cache: dict = dataclasses.field(default_factory=dict)

  @property
  def num_layers(self) -> int:
    return len(self.layers)

  def layer_range(self, first: int, last: int) -> tuple[int, int]:
    """Positions of ``P`` that layers ``[first, last)`` cover."""
    n = len(self.program.eqns)
    hi = self.layers[last] if last < len(self.layers) else n
    return self.layers[first], hi


@dataclasses.dataclass
class Cut:
  """``P`` cut into stages.

  Attributes:
    layers: per stage, its layers ``(first, last)``.
    ranges: per stage, the positions of ``P`` it covers.
    stages: per stage, its program.
    leaf_home: argument leaf -> the stage its array lives on (the first that
      reads it; the update's own state: the first whose update reads it).
    root_home: root -> the stage whose gradient of it is the gradient.
    final_stage: output of ``P`` -> the stage that makes it.
    apply: the update cut per stage.
  """
  layers: list[tuple[int, int]]
  ranges: list[tuple[int, int]]
  stages: list[StageProgram]
  leaf_home: dict[int, int]
  root_home: dict[int, int]
  final_stage: dict[int, int]
  apply: ApplyPartition

  @property
  def num_stages(self) -> int:
    return len(self.stages)


def cut(ctx: Context, layers: Sequence[tuple[int, int]]) -> Cut:
  """``P`` cut into stages of consecutive ``layers`` ((first, last) each)."""
  key = ("cut", tuple(layers))
  if key in ctx.cache:
    return ctx.cache[key]
  program = ctx.program
  ranges = [ctx.layer_range(a, b) for a, b in layers]
  stages = [stage_program(program, ctx.analysis, ranges, s) for s in range(len(ranges))]
  leaf_home: dict[int, int] = {}
  root_home: dict[int, int] = {}
  final_stage: dict[int, int] = {}
  for s, st in enumerate(stages):
    for k in st.roots:
      root_home.setdefault(k, s)
      leaf = program.roots[k].leaf
      if leaf is not None:
        leaf_home.setdefault(leaf, s)
    for leaf in st.leaves:
      leaf_home.setdefault(leaf, s)
    for j in st.finals:
      final_stage[j] = s
  for k, r in enumerate(program.roots):
    if r.leaf is not None:
      # A parameter no stage reads (its gradient is zero) lives on the last.
      root_home[k] = leaf_home.setdefault(r.leaf, len(stages) - 1)
  aj = ctx.apply.jaxpr
  nc, nl = ctx.num_consts, len(program.leaves)
  homes = {}
  for leaf, s in leaf_home.items():
    homes[aj.invars[nc + leaf]] = s
  grads = aj.invars[nc + nl:nc + nl + len(program.grad_roots)]
  for v, k in zip(grads, program.grad_roots, strict=True):
    homes[v] = root_home[k]
  reduced = aj.invars[nc + nl + len(program.grad_roots):]
  for r, v in enumerate(reduced):
    homes[v] = final_stage[program.num_seeded + r]
  donated = {j: aj.invars[nc + leaf] for j, leaf in ctx.donation.items()}
  apply = partition_apply(aj, homes, len(stages), donated)
  for v, s in apply.home.items():
    k = _leaf_of(aj, v, nc, nl)
    if k is not None:
      leaf_home.setdefault(k, s)
  out = Cut(layers=list(layers), ranges=ranges, stages=stages, leaf_home=leaf_home,
            root_home=root_home, final_stage=final_stage, apply=apply)
  ctx.cache[key] = out
  return out


def _leaf_of(apply_jaxpr, v, nc: int, nl: int) -> int | None:
  try:
    k = apply_jaxpr.invars.index(v)
  except ValueError:
    return None
  return k - nc if nc <= k < nc + nl else None


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
  a host callback, a ``custom_partitioning`` op), every axis of size > 1
  or none: JAX lowers those only in a computation manual over all of its
  mesh's axes or none."""
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


def stage_functions(ctx: Context, st: StageProgram, rows: int) -> StageFunctions:
  """The stage's forward and backward passes as jaxprs at ``rows`` rows per
  micro-batch (``stages.StageFunctions``; cached in ``ctx``)."""
  key = ("functions", st.signature(), rows, _remat_key(ctx.remat))
  if key not in ctx.cache:
    g, draws, _ = instantiate_stage(st, rows)
    groups = _layer_groups(ctx, st, g) if ctx.remat != "none" else None
    policy = None if ctx.remat in ("none", "layers") else ctx.remat
    ctx.cache[key] = forward_backward(st, g, draws, total_rows=ctx.batch,
                                      remat_groups=groups, policy=policy)
  return ctx.cache[key]


def _remat_key(remat):
  return remat if isinstance(remat, str) else id(remat)


def _layer_groups(ctx: Context, st: StageProgram, g: Jaxpr) -> list[tuple[int, int]]:
  """Equation ranges of ``g`` for the stage's layers (floating equations
  join the first), checkpointed one by one under ``remat``."""
  starts = [p for p in ctx.layers if st.lo < p < st.hi]
  # g's equations are P's (written out) in P's order, floating ones included:
  # split where P's layers start, counted in g's equations.
  eqns = st.jaxpr.eqns
  index = {id(e): i for i, e in enumerate(ctx.program.eqns)}
  pos = [index[id(e)] for e in eqns]
  bounds = [0]
  for p in starts:
    k = next((j for j, q in enumerate(pos) if q >= p and q not in
              ctx.analysis.floating), len(pos))
    if bounds[-1] < k < len(pos):
      bounds.append(k)
  # g has the equations of st.jaxpr minus the symbolic ones written out
  # (dim_as_value): map by counting the others.
  kept = [j for j, e in enumerate(eqns) if e.primitive.name != "dim_as_value"]
  where = {j: k for k, j in enumerate(kept)}
  gb = sorted({where.get(b, next((where[j] for j in kept if j >= b), len(kept)))
               for b in bounds})
  gb = [b for b in gb if b < len(g.eqns)]
  return [(a, b) for a, b in zip(gb, gb[1:] + [len(g.eqns)]) if a < b]


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
                cost: MeshCost | None = None) -> StageSolution:
  """Plans stage ``s`` of ``cut_`` on a submesh of ``sizes`` with the batch
  split over ``batch_axes``; ``in_flight``: how many micro-batches'
  residuals the schedule keeps (they count against the memory budget)."""
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
  read_by = {k for k, v in enumerate(joint.invars[num_consts:]) if v in read}
  pins = {}
  if option.pins:
    leaves_for_pins = [_PinLeaf(io.names[k], tuple(a.shape)) for k, a in
                       enumerate(leaf_avals)]
    wanted = {p: spec for p, spec in option.pin_map.items() if p in io.names}
    pins = {k: tuple(entry_axes(e) for e in spec) for k, spec in
            check_pins(wanted, leaves_for_pins, sizes).items()}
  residual_bytes = sum(num_bytes(v.aval.shape, v.aval.dtype)
                       for v in fns.forward.jaxpr.outvars[fns.num_outputs:])
  budget = option.memory_budget_per_device
  if budget is not None:
    budget = budget - max(0, in_flight - 1) * residual_bytes
    if budget <= 0:
      raise PlanError(f"autopar: stage {s}'s activations of {in_flight} micro-batches "
                      f"in flight ({residual_bytes * in_flight:.0f} bytes) exceed "
                      f"memory_budget_per_device={option.memory_budget_per_device}.")
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
      leaf_names=list(io.names))
  problem.build()
  objective = problem.solve()
  parts = problem.cost_by_part()
  state, peak = problem.memory_at_solution()
  # What the schedule keeps of a micro-batch for its backward pass, in the
  # specs the plan gives it (the budget above took it whole).
  kept = sum(problem.bytes_at_solution(v)
             for v in fns.forward.jaxpr.outvars[fns.num_outputs:] if isinstance(v, Var))
  return StageSolution(
      batch_axes=tuple(batch_axes), rows=rows, objective=objective,
      per_micro_batch=parts["compute"] / ctx.n,
      per_step=parts["apply"] + parts["sync"] + parts["state"],
      state_bytes=state, peak_bytes=peak, residual_bytes=float(kept),
      io=io, fns=fns, problem=problem, joint=ClosedJaxpr(joint, joint_consts),
      update=ClosedJaxpr(update, ()), num_forward_eqns=num_fwd,
      segments=tuple(segments), segment_offsets=tuple(offsets))


def _local_aval(v):
  return v.aval


@dataclasses.dataclass(frozen=True)
class _PinLeaf:
  path: str
  shape: tuple
