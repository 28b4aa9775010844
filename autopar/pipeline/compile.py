"""From a traced step to a planned and compiled pipeline.

:func:`prepare` traces the step with the loss function captured
(``capture.py``) and builds ``P`` and its layers; :func:`plan_pipeline`
picks the stages, their submeshes and their plans (``search.py``,
``planner.py``) and returns the :class:`~autopar.Plan`;
:func:`compile_pipeline` compiles each stage on its submesh
(``executables.py``) and the update's segments, and returns the runnable
:class:`~autopar.pipeline.runtime.PipelineStep`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.extend.core import Literal, Var
from jax.sharding import AbstractMesh, PartitionSpec

from autopar import jax_compat as jc
from autopar.disk import use_compilation_cache
from autopar.cost_model import assumed_costs, dtype_name
from autopar.errors import InputError, MarkerError, PlanError
from autopar.evaluate import Rules, eval_jaxpr
from autopar.gradients import sums_pass
from autopar.loss import check_loss
from autopar.gradients import BY_DEVICE
from autopar.method import PipeshardParallel, auto_mesh, axis_sizes_of, resolve_mesh
from autopar.pipeline.capture import capture_mode
from autopar.pipeline.executables import StageLayout, build_stage
from autopar.pipeline.planner import Context, stage_functions, cut
from autopar.pipeline.layers import layer_starts
from autopar.pipeline.program import build_program
from autopar.pipeline.runtime import (ApplySegment, FinalInfo, LossSeeds, PipelineStep,
                                      SumsPass)
from autopar.pipeline.schedule import dispatch_order, stage_tasks
from autopar.pipeline.search import StageChoice, search
from autopar.pipeline.transfer import check_movable
from autopar.pipeline.submesh import tile
from autopar.plan import Plan, StagePlan, ValuePlan, submesh
from autopar.planner import donation_pairs
from autopar.remat import remat_mode
from autopar.retype import Instantiator
from autopar.rng import DRAW_PRIMITIVES
from autopar.rows import ROWS_NAME, RowOracle
from autopar.split import OutputKind, SplitStep, apply_at, dce, scale_at, split_step
from autopar.trace import check_batch_leaves, trace_step, trace_step_any_batch

__all__ = ["Prepared", "prepare", "plan_pipeline", "compile_pipeline"]


@dataclasses.dataclass
class Prepared:
  """A step traced for pipelining, and its context for planning."""
  split: SplitStep
  ctx: Context
  batch: int
  finals: dict


def prepare(pf, prep, method: PipeshardParallel) -> Prepared:
  """Traces the step (``pf``: the ``ParallelizedFunction``; ``prep``: its
  prepared arguments) with the loss function captured, and builds ``P``."""
  name = pf._name
  mesh = resolve_mesh(method)
  n = method.micro_batches
  batch = check_batch_leaves(prep.leaves, num_micro_batches=n, data_axes=(),
                             data_size=1, fn_name=name)
  if not batch:
    raise InputError(f"{name}: PipeshardParallel streams micro-batches through the "
                     f"stages, but the step has no batch argument. Fix: say which "
                     f"arguments hold the batch with batch_argnums=.")
  micro = batch // n
  failures: list = []
  with capture_mode(), remat_mode("none"):
    traced = trace_step_any_batch(pf.fun, pf._args_for_trace(prep), prep.flags,
                                  prep.leaves, prep.inputs, mesh=auto_mesh(mesh),
                                  names=prep.names, failures=failures)
  if traced is None:
    # The step's own error first: traced at a micro-batch's rows, it fails
    # as the user wrote it (or with what the batch split does to it).
    with capture_mode(), remat_mode("none"):
      trace_step(pf.fun, pf._args_for_trace(prep), prep.flags, prep.leaves,
                 prep.inputs, micro_batch_size=micro, mesh=auto_mesh(mesh),
                 names=prep.names)
    why = failures[0] if failures else None
    raise InputError(
        f"{name}: PipeshardParallel plans the step at a symbolic batch size, and this "
        f"step cannot be traced so (its shapes depend on the batch size in a way "
        f"autopar cannot follow"
        f"{f': {type(why).__name__}: {why}' if why is not None else ''}). Fix: use "
        f"ShardParallel, or keep the batch size out of the step's Python logic.")
  split = split_step(traced, fn_name=name, output_reductions=pf.output_reductions,
                     pipeline=True)
  if not split.has_marker:
    raise MarkerError(f"{name}: PipeshardParallel needs the gradients from "
                      f"autopar.value_and_grad / autopar.grad (the grad marker).")
  _check_loss(split, name, n)
  compute = split.compute.jaxpr
  program = build_program(split.traced.jaxpr, leaves=traced.leaves,
                          grads=compute.outvars[:split.num_grads],
                          outs=compute.outvars[split.num_grads:], loss=split.loss,
                          fn_name=name)
  analysis = program.analysis(RowOracle.symbolic())
  total = math.prod(axis_sizes_of(mesh).values())
  layers = layer_starts(program, analysis, method.layers, max_layers=max(2 * total, 8),
                        rows=micro)
  apply = apply_at(split, batch)
  # Step outputs that replace donated leaves, by update output.
  donation = {}
  for o, leaf in donation_pairs(traced).items():
    if split.out_kinds[o] is OutputKind.APPLY:
      donation[split.out_index[o]] = leaf
  ctx = Context(program=program, analysis=analysis, layers=tuple(layers), apply=apply,
                num_consts=len(split.consts), consts=tuple(split.consts), micro=micro,
                n=n, batch=batch, donation=donation, grad_names=split.grad_names,
                leaf_names=tuple(l.path for l in traced.leaves), option=method.option,
                accumulate=method.grad_accumulation_dtype, remat=method.remat)
  return Prepared(split=split, ctx=ctx, batch=batch, finals=_finals(split, program, name))


def _check_loss(split: SplitStep, name: str, n: int) -> None:
  """The loss as a pipeline can seed it (``loss.py``): derived, with
  cotangents that read at most sums over the batch that the parameters do
  not change (a token count), from constant seeds."""
  loss = split.loss
  check_loss(loss, name, f"{n} micro-batch(es) and the pipeline stages' devices")
  values = loss.values
  fix = ("Fix: use ShardParallel (its first pass computes them); or say how each "
         "device's and micro-batch's loss combines, parallelize(..., "
         "output_reductions={'loss': 'mean'}) (right only if each holds as many "
         "valid rows).")
  if not all(values.fixed):
    raise InputError(
        f"{name}: the gradient of the loss of {loss.name} under PipeshardParallel "
        f"would need values computed from the parameters besides the loss's sums "
        f"(a factor of the loss that depends on them and on the sums) before any "
        f"backward pass, which no stage holds then. {fix}")
  if loss.forward_sums:
    raise InputError(
        f"{name}: the gradient of the loss of {loss.name} needs sums over the rows "
        f"that depend on the parameters (a ratio or a log of such sums) over the "
        f"whole batch before any backward pass, which a pipeline does not compute. "
        f"{fix}")
  if any(not isinstance(v, Literal) for v in values.seeds):
    raise MarkerError(f"{name}: the loss's cotangent seed is computed from the "
                      f"step's inputs; PipeshardParallel needs a constant seed (as "
                      f"autopar.value_and_grad gives).")


def _finals(split: SplitStep, program, name: str) -> dict[int, FinalInfo]:
  """How each output of ``P`` is combined over micro-batches."""
  out = {j: FinalInfo(None, None) for j in range(program.num_seeded)}
  base = program.num_seeded
  for r, op in enumerate(split.reduced):
    out[base + r] = FinalInfo(op, None)
  base += len(split.reduced)
  for o, (kind, idx) in enumerate(zip(split.out_kinds, split.out_index, strict=True)):
    if kind is OutputKind.APPLY:
      continue
    if kind is OutputKind.CONCAT:
      out[base + idx] = FinalInfo(None, split.out_dims[o].dim)
    elif kind in BY_DEVICE:
      out[base + idx] = FinalInfo(BY_DEVICE[kind], None)
    else:
      why = split.why.get(o, "it cannot be combined over micro-batches")
      raise InputError(
          f"{name}: output {split.traced.out_paths[o]} is computed from the batch "
          f"before the gradient marker and autopar cannot tell how to combine it "
          f"over micro-batches and devices: {why}. Fix: say how with "
          f"parallelize(..., output_reductions={{...: 'mean'}}).")
  return out


# -- the stages' layout --------------------------------------------------------------

def _plan_of(pre: Prepared, method, mesh, cut_, choices) -> Plan:
  """The pipeline's :class:`Plan`."""
  ctx = pre.ctx
  program = ctx.program
  sizes = axis_sizes_of(mesh)
  names = tuple(sizes)
  leaves = program.leaves
  stage_plans = []
  home_spec = _home_specs(ctx, cut_, choices)
  S = cut_.num_stages
  in_flight = _in_flight(method.schedule, S, ctx.n)
  for s, (st, ch) in enumerate(zip(cut_.stages, choices, strict=True)):
    values = []
    params = []
    for leaf, spec, kind in _stage_specs(ctx, st, ch):
      info = leaves[leaf]
      if kind == "root":
        params.append(ctx.leaf_names[leaf])
      values.append(ValuePlan(ctx.leaf_names[leaf], tuple(info.shape),
                              dtype_name(info.dtype), spec))
    stage_plans.append(StagePlan(
        index=s, layers=ch.layers, params=tuple(params), submesh_offset=ch.offset,
        submesh_shape=tuple(ch.shape), batch_axes=tuple(ch.batch_axes),
        inputs=tuple(values), time_per_micro_batch=float(ch.time_per_micro_batch),
        time_per_step=float(ch.time_per_step), memory_per_device=int(ch.memory),
        in_flight=in_flight[s], bytes_to_next=int(ch.send_bytes),
        send_seconds=float(ch.send_seconds)))
  inputs = tuple(ValuePlan(l.path, tuple(l.shape), dtype_name(l.dtype),
                           home_spec.get(k, PartitionSpec())) for k, l in enumerate(leaves))
  grads, grad_inputs = [], []
  for name, k, aval in zip(ctx.grad_names, program.grad_roots, pre.split.grad_avals,
                           strict=True):
    leaf = program.roots[k].leaf
    grads.append(ValuePlan(name, tuple(aval.shape), dtype_name(aval.dtype),
                           home_spec.get(leaf, PartitionSpec())))
    grad_inputs.append("" if leaf is None else ctx.leaf_names[leaf])
  grads = tuple(grads)
  t = [c.time_per_micro_batch for c in choices]
  objective = (sum(t) + (ctx.n - 1) * max(t) + sum(c.send_seconds for c in choices) +
               max(c.time_per_step for c in choices))
  return Plan(method="PipeshardParallel", mesh_axis_names=names,
              mesh_shape=tuple(sizes.values()), num_micro_batches=ctx.n,
              batch_axes=(), inputs=inputs, grads=grads, outputs=(),
              memory_per_device=int(max(c.memory for c in choices)),
              objective=float(objective), stages=tuple(stage_plans),
              schedule=method.schedule, costs=assumed_costs(sizes, method.option),
              grad_inputs=tuple(grad_inputs))


def _stage_specs(ctx, st, ch: StageChoice):
  """(argument leaf, spec, kind) of what stage ``st`` holds on its submesh:
  its roots that are argument leaves ("root"), the other leaves it reads
  ("leaf"; batch leaves split over its batch axes) and the leaves only its
  update reads ("update")."""
  program = ctx.program
  for k, spec in zip(st.roots, ch.root_specs, strict=True):
    leaf = program.roots[k].leaf
    if leaf is not None:
      yield leaf, spec, "root"
  for leaf, spec in zip(st.leaves, ch.leaf_specs, strict=True):
    if program.leaves[leaf].is_batch:
      spec = PartitionSpec(ch.batch_axes or None)
    yield leaf, spec, "leaf"
  for leaf, spec in _update_leaf_specs(ctx, ch):
    yield leaf, spec, "update"


def _home_specs(ctx, cut_, choices) -> dict[int, PartitionSpec]:
  """Argument leaf -> its spec on the stage it lives on (``cut_.leaf_home``)."""
  out: dict[int, PartitionSpec] = {}
  for s, (st, ch) in enumerate(zip(cut_.stages, choices, strict=True)):
    for leaf, spec, _ in _stage_specs(ctx, st, ch):
      if cut_.leaf_home.get(leaf) == s:
        out.setdefault(leaf, spec)
  return out


def _in_flight(schedule: str, S: int, n: int) -> list[int]:
  return [min(n, S - s) if schedule == "1f1b" else n for s in range(S)]


def plan_pipeline(pre: Prepared, method: PipeshardParallel, mesh) -> tuple[Plan, Any]:
  """The pipeline's plan, and the cut, choices and search result it was
  made from (``search.py``); with ``method.plan``, the saved plan's stages,
  without solving."""
  # (The plan knows the arguments' structure and the mesh, for its
  # input_shardings.)
  inputs = pre.split.traced.inputs
  if method.plan is not None:
    cut_, choices = _saved(pre, method, mesh, method.plan)
    plan = dataclasses.replace(method.plan, in_tree=inputs, mesh=mesh)
    return plan, (cut_, choices, None)
  cut_, choices, result = search(pre, method, mesh)
  plan = dataclasses.replace(_plan_of(pre, method, mesh, cut_, choices), in_tree=inputs,
                             mesh=mesh)
  return plan, (cut_, choices, result)


def _saved(pre: Prepared, method, mesh, plan: Plan):
  """The stages of a saved pipeline plan, for this step."""
  ctx = pre.ctx
  name = ctx.program.fn_name
  sizes = axis_sizes_of(mesh)
  fix = "Fix: plan again for this step and mesh (drop plan=)."
  if not isinstance(plan, Plan) or not plan.stages:
    raise PlanError(f"{name}: PipeshardParallel(plan=...) needs a pipeline plan (one "
                    f"with stages, from a PipeshardParallel step); got "
                    f"{'a ' + plan.method + ' plan' if isinstance(plan, Plan) else type(plan).__name__}. {fix}")
  if tuple(plan.mesh_shape) != tuple(sizes.values()) or \
      tuple(plan.mesh_axis_names) != tuple(sizes):
    raise PlanError(f"{name}: the saved plan is for mesh {dict(zip(plan.mesh_axis_names, plan.mesh_shape))}, "
                    f"the method's is {sizes}. {fix}")
  if plan.num_micro_batches != ctx.n:
    raise PlanError(f"{name}: the saved plan is for {plan.num_micro_batches} "
                    f"micro-batches, the method has {ctx.n}. {fix}")
  L = ctx.num_layers
  layers = [tuple(st.layers) for st in plan.stages]
  if layers[0][0] != 0 or layers[-1][1] != L or any(
      a[1] != b[0] for a, b in zip(layers, layers[1:])):
    raise PlanError(f"{name}: the saved plan's stages cover layers {layers}, but this "
                    f"step's forward pass has {L} layers. {fix}")
  tile(tuple(sizes.values()), [st.submesh_shape for st in plan.stages])
  c = cut(ctx, layers)
  choices = []
  for s, (st, sp) in enumerate(zip(c.stages, plan.stages, strict=True)):
    spec = {v.name: v.spec for v in sp.inputs}
    names = [ctx.leaf_names[ctx.program.roots[k].leaf] for k in st.roots
             if ctx.program.roots[k].leaf is not None]
    missing = [p for p in names + [ctx.leaf_names[k] for k in st.leaves] if p not in spec]
    if missing:
      raise PlanError(f"{name}: the saved plan's stage {s} has no spec for {missing[0]}, "
                      f"which this step's stage {s} reads. {fix}")
    root_specs = tuple(spec[ctx.leaf_names[ctx.program.roots[k].leaf]]
                       if ctx.program.roots[k].leaf is not None else PartitionSpec()
                       for k in st.roots)
    aj = ctx.apply.jaxpr
    update = {aj.invars[ctx.num_consts + k]: spec[ctx.leaf_names[k]]
              for k in range(len(ctx.program.leaves))
              if ctx.leaf_names[k] in spec and k not in st.leaves}
    choices.append(StageChoice(
        layers=layers[s], offset=sp.submesh_offset, shape=tuple(sp.submesh_shape),
        batch_axes=tuple(sp.batch_axes), root_specs=root_specs,
        leaf_specs=tuple(spec[ctx.leaf_names[k]] for k in st.leaves),
        update_specs=update, time_per_micro_batch=sp.time_per_micro_batch,
        time_per_step=sp.time_per_step, memory=sp.memory_per_device,
        send_bytes=sp.bytes_to_next, send_seconds=sp.send_seconds))
  return c, choices


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
    if st.hints:
      raise InputError(
          f"{program.fn_name}: the loss function has sharding hints "
          f"(with_sharding_constraint) in pipeline stage {s}; PipeshardParallel does "
          f"not carry hints into stages yet, and autopar does not drop them "
          f"silently. Fix: remove the hints, or use ShardParallel.")
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
  home_specs = _home_specs(ctx, cut_, choices)
  segments = _apply_segments(pre, cut_, exes, home_specs)
  order = dispatch_order(stage_tasks(method.schedule, cut_.num_stages, ctx.n))
  return PipelineStep(
      seeds=_loss_seeds(pre, cut_, exes),
      split=dataclasses.replace(split, apply=ctx.apply), program=program,
      stages=list(cut_.stages), exes=exes, segments=segments, order=order, n=ctx.n,
      micro=ctx.micro, root_home=dict(cut_.root_home),
      final_stage=dict(cut_.final_stage), finals=pre.finals,
      apply_consts=tuple(ctx.consts), leaf_home=dict(cut_.leaf_home),
      home_specs=home_specs)


def _loss_seeds(pre: Prepared, cut_, exes) -> LossSeeds:
  """How a pipelined step seeds the loss's entries (``loss.py``): with the
  whole batch's cotangents, over the micro-batches and devices of the stage
  that makes an entry where every group shares it; the sums they read (a
  token count) come from a first pass on the last entry's stage."""
  ctx, split = pre.ctx, pre.split
  loss = split.loss
  program = ctx.program
  owner = tuple(cut_.final_stage[j] for j in range(program.num_seeded))
  groups = tuple(ctx.n * exes[s].layout.devices for s in owner)
  seeds = tuple(np.asarray(v.val) for v in loss.values.seeds)
  s = owner[-1] if owner else len(exes) - 1
  first = _sums_pass(pre, exes[s].layout, s) if loss.num_sums else None
  inputs = _inputs_pass(pre, exes[s].layout, s) if loss.values.inputs else None
  return LossSeeds(scale=scale_at(split, ctx.batch), kinds=tuple(loss.kinds),
                   seeds=seeds, owner=owner, groups=groups, first=first, inputs=inputs)


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

  def fn(*xs):
    args = [None] * len(program.invars[nc:])
    for k, x in zip(leaves, xs, strict=True):
      args[k] = x
    return jc.eval_jaxpr(written, (), *consts, *args)
  return SumsPass(fn=jax.jit(fn), stage=stage, leaves=leaves,
                  batch=(False,) * len(leaves), specs=(PartitionSpec(),) * len(leaves))


def _sums_pass(pre: Prepared, layout: StageLayout, stage: int) -> SumsPass:
  """The first pass: the whole batch's sums the loss's cotangents read,
  computed on stage ``stage``'s submesh from the argument leaves they read
  (batch leaves as the stages take them, ``[n, M, ...]``)."""
  ctx, loss = pre.ctx, pre.split.loss
  program, leaves = _pass_program(pre, loss.values.sums)
  if any(e.primitive.name in DRAW_PRIMITIVES for e in program.eqns):
    raise InputError(f"{ctx.program.fn_name}: the sums the loss of {loss.name} is scaled "
                     f"by draw random numbers; PipeshardParallel does not draw them as "
                     f"on one device. Fix: use ShardParallel, or say how each device's "
                     f"and micro-batch's loss combines: parallelize(..., "
                     f"output_reductions={{'loss': 'mean'}}).")
  nc = ctx.num_consts
  batch = tuple(ctx.program.leaves[k].is_batch for k in leaves)
  manual = tuple(layout.batch_axes)
  m, n = layout.rows, ctx.n
  written = Instantiator({ROWS_NAME: m}).jaxpr(program)
  consts = ctx.consts
  ops = loss.sum_ops

  def body(*xs):
    def evaluate(i):
      args = [None] * len(program.invars[nc:])
      for k, b, x in zip(leaves, batch, xs, strict=True):
        args[k] = lax.dynamic_index_in_dim(x, i, 0, keepdims=False) if b else x
      return jc.eval_jaxpr(written, (), *consts, *args)
    return sums_pass(evaluate, n, ops, manual, n * layout.devices)

  specs = tuple(layout.batch_leaf_spec() if b else PartitionSpec() for b in batch)
  fn = body if not manual else jax.shard_map(
      body, mesh=layout.mesh, in_specs=specs, out_specs=[PartitionSpec()] * len(ops),
      axis_names=set(manual), check_vma=False)
  return SumsPass(fn=jax.jit(fn), stage=stage, leaves=leaves, batch=batch, specs=specs)


def _update_leaf_specs(ctx, ch: StageChoice):
  """(argument leaf, spec) of the leaves only the stage's update reads
  (optimizer state), as its plan gives them."""
  aj = ctx.apply.jaxpr
  nc, nl = ctx.num_consts, len(ctx.program.leaves)
  index = {v: k - nc for k, v in enumerate(aj.invars) if nc <= k < nc + nl}
  return [(index[v], spec) for v, spec in ch.update_specs.items() if v in index]


def _apply_segments(pre: Prepared, cut_, exes, home_specs) -> list[ApplySegment]:
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
    out_specs = tuple(home_specs.get(out_leaf[v], PartitionSpec()) if v in out_leaf
                      else None for v in seg.outputs)
    shardings = [None if sp is None else jax.sharding.NamedSharding(mesh, sp)
                 for sp in out_specs]

    def fn(*xs, seg=seg):
      return eval_jaxpr(seg.jaxpr, (), xs, Rules())
    out.append(ApplySegment(segment=seg, fn=jax.jit(fn, donate_argnums=donate,
                                                    out_shardings=shardings),
                            donate=donate, out_specs=out_specs))
  return out

