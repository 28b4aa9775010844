"""A planned pipeline's executables: each stage compiled on its submesh
(``stage_executables.py``), the passes before the schedule (the loss's sums,
the arguments its cotangents read) and the update's segments, each jitted
on its stage's submesh. ``runtime/pipeline.py`` runs them in the
schedule's order; planning is ``planner/pipeline.py``'s."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.extend.core import Var
from jax.sharding import NamedSharding, PartitionSpec

from autopar import jax_compat as jc
from autopar.backend.gradients import sums_pass
from autopar.backend.stage_executables import StageExecutables, StageLayout, build_stage
from autopar.errors import InputError
from autopar.frontend.apply_segments import Segment
from autopar.frontend.cut import stage_functions
from autopar.frontend.evaluate import Rules, eqn_at, eval_jaxpr
from autopar.frontend.hints import hint_rule
from autopar.frontend.pipeline import Prepared
from autopar.frontend.retype import Instantiator, has_hints
from autopar.frontend.rng import DRAW_PRIMITIVES, cannot_cut, find_draws
from autopar.frontend.rows import ROWS_NAME, RowOracle
from autopar.frontend.split import dce, renumbered
from autopar.frontend.trace import eqns_by_path
from autopar.plan import submesh

__all__ = ["ApplySegment", "SumsPass", "build_stages", "sums_pass_of", "inputs_pass",
           "apply_segments"]


@dataclasses.dataclass(frozen=True)
class ApplySegment:
  """An update segment, jitted for its stage's submesh."""
  segment: Segment
  fn: Any
  donate: tuple[int, ...]          # input positions donated
  out_specs: tuple                 # per output: spec on the submesh, or None


@dataclasses.dataclass(frozen=True)
class SumsPass:
  """A pass on one stage's submesh before the schedule: ``fn(*leaves)``
  gives what the loss's cotangents read (the whole batch's sums; or the
  step's arguments they read), from the argument ``leaves`` it reads (batch
  ones as ``[n, M, ...]``), each placed with its spec."""
  fn: Any
  stage: int
  leaves: tuple[int, ...]
  batch: tuple[bool, ...]
  specs: tuple


def build_stages(pre: Prepared, mesh, cut_, choices, *,
                 split_backward: bool = False) -> list[StageExecutables]:
  """Each stage of ``cut_`` compiled on its submesh of ``mesh`` as the
  planner's ``choices`` lay it out (jitted; each compiles at its first
  call, ``runtime.pipeline``); ``split_backward``: with the backward also
  in two (``build_stage``)."""
  ctx = pre.ctx
  program = ctx.program
  exes = []
  for st, ch in zip(cut_.stages, choices, strict=True):
    layout = StageLayout(
        mesh=submesh(mesh, ch.offset, ch.shape), batch_axes=tuple(ch.batch_axes),
        micro=ctx.micro, n=ctx.n, root_specs=tuple(ch.root_specs),
        leaf_specs=tuple(ch.leaf_specs),
        batch_leaf=tuple(program.leaves[k].is_batch for k in st.leaves),
        final_rows=tuple(pre.finals[j].row_dim for j in st.finals),
        grad_specs=tuple(ch.grad_specs), pins=ch.pins, accumulate=ctx.accumulate)
    fns = stage_functions(ctx, st, layout.rows)
    exes.append(build_stage(
        st, fns, layout, step_consts=[ctx.consts[k] for k in st.step_consts],
        fn_consts=[program.consts[k] for k in st.fn_consts],
        split_backward=split_backward))
  return exes


def _pass_program(pre: Prepared, outputs) -> tuple[Any, tuple[int, ...]]:
  """The step's program cut down to computing ``outputs`` (consts as its
  leading inputs), and the argument leaves it reads."""
  view = jc.convert_constvars_jaxpr(pre.split.traced.jaxpr.jaxpr)
  program = dce(view.replace(outvars=list(outputs)))
  used = {v for e in program.eqns for v in e.invars if isinstance(v, Var)}
  used |= {v for v in program.outvars if isinstance(v, Var)}
  nc = pre.ctx.num_consts
  return program, tuple(k for k, v in enumerate(program.invars[nc:]) if v in used)


def _program_pass(program, outputs) -> tuple[Any, tuple[int, ...]]:
  """``P`` (``program``) cut down to computing its ``outputs`` (indices),
  and the argument leaves that reads (its inputs: the step's consts, the
  leaves, the roots, which the sums of the first pass do not read)."""
  jaxpr = dce(program.jaxpr.replace(outvars=[program.jaxpr.outvars[j] for j in outputs]))
  used = {v for e in jaxpr.eqns for v in e.invars if isinstance(v, Var)}
  used |= {v for v in jaxpr.outvars if isinstance(v, Var)}
  return jaxpr, tuple(k for k, v in enumerate(program.leaf_vars) if v in used)


def inputs_pass(pre: Prepared, layout: StageLayout, stage: int) -> SumsPass:
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


def sums_pass_of(pre: Prepared, layout: StageLayout, stage: int) -> SumsPass:
  """The first pass: the whole batch's sums the loss's cotangents read,
  computed on stage ``stage``'s submesh from the argument leaves they read
  (batch leaves as the stages take them, ``[n, M, ...]``). Its random draws
  give each device and micro-batch its rows of the whole batch's draw, as
  the stages' forward passes do (device ``d``'s rows of micro-batch ``i``
  start at ``i·M + d·m``)."""
  ctx, loss = pre.ctx, pre.split.loss
  m, n = layout.rows, ctx.n
  if ctx.program_at is None:
    program, leaves = _pass_program(pre, loss.values.sums)
    written = Instantiator({ROWS_NAME: m}).jaxpr(program)
    draws = _draws_of(program, written)
  else:
    # Traced at concrete sizes: P at these rows, cut down to the sums (its
    # first outputs); its draws are P's at a micro-batch's rows, by path.
    sums = ctx.program.first_outputs[:loss.num_sums]
    program, leaves = _program_pass(ctx.program, sums)
    written, _ = _program_pass(ctx.program_at(m), sums)
    draws = find_draws(eqns_by_path(program), ctx.analysis.oracle)
  nc = ctx.num_consts
  batch = tuple(ctx.program.leaves[k].is_batch for k in leaves)
  manual = tuple(layout.batch_axes)
  consts = ctx.consts
  ops = loss.sum_ops
  hint = _hint_on(written, layout.mesh, manual)
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


def apply_segments(pre: Prepared, cut_, exes, homes) -> list[ApplySegment]:
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

