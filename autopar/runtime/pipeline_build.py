"""From a planned pipeline to the runnable step: each stage compiled on its
submesh (``backend/stage_executables.py``), the passes before the schedule (the loss's
sums, the arguments its cotangents read), the update's segments, and the
:class:`~autopar.runtime.pipeline.PipelineStep` that runs them in the
schedule's order. (Planning is ``planner/pipeline.py``'s.)"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.extend.core import Var
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from autopar import jax_compat as jc
from autopar.disk import use_compilation_cache
from autopar.errors import InputError, PlanError
from autopar.frontend.evaluate import Rules, eqn_at, eval_jaxpr
from autopar.frontend.hints import hint_rule
from autopar.backend.gradients import sums_pass
from autopar.method import PipeshardParallel, axis_sizes_of
from autopar.planner.pipeline import Prepared, home_specs
from autopar.backend.stage_executables import StageLayout, build_stage
from autopar.planner.stage import stage_functions
from autopar.runtime.pipeline import ApplySegment, LossSeeds, PipelineStep, SumsPass
from autopar.runtime.schedule import dispatch_order, stage_tasks
from autopar.costs.submesh import tile
from autopar.runtime.transfer import check_movable
from autopar.plan import submesh
from autopar.frontend.retype import Instantiator, has_hints
from autopar.frontend.rng import DRAW_PRIMITIVES, cannot_cut, find_draws
from autopar.frontend.rows import ROWS_NAME, RowOracle
from autopar.frontend.split import dce, renumbered, scale_at
from autopar.frontend.trace import eqns_by_path

__all__ = ["compile_pipeline"]


def compile_pipeline(pre: Prepared, method: PipeshardParallel, mesh, cut_,
                     choices) -> PipelineStep:
  """The runnable pipeline for the stages ``choices`` of ``cut_``."""
  use_compilation_cache()
  ctx = pre.ctx
  program = ctx.program
  split = pre.split
  if isinstance(mesh, AbstractMesh):
    raise PlanError("PipeshardParallel: the mesh is an AbstractMesh, which can be "
                    "planned for but not run on. Fix: use .plan(*args) to plan, and "
                    "run with a concrete mesh.")
  tile(tuple(axis_sizes_of(mesh).values()), [c.shape for c in choices])
  # Across hosts: stages that may exchange values (any two: activations,
  # shared parameters, their gradients) must be movable between.
  meshes = [submesh(mesh, c.offset, c.shape) for c in choices]
  for s, a in enumerate(meshes):
    for t, b in enumerate(meshes[s + 1:], s + 1):
      check_movable(a.devices.flat, b.devices.flat,
                    what=f"a value of stage {s} (to or from stage {t})")
  exes = []
  for s, (st, ch) in enumerate(zip(cut_.stages, choices, strict=True)):
    sub = submesh(mesh, ch.offset, ch.shape)
    layout = StageLayout(
        mesh=sub, batch_axes=tuple(ch.batch_axes), micro=ctx.micro, n=ctx.n,
        root_specs=tuple(ch.root_specs), leaf_specs=tuple(ch.leaf_specs),
        batch_leaf=tuple(program.leaves[k].is_batch for k in st.leaves),
        final_rows=tuple(pre.finals[j].row_dim for j in st.finals),
        grad_specs=tuple(ch.grad_specs), pins=ch.pins, accumulate=ctx.accumulate)
    fns = stage_functions(ctx, st, layout.rows)
    exes.append(build_stage(
        st, fns, layout, step_consts=[ctx.consts[k] for k in st.step_consts],
        fn_consts=[program.consts[k] for k in st.fn_consts]))
  homes = home_specs(ctx, cut_, choices)
  segments = _apply_segments(pre, cut_, exes, homes)
  order = dispatch_order(stage_tasks(method.schedule, cut_.num_stages, ctx.n))
  return PipelineStep(
      seeds=_loss_seeds(pre, cut_, exes),
      split=dataclasses.replace(split, apply=ctx.apply), program=program,
      stages=list(cut_.stages), exes=exes, segments=segments, order=order, n=ctx.n,
      micro=ctx.micro, root_home=dict(cut_.root_home),
      final_stage=dict(cut_.final_stage), finals=pre.finals,
      apply_consts=tuple(ctx.consts), leaf_home=dict(cut_.leaf_home),
      home_specs=homes)


def _loss_seeds(pre: Prepared, cut_, exes) -> LossSeeds:
  """How a pipelined step seeds the loss's entries (``loss.py``): with the
  whole batch's cotangents, over the micro-batches and devices of the stage
  that makes an entry where every group shares it. What they read comes
  from a first pass: through the stages where it depends on the parameters
  (``Program.num_first``); else sums the parameters do not change (a token
  count) from a pass on the last entry's stage, and the step's arguments."""
  ctx, split = pre.ctx, pre.split
  loss = split.loss
  program = ctx.program
  owner = tuple(cut_.final_stage[j] for j in range(program.num_seeded))
  groups = tuple(ctx.n * exes[s].layout.devices for s in owner)
  seeds = tuple(np.asarray(v.val) for v in loss.values.seeds)
  common = dict(scale=scale_at(split, ctx.batch), kinds=tuple(loss.kinds), seeds=seeds,
                owner=owner, groups=groups)
  if program.num_first:
    return LossSeeds(**common, through=program.first_outputs,
                     sum_ops=tuple(loss.sum_ops))
  s = owner[-1] if owner else len(exes) - 1
  first = _sums_pass(pre, exes[s].layout, s) if loss.num_sums else None
  inputs = _inputs_pass(pre, exes[s].layout, s) if loss.values.inputs else None
  return LossSeeds(**common, first=first, inputs=inputs)


def _pass_program(pre: Prepared, outputs) -> tuple[Any, tuple[int, ...]]:
  """The step's program cut down to computing ``outputs`` (consts as its
  leading inputs), and the argument leaves it reads."""
  view = jc.convert_constvars_jaxpr(pre.split.traced.jaxpr.jaxpr)
  program = dce(view.replace(outvars=list(outputs)))
  used = {v for e in program.eqns for v in e.invars if isinstance(v, Var)}
  used |= {v for v in program.outvars if isinstance(v, Var)}
  nc = pre.ctx.num_consts
  return program, tuple(k for k, v in enumerate(program.invars[nc:]) if v in used)


def _inputs_pass(pre: Prepared, layout: StageLayout, stage: int) -> SumsPass:
  """The values besides sums that the loss's cotangents read: the step's
  arguments or constants, none of the parameters or the batch (a loss
  times a scale given to the step), computed on stage ``stage``'s submesh."""
  ctx = pre.ctx
  program, leaves = _pass_program(pre, pre.split.loss.values.inputs)
  nc = ctx.num_consts
  written = Instantiator({ROWS_NAME: layout.rows}).jaxpr(program)
  consts = ctx.consts
  rules = Rules(hint=_hint_on(written, layout.mesh, ()))

  def fn(*xs):
    args = [None] * len(program.invars[nc:])
    for k, x in zip(leaves, xs, strict=True):
      args[k] = x
    return eval_jaxpr(written, consts, args, rules)
  return SumsPass(fn=jax.jit(fn), stage=stage, leaves=leaves,
                  batch=(False,) * len(leaves), specs=(PartitionSpec(),) * len(leaves))


def _sums_pass(pre: Prepared, layout: StageLayout, stage: int) -> SumsPass:
  """The first pass: the whole batch's sums the loss's cotangents read,
  computed on stage ``stage``'s submesh from the argument leaves they read
  (batch leaves as the stages take them, ``[n, M, ...]``). Its random draws
  give each device and micro-batch its rows of the whole batch's draw, as
  the stages' forward passes do (device ``d``'s rows of micro-batch ``i``
  start at ``i·M + d·m``)."""
  ctx, loss = pre.ctx, pre.split.loss
  program, leaves = _pass_program(pre, loss.values.sums)
  nc = ctx.num_consts
  batch = tuple(ctx.program.leaves[k].is_batch for k in leaves)
  manual = tuple(layout.batch_axes)
  m, n = layout.rows, ctx.n
  written = Instantiator({ROWS_NAME: m}).jaxpr(program)
  consts = ctx.consts
  ops = loss.sum_ops
  hint = _hint_on(written, layout.mesh, manual)
  draws = _draws_of(program, written)
  for path, found in draws.items():
    why = cannot_cut(eqn_at(written, path), found)
    if why:
      # Drawn per device instead, at this stage's rows per device: the
      # stage that draws it for the loss may split the batch otherwise.
      raise InputError(
          f"{ctx.program.fn_name}: the sums the loss of {loss.name} is scaled by "
          f"draw random numbers that PipeshardParallel cannot draw as on one device "
          f"({why}), so its first pass and its stages would draw different ones. "
          f"Fix: use a threefry key with jax_threefry_partitionable on, use "
          f"ShardParallel, or say how each device's and micro-batch's loss "
          f"combines: parallelize(..., output_reductions={{'loss': 'mean'}}).")

  def body(*xs):
    d = lax.axis_index(manual) if manual else 0

    def evaluate(i):
      args = [None] * len(program.invars[nc:])
      for k, b, x in zip(leaves, batch, xs, strict=True):
        args[k] = lax.dynamic_index_in_dim(x, i, 0, keepdims=False) if b else x
      first_row = lax.convert_element_type(i * ctx.micro + d * m, np.int32)
      rules = Rules(draws=draws, rows=(first_row, ctx.batch), hint=hint)
      return eval_jaxpr(written, consts, args, rules)
    return sums_pass(evaluate, n, ops, manual, n * layout.devices)

  specs = tuple(layout.batch_leaf_spec() if b else PartitionSpec() for b in batch)
  fn = body if not manual else jax.shard_map(
      body, mesh=layout.mesh, in_specs=specs, out_specs=[PartitionSpec()] * len(ops),
      axis_names=set(manual), check_vma=False)
  return SumsPass(fn=jax.jit(fn), stage=stage, leaves=leaves, batch=batch, specs=specs)


def _draws_of(program, written) -> dict:
  """The random draws of ``written`` (``program``, traced at a symbolic
  batch size, written out at a concrete one) that hold rows, by path
  (``rng.find_draws``)."""
  found = find_draws(eqns_by_path(program), RowOracle.symbolic())
  return {new: found[old] for old, new in renumbered(program, written, DRAW_PRIMITIVES)
          if old in found}


def _hint_on(jaxpr, mesh, manual):
  """How ``jaxpr`` applies a user's sharding hint (``Rules.hint``) on a
  stage's submesh, where ``manual`` axes are manual (and where the rows
  are: ``hints.in_stage``); None where it has none."""
  if not has_hints(jaxpr):
    return None
  return hint_rule(lambda x, spec: lax.with_sharding_constraint(
      x, spec if manual else NamedSharding(mesh, spec)), manual)


def _apply_segments(pre: Prepared, cut_, exes, homes) -> list[ApplySegment]:
  """The update's segments, jitted on their stages' submeshes; a donated
  leaf is donated to the last segment that reads it."""
  ctx = pre.ctx
  aj = ctx.apply.jaxpr
  nc = ctx.num_consts
  leaf_of = {aj.invars[nc + k]: k for k in range(len(ctx.program.leaves))}
  last_reader = {}
  for idx, seg in enumerate(cut_.apply.segments):
    for v in seg.inputs:
      last_reader[v] = idx
  out_leaf = {aj.outvars[j]: leaf for j, leaf in ctx.donation.items()
              if isinstance(aj.outvars[j], Var)}
  out = []
  for idx, seg in enumerate(cut_.apply.segments):
    mesh = exes[seg.stage].layout.mesh
    donate = tuple(p for p, v in enumerate(seg.inputs)
                   if v in leaf_of and ctx.program.leaves[leaf_of[v]].is_donated
                   and last_reader.get(v) == idx)
    out_specs = tuple(homes.get(out_leaf[v], PartitionSpec()) if v in out_leaf
                      else None for v in seg.outputs)
    shardings = [None if sp is None else jax.sharding.NamedSharding(mesh, sp)
                 for sp in out_specs]

    rules = Rules(hint=_hint_on(seg.jaxpr, mesh, ()))    # (the user's hints in the update)

    def fn(*xs, seg=seg, rules=rules):
      return eval_jaxpr(seg.jaxpr, (), xs, rules)
    out.append(ApplySegment(segment=seg, fn=jax.jit(fn, donate_argnums=donate,
                                                    out_shardings=shardings),
                            donate=donate, out_specs=out_specs))
  return out

