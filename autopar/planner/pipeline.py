"""From a traced step to a planned pipeline.

:func:`prepare` traces the step with the loss function captured
(``frontend/capture.py``) and builds ``P`` and its layers; :func:`plan_pipeline`
picks the stages, their submeshes and their plans (``stage_search.py``,
``stage.py``) and returns the :class:`~autopar.Plan`;
:func:`~autopar.runtime.pipeline_build.compile_pipeline` then compiles each
stage on its submesh
and returns the runnable :class:`~autopar.runtime.pipeline.PipelineStep`.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

from jax.extend.core import Literal
from jax.sharding import PartitionSpec

from autopar.costs.cost_model import assumed_costs, dtype_name
from autopar.errors import InputError, MarkerError, PlanError
from autopar.frontend.hints import check_hints, find_hints, model_axes
from autopar.frontend.loss import check_loss
from autopar.method import PipeshardParallel, auto_mesh, axis_sizes_of, resolve_mesh
from autopar.frontend.capture import capture_mode
from autopar.planner.stage import Context, cut
from autopar.planner.layers import layer_starts
from autopar.frontend.program import build_program
from autopar.planner.stage_search import (StageChoice, first_pass_time, forward_seconds,
                                          search)
from autopar.costs.submesh import tile
from autopar.plan import Plan, StagePlan, ValuePlan
from autopar.planner.shard import donation_pairs
from autopar.frontend.remat import remat_mode
from autopar.frontend.retype import lowers_with_devices
from autopar.frontend.rows import RowOracle
from autopar.frontend.split import BY_DEVICE, OutputKind, SplitStep, apply_at, split_step
from autopar.frontend.trace import (check_batch_leaves, eqns_by_path, trace_step,
                                    trace_step_any_batch)

__all__ = ["Prepared", "prepare", "plan_pipeline", "FinalInfo", "home_specs",
           "update_leaf_specs"]


@dataclasses.dataclass(frozen=True)
class FinalInfo:
  """How one output of ``P`` is combined over micro-batches: ``op`` over
  per-device values, or concatenated along ``row_dim``; ``None`` op and
  row_dim: not a step output (a seeded loss that is not returned)."""
  op: str | None
  row_dim: int | None


@dataclasses.dataclass
class Prepared:
  """A step traced for pipelining, and its context for planning."""
  split: SplitStep
  ctx: Context
  batch: int
  finals: dict


def prepare(fun, args, prep, method: PipeshardParallel, *, name: str,
            output_reductions=None) -> Prepared:
  """Traces the step ``fun`` (``args``: its arguments for tracing; ``prep``:
  their leaves, flags, inputs and names, as ``api`` prepared them) with the
  loss function captured, and builds ``P``."""
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
    traced = trace_step_any_batch(fun, args, prep.flags,
                                  prep.leaves, prep.inputs, mesh=auto_mesh(mesh),
                                  names=prep.names, failures=failures)
  if traced is None:
    # The step's own error first: traced at a micro-batch's rows, it fails
    # as the user wrote it (or with what the batch split does to it).
    with capture_mode(), remat_mode("none"):
      trace_step(fun, args, prep.flags, prep.leaves,
                 prep.inputs, micro_batch_size=micro, mesh=auto_mesh(mesh),
                 names=prep.names)
    why = failures[0] if failures else None
    raise InputError(
        f"{name}: PipeshardParallel plans the step at a symbolic batch size, and this "
        f"step cannot be traced so (its shapes depend on the batch size in a way "
        f"autopar cannot follow"
        f"{f': {type(why).__name__}: {why}' if why is not None else ''}). Fix: use "
        f"ShardParallel, or keep the batch size out of the step's Python logic.")
  split = split_step(traced, fn_name=name, output_reductions=output_reductions,
                     pipeline=True)
  if not split.has_marker:
    raise MarkerError(f"{name}: PipeshardParallel needs the gradients from "
                      f"autopar.value_and_grad / autopar.grad (the grad marker).")
  through = _check_loss(split, name, n)
  if through:
    warnings.warn(
        f"autopar: the gradient of the loss of {split.loss.name} needs values the "
        f"stages compute (sums over the rows that depend on the parameters, a ratio "
        f"or a log of such sums, or a parameter-dependent factor of one) over the "
        f"whole batch before any backward pass; a first pass runs the stages' "
        f"forward passes once more per step (plan.summary() gives its time).",
        stacklevel=4)
  compute = split.compute.jaxpr
  values = split.loss.values
  program = build_program(split.traced.jaxpr, leaves=traced.leaves,
                          grads=compute.outvars[:split.num_grads],
                          outs=compute.outvars[split.num_grads:], loss=split.loss,
                          first=[*values.sums, *values.inputs] if through else (),
                          fn_name=name)
  analysis = program.analysis(RowOracle.symbolic())
  hints = find_hints("compute", eqns_by_path(program.jaxpr), RowOracle.symbolic())
  check_hints(hints, axis_sizes_of(mesh), (), f"{name} under PipeshardParallel")
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
                accumulate=method.grad_accumulation_dtype, remat=method.remat,
                hint_axes=frozenset(model_axes(hints)),
                first_until=_first_until(program, analysis),
                whole_batch=lowers_with_devices(program.jaxpr))
  return Prepared(split=split, ctx=ctx, batch=batch, finals=_finals(split, program, name))


def _check_loss(split: SplitStep, name: str, n: int) -> bool:
  """The loss as a pipeline can seed it (``loss.py``): derived, from
  constant seeds. Returns whether the values its cotangents read need a
  first pass through the stages: sums over the batch that depend on the
  parameters (a ratio, a log or a product of such sums: a mixture of
  experts' load-balancing loss), or a factor that depends on them."""
  loss = split.loss
  check_loss(loss, name, f"{n} micro-batch(es) and the pipeline stages' devices")
  values = loss.values
  if any(not isinstance(v, Literal) for v in values.seeds):
    raise MarkerError(f"{name}: the loss's cotangent seed is computed from the "
                      f"step's inputs; PipeshardParallel needs a constant seed (as "
                      f"autopar.value_and_grad gives).")
  return bool(loss.num_sums and loss.forward_sums) or not all(values.fixed)


def _first_until(program, analysis) -> int:
  """``Context.first_until``: after the last equation of ``P`` that makes a
  first-pass output (one made by no stage's own equation, or by a floating
  one, is the last stage's)."""
  out = 0
  for j in program.first_outputs:
    v = program.jaxpr.outvars[j]
    i = analysis.producer.get(v) if not isinstance(v, Literal) else None
    out = max(out, len(program.eqns) if i is None or i in analysis.floating else i + 1)
  return out


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
  for j in program.first_outputs:       # (the first pass combines them)
    out[j] = FinalInfo(None, None)
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
  home_spec = home_specs(ctx, cut_, choices)
  S = cut_.num_stages
  in_flight = _in_flight(method.schedule, S, ctx.n)
  first = [forward_seconds(ch.time_per_micro_batch, ch.send_seconds)
           if lo < ctx.first_until else 0.0
           for (lo, _), ch in zip(cut_.ranges, choices, strict=True)]
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
        send_seconds=float(ch.send_seconds), first_pass_seconds=float(first[s])))
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
               max(c.time_per_step for c in choices) +
               first_pass_time([f for f in first if f], ctx.n))
  return Plan(method="PipeshardParallel", mesh_axis_names=names,
              mesh_shape=tuple(sizes.values()), num_micro_batches=ctx.n,
              batch_axes=(), inputs=inputs, grads=grads, outputs=(),
              memory_per_device=int(max(c.memory for c in choices)),
              objective=float(objective), stages=tuple(stage_plans),
              collectives=tuple(c for ch in choices for c in ch.collectives),
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
  for leaf, spec in update_leaf_specs(ctx, ch):
    yield leaf, spec, "update"


def home_specs(ctx, cut_, choices) -> dict[int, PartitionSpec]:
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
  made from (``stage_search.py``); with ``method.plan``, the saved plan's stages,
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


def update_leaf_specs(ctx, ch: StageChoice):
  """(argument leaf, spec) of the leaves only the stage's update reads
  (optimizer state), as its plan gives them."""
  aj = ctx.apply.jaxpr
  nc, nl = ctx.num_consts, len(ctx.program.leaves)
  index = {v: k - nc for k, v in enumerate(aj.invars) if nc <= k < nc + nl}
  return [(index[v], spec) for v, spec in ch.update_specs.items() if v in index]
