"""From a traced step to a planned pipeline.

:func:`prepare` traces the step for a pipeline (``frontend/pipeline.py``)
and finds its layers (``layers.py``); :func:`plan_pipeline` picks the
stages, their submeshes and their plans (``stage_search.py``,
``stage.py``) and returns the :class:`~autopar.Plan`;
``backend/pipeline_build.py`` then compiles each stage on its submesh and
``runtime/pipeline.py`` runs them in the schedule's order.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jax.sharding import PartitionSpec

from autopar.costs.cost_model import assumed_costs, dtype_name
from autopar.costs.submesh import tile
from autopar.errors import InputError, PlanError
from autopar.frontend.cut import cut, home_specs, stage_specs
from autopar.frontend.hints import entry_axes, model_axes
from autopar.frontend.pipeline import Context, Prepared, trace_pipelined
from autopar.frontend.split import OutputKind
from autopar.costs.schedule import AUTO_SCHEDULES, held_at_most, stages_on
from autopar.method import PipeshardParallel, auto_mesh, axis_sizes_of, resolve_mesh
from autopar.plan import Plan, StagePlan, ValuePlan
from autopar.planner.cache import fingerprint
from autopar.planner.layers import layer_starts
from autopar.planner.shard import donation_pairs
from autopar.planner.stage_search import (StageChoice, first_pass_time, forward_seconds,
                                          schedule_seconds, search)

__all__ = ["prepare", "plan_pipeline", "micro_batch_candidates", "weighed_against"]


def prepare(fun, args, prep, method: PipeshardParallel, *, name: str,
            output_reductions=None) -> Prepared:
  """Traces the step ``fun`` for ``method``'s pipeline (``args``: its
  arguments for tracing; ``prep``: their leaves, flags, inputs and names,
  as ``api`` prepared them) and finds its layers: the step with what
  planning its stages reads."""
  mesh = resolve_mesh(method)
  sizes = axis_sizes_of(mesh)
  t = trace_pipelined(fun, args, prep, n=method.micro_batches, mesh=auto_mesh(mesh),
                      axis_sizes=sizes, name=name, output_reductions=output_reductions)
  split, program = t.split, t.program
  layers = layer_starts(program, t.analysis, method.layers,
                        max_layers=max(2 * math.prod(sizes.values()), 8), rows=t.micro)
  # Step outputs that replace donated leaves, by update output.
  donation = {}
  for o, leaf in donation_pairs(t.traced).items():
    if split.out_kinds[o] is OutputKind.APPLY:
      donation[split.out_index[o]] = leaf
  ctx = Context(program=program, analysis=t.analysis, layers=tuple(layers), apply=t.apply,
                num_consts=len(split.consts), consts=tuple(split.consts), micro=t.micro,
                n=method.micro_batches, batch=t.batch, donation=donation,
                grad_names=split.grad_names,
                leaf_names=tuple(l.path for l in t.traced.leaves), option=method.option,
                accumulate=method.grad_accumulation_dtype, remat=method.remat,
                hint_axes=frozenset(model_axes(t.hints)), through=t.through,
                first_until=t.first_until,
                whole_batch=t.whole_batch, program_at=t.program_at)
  return Prepared(split=split, ctx=ctx, batch=t.batch, finals=t.finals, scale=t.scale)


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
  v = method.virtual_stages
  in_flight = held_at_most(method.schedule, S // v, ctx.n, v)
  first = [forward_seconds(ch.time_per_micro_batch, ch.send_seconds)
           if lo < ctx.first_until else 0.0
           for (lo, _), ch in zip(cut_.ranges, choices, strict=True)]
  for s, (st, ch) in enumerate(zip(cut_.stages, choices, strict=True)):
    values = []
    params = []
    zero = zero_params = False
    for leaf, spec, kind in stage_specs(ctx, st, ch):
      info = leaves[leaf]
      if kind == "root":
        params.append(ctx.leaf_names[leaf])
      if {a for e in spec for a in entry_axes(e)} & set(ch.batch_axes):
        zero = zero or kind == "update"
        zero_params = zero_params or kind == "root"
      values.append(ValuePlan(ctx.leaf_names[leaf], tuple(info.shape),
                              dtype_name(info.dtype), spec))
    stage_plans.append(StagePlan(
        index=s, layers=ch.layers, params=tuple(params), submesh_offset=ch.offset,
        submesh_shape=tuple(ch.shape), batch_axes=tuple(ch.batch_axes),
        inputs=tuple(values), time_per_micro_batch=float(ch.time_per_micro_batch),
        time_per_step=float(ch.time_per_step), memory_per_device=int(ch.memory),
        in_flight=in_flight[s], bytes_to_next=int(ch.send_bytes),
        send_seconds=float(ch.send_seconds), first_pass_seconds=float(first[s]),
        zero_state=zero, zero_params=zero_params, root_specs=tuple(ch.root_specs),
        grad_specs=tuple(ch.grad_specs), pins=ch.pins))
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
  objective = (schedule_seconds(method.schedule, t, ctx.n, v) +
               sum(c.send_seconds for c in choices) +
               max(c.time_per_step for c in choices) +
               first_pass_time([f for f in first if f], ctx.n))
  return Plan(method="PipeshardParallel", mesh_axis_names=names,
              mesh_shape=tuple(sizes.values()), num_micro_batches=ctx.n,
              batch_axes=(), inputs=inputs, grads=grads, outputs=(),
              memory_per_device=int(max(sum(on) for on in stages_on(
                  method.schedule, S // v, [c.memory for c in choices]))),
              virtual_stages=v,
              objective=float(objective), stages=tuple(stage_plans),
              collectives=tuple(c for ch in choices for c in ch.collectives),
              schedule=method.schedule, costs=assumed_costs(sizes, method.option),
              grad_inputs=tuple(grad_inputs))


def plan_pipeline(pre: Prepared, method: PipeshardParallel, mesh,
                  now: dict | None = None) -> tuple[Plan, Any]:
  """The pipeline's plan, and the cut, choices and search result it was
  made from (``stage_search.py``); with ``method.plan``, the saved plan's stages,
  without solving."""
  # (The plan knows the arguments' structure and the mesh, for its
  # input_shardings.)
  inputs = pre.split.traced.inputs
  if method.plan is not None:
    # The stages' own layout (their roots', gradients' and intermediates'
    # specs) is followed where the plan was made for this very step: its
    # program, arguments, mesh and the method's settings (remat and the
    # layers shape the stages' passes too); else the stages are laid out
    # from their inputs' specs alone.
    # (``now``: this step's fingerprint, where the caller has it.)
    now = now or fingerprint(pre.split, method, mesh, pre.batch)
    exact = dict(method.plan.fingerprint) == now
    if (method.plan.stages and method.schedule != "auto"
        and method.virtual_stages != method.plan.virtual_stages):
      raise PlanError(
          f"{pre.ctx.program.fn_name}: the saved plan runs {method.plan.virtual_stages} "
          f"stage(s) on each submesh, the method asks for virtual_stages="
          f"{method.virtual_stages}. Fix: use the plan's, or plan again (drop plan=).")
    if method.schedule not in ("auto", method.plan.schedule) and method.plan.stages:
      raise PlanError(
          f"{pre.ctx.program.fn_name}: the saved plan is for schedule "
          f"{method.plan.schedule!r}, the method asks for {method.schedule!r} (its "
          f"stages' memory and times are counted for the plan's). Fix: use "
          f"schedule={method.plan.schedule!r} or 'auto' with this plan, or plan "
          f"again (drop plan=).")
    cut_, choices = _saved(pre, method, mesh, method.plan, exact)
    plan = dataclasses.replace(method.plan, in_tree=inputs, mesh=mesh)
    return plan, (cut_, choices, None)
  if method.schedule != "auto":
    cut_, choices, result = search(pre, method, mesh)
    plan = _plan_of(pre, method, mesh, cut_, choices)
  else:
    plan, (cut_, choices, result) = _auto_schedule(pre, method, mesh)
  return dataclasses.replace(plan, in_tree=inputs, mesh=mesh), (cut_, choices, result)


def _auto_candidates(method: PipeshardParallel, n: int, num_layers: int,
                     num_devices: int) -> list[tuple[str, str, dict]]:
  """What ``schedule="auto"`` weighs: (its name in ``plan.schedule_search``,
  schedule, the method's fields to change). Each of ``AUTO_SCHEDULES``;
  where the number of submeshes is given (an int ``num_stages`` or
  ``stage_mesh_shapes``), interleaved 1F1B with 2 stages a submesh (if
  ``n`` is a multiple of the submeshes) and ZB-V too; else ZB-V on each
  power of two of submeshes that divides the devices, from 2 up to half the
  layers."""
  out = [(s, s, {"virtual_stages": 1}) for s in AUTO_SCHEDULES]
  submeshes = method.num_submeshes
  if submeshes == "auto":
    D = 2
    while 2 * D <= num_layers and num_devices % D == 0:
      out.append((f"zb-v on {D} submeshes", "zb-v", {"virtual_stages": 2,
                                                      "num_stages": D}))
      D *= 2
  elif submeshes >= 2:
    if n % submeshes == 0:
      out.append(("interleaved-1f1b", "interleaved-1f1b", {"virtual_stages": 2}))
    out.append(("zb-v", "zb-v", {"virtual_stages": 2}))
  return out


def _auto_schedule(pre: Prepared, method: PipeshardParallel, mesh):
  """``schedule="auto"``: the stages searched under each of
  ``_auto_candidates``, and the plan of the one whose plan takes least in
  the model (the first of equals), with what each would take."""
  found, weighed, refusals = [], [], []
  devices = math.prod(axis_sizes_of(mesh).values())
  for name, schedule, fields in _auto_candidates(method, pre.ctx.n, pre.ctx.num_layers,
                                                 devices):
    try:
      m = dataclasses.replace(method, schedule=schedule, **fields)
      cut_, choices, result = search(pre, m, mesh)
    except (PlanError, InputError) as e:
      refusals.append(e)
      weighed.append((name, None, str(e).split(". Fix:")[0]))
      continue
    plan = _plan_of(pre, m, mesh, cut_, choices)
    found.append((plan.objective, len(found), plan, (cut_, choices, result), name))
    weighed.append((name, plan.objective, ""))
  if not found:
    raise PlanError("; and ".join(f"under {s}: {why}" for s, _, why in weighed) +
                    ". Fix: raise the budget, use more stages or more micro-batches, "
                    "or remat.") from refusals[-1]
  _, _, plan, chosen, name = min(found, key=lambda f: f[:2])
  return (dataclasses.replace(plan, schedule_search=weighed_against(
      weighed, name, plan.objective)), chosen)


def weighed_against(weighed, chosen, objective: float) -> tuple:
  """``weighed``'s (choice, modelled step seconds or None, why refused)
  with each why filled in against the ``chosen`` one's ``objective``."""
  def reason(s, t, refused):
    if s == chosen:
      return "chosen"
    if refused:
      return refused
    return (f"slower: {t / objective:.3g}x the chosen plan's step"
            if t > objective else "as fast: the first of equals is kept")
  return tuple((s, t, reason(s, t, refused)) for s, t, refused in weighed)


# num_micro_batches="auto" weighs at most this many micro-batches.
MAX_AUTO_MICRO_BATCHES = 64


def micro_batch_candidates(batch: int, multiple_of: int = 1) -> list[int]:
  """What ``num_micro_batches="auto"`` weighs for a batch of ``batch``
  rows: its divisors up to ``MAX_AUTO_MICRO_BATCHES`` that are multiples
  of ``multiple_of``, each at least twice the last taken (1, 2, 4, ... for
  a power of two; 1, 2, 4, 12 for 12)."""
  out: list[int] = []
  for d in range(1, min(batch, MAX_AUTO_MICRO_BATCHES) + 1):
    if batch % d == 0 and d % multiple_of == 0 and (not out or d >= 2 * out[-1]):
      out.append(d)
  return out


def _saved(pre: Prepared, method, mesh, plan: Plan, exact: bool):
  """The stages of a saved pipeline plan, for this step; ``exact``: the
  plan was made for this step and method, and its stages' own layout
  (``StagePlan.root_specs``, ``grad_specs``, ``pins``) is followed."""
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
  tile(tuple(sizes.values()), [st.submesh_shape for st in
                               plan.stages[:len(plan.stages) // plan.virtual_stages]])
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
    own = exact and len(sp.root_specs) == len(st.roots)
    choices.append(StageChoice(
        layers=layers[s], offset=sp.submesh_offset, shape=tuple(sp.submesh_shape),
        batch_axes=tuple(sp.batch_axes),
        root_specs=tuple(sp.root_specs) if own else root_specs,
        leaf_specs=tuple(spec[ctx.leaf_names[k]] for k in st.leaves),
        grad_specs=tuple(sp.grad_specs) if own else (), pins=sp.pins if own else ({}, {}),
        update_specs=update, time_per_micro_batch=sp.time_per_micro_batch,
        time_per_step=sp.time_per_step, memory=sp.memory_per_device,
        send_bytes=sp.bytes_to_next, send_seconds=sp.send_seconds))
  return c, choices
