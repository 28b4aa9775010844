"""The preset methods' plans, decided directly (no solver).

=============  ============  =============  ===================  ==============
method         batch         parameters     optimizer state      gradients
=============  ============  =============  ===================  ==============
DataParallel   batch axes    replicated     replicated           all-reduce
Zero2Parallel  batch axes    replicated     sharded              reduce-scatter
Zero3Parallel  batch axes    sharded        sharded              reduce-scatter
=============  ============  =============  ===================  ==============

"Parameters" are the state leaves the gradient computation reads;
"optimizer state" is every other non-batch leaf. A leaf is sharded on its
first dimension that the batch axes divide (or kept replicated if none
does). The helpers shared with ``ShardParallel``'s planner (batch axes,
donation pairs) are in ``shard.py``; the stage names in ``plan.py``.
"""

from __future__ import annotations

import math

import numpy as np
from jax.extend.core import Var
from jax.sharding import PartitionSpec

from autopar.costs.cost_model import MeshCost, assumed_costs, dtype_name, num_bytes
from autopar.costs.devices import dominant_float_dtype, hardware_option, platform_of
from autopar.errors import InputError
from autopar.frontend.gradstack import find_grad_stacks, folded_values
from autopar.frontend.hints import check_hints, check_pins, entry_axes
from autopar.costs.liveness import liveness_peaks
from autopar.method import (AutoShardingOption, ParallelMethod, ShardParallel,
                            Zero2Parallel, Zero3Parallel, accumulation_dtype,
                            axis_names_of, axis_sizes_of)
from autopar.plan import CollectivePlan, Plan, ValuePlan
from autopar.plan import grad_stage_label, sync_stage_name
from autopar.costs.strategies import batch_spec
from autopar.planner.shard import (batch_axes_for, candidate_batch_axes, donation_pairs,
                                   grad_inputs, keeps_batch_whole, LayoutPrices,
                                   shard_first_divisible)
from autopar.planner.solved import predicted_time, spec_axes
from autopar.frontend.split import (OutputKind, SizedOutputs, SplitStep, depends_on,
                                    leaf_gather_sites, leaves_read_by_compute)

__all__ = ["plan_preset"]


def plan_preset(split: SplitStep, method: ParallelMethod, mesh, *,
                batch_size: int, outputs: SizedOutputs | None = None,
                trace_local=None, option=None,
                price_cache: LayoutPrices | None = None,
                cheaper_than: float | None = None) -> Plan | None:
  """The plan of a preset method (see the module docstring).

  ``outputs``: the step's outputs at the whole batch (default: ``split``'s).
  ``trace_local(rows)``: the step split at ``rows`` rows, for the memory
  estimate of what one device runs (default: ``split`` read with each
  value that depends on the batch divided over the batch axes).
  ``option``: the costs to price it with (default: the method's, or those
  ShardParallel would take on ``mesh``: :func:`preset_option`).
  ``price_cache``: the prices shared by calls that price the same step
  with the same option (ZeRO-2's and ZeRO-3's prices solve one problem;
  :class:`~autopar.planner.shard.LayoutPrices`).
  ``cheaper_than``: None where the plan's objective is not below this (its
  memory, a liveness analysis of the whole step, is then not estimated).
  """
  traced = split.traced
  sizes = axis_sizes_of(mesh)
  batch_axes = batch_axes_for(method, mesh, split.hints)
  if isinstance(method, ShardParallel) and not method.option.force_batch_dim_to_mesh_dim:
    # The largest set of axes that divides the batch (all of them if it can).
    micro = batch_size // method.micro_batches if batch_size else 0
    batch_axes = max(candidate_batch_axes(method, mesh, micro, split.hints,
                                          whole=keeps_batch_whole(split, method)),
                     key=lambda axes: math.prod(sizes[a] for a in axes))
  check_hints({h.path: h for h in split.hints}, sizes, batch_axes,
              f"{method.name} (batch axes {batch_axes})")
  zero = 3 if isinstance(method, Zero3Parallel) else \
      2 if isinstance(method, Zero2Parallel) else 0
  n = method.micro_batches
  batch_entry = (None if not batch_axes else
                 batch_axes[0] if len(batch_axes) == 1 else tuple(batch_axes))
  params = leaves_read_by_compute(split)

  pins = {}
  if isinstance(method, ShardParallel) and method.option.pins:
    pins = check_pins(method.option.pin_map, traced.leaves, sizes)
  in_specs = []
  for k, l in enumerate(traced.leaves):
    if l.is_batch:
      spec = PartitionSpec(batch_entry)
    elif zero == 3 or (zero == 2 and k not in params):
      spec = shard_first_divisible(l.shape, batch_axes, sizes)
    else:
      spec = PartitionSpec()
    if k in pins and spec_axes(pins[k]) != spec_axes(spec):
      if l.is_batch or any(a in batch_axes for e in pins[k] for a in entry_axes(e)):
        raise InputError(
            f"AutoShardingOption(pins=...): {l.path} is pinned to {pins[k]}, but "
            f"{method.name} without the solver splits the batch over {batch_axes} "
            f"(the step has no grad marker, or force_data_parallel is set), which "
            f"{'gives this batch leaf' if l.is_batch else 'the pin also uses; it gives'} "
            f"{spec}. Fix: pin over the other mesh axes, or let the solver plan.")
      spec = pins[k]
    in_specs.append(spec)

  grad_specs = []
  if split.has_marker:
    for aval in split.grad_avals:
      grad_specs.append(shard_first_divisible(aval.shape, batch_axes, sizes)
                        if zero else PartitionSpec())

  pairs = donation_pairs(traced)
  jaxpr = traced.jaxpr.jaxpr
  on_batch = depends_on(jaxpr, [v for v, l in zip(jaxpr.invars, traced.leaves)
                                if l.is_batch])
  out_avals = (outputs.avals if outputs is not None
               else [v.aval for v in jaxpr.outvars])
  out_specs = []
  for j, (kind, v, rows) in enumerate(zip(split.out_kinds, jaxpr.outvars,
                                          split.out_dims, strict=True)):
    if j in pairs:
      out_specs.append(in_specs[pairs[j]])
    elif rows is not None and (kind is OutputKind.CONCAT or (
        not split.has_marker and isinstance(v, Var) and v in on_batch)):
      out_specs.append(batch_spec(len(v.aval.shape), rows.dim, batch_entry))
    else:
      out_specs.append(PartitionSpec())

  inputs = tuple(ValuePlan(l.path, l.shape, dtype_name(l.dtype), s)
                 for l, s in zip(traced.leaves, in_specs, strict=True))
  grads = tuple(ValuePlan(name, tuple(a.shape), dtype_name(a.dtype), s)
                for name, a, s in zip(split.grad_names, split.grad_avals
                                      if split.has_marker else [], grad_specs))
  planned_outputs = tuple(ValuePlan(p, tuple(a.shape), dtype_name(a.dtype), s)
                          for p, a, s in zip(traced.out_paths, out_avals, out_specs,
                                             strict=True))

  sites = leaf_gather_sites(split) if split.has_marker else {}
  grad_sync = method.grad_sync
  collectives = _preset_collectives(split, inputs, grads, params, batch_axes,
                                    sizes, n, sync_stage_name(n, grad_sync), zero,
                                    out_avals, sites)
  if option is None:
    option = method.option if isinstance(method, ShardParallel) else preset_option(
        mesh, traced.leaves)
  cost = MeshCost(sizes, option.alpha, option.beta)
  objective = sum(cost.collective(c.kind, c.bytes, c.axes) * c.per_step
                  for c in collectives)
  if zero and cheaper_than is not None and not objective < cheaper_than:
    # ZeRO's collectives alone cost no less; its priced time (``_priced``)
    # adds its compute and a latency per leaf's collective: not cheaper,
    # and its layout is not priced (a problem over every axis built).
    return None
  d = math.prod(sizes[a] for a in batch_axes)
  stacked = set()
  if split.has_marker:
    stacked = {g for s in find_grad_stacks(split.compute.jaxpr, split.num_grads,
                                           grad_specs, batch_axes)
               for g in s.grads}
  apart = n > 1 and grad_sync == "apart"
  memory = _memory_estimate(inputs, grads, sizes, d, n, method.grad_accumulation_dtype,
                            stacked, apart)
  local = None
  if split.has_marker and trace_local is not None and d > 1:
    local = trace_local(traced.micro_batch_size // d)
  times = {}
  if split.has_marker and trace_local is not None:
    times = _priced(local or trace_local(traced.micro_batch_size // d), method, mesh,
                    batch_axes, in_specs, traced, zero, collectives, cost, d,
                    num_grads=sum(1 for g in grads if any(g.spec)),
                    num_params=sum(sites.get(k, 1) for k in params if any(in_specs[k])
                                   and not traced.leaves[k].is_batch),
                    cost_option=option, cache=price_cache)
    objective = times["gradient"]["total"] + times["apply"]["total"]
  if cheaper_than is not None and not objective < cheaper_than:
    return None
  memory += _preset_activation_peak(split, local, params, grads, d, zero, n, batch_axes,
                                    platform_of(option.device_kind), apart)
  if apart:
    memory = max(memory, _sync_stage_memory(inputs, grads, sizes,
                                            method.grad_accumulation_dtype))
  return Plan(method=method.name, mesh_axis_names=axis_names_of(mesh),
              mesh_shape=tuple(sizes.values()), num_micro_batches=n,
              batch_axes=batch_axes, inputs=inputs, grads=grads,
              outputs=planned_outputs, collectives=tuple(collectives),
              memory_per_device=memory,
              objective=float(objective), costs=assumed_costs(sizes, option),
              grad_inputs=grad_inputs(split), predicted_time=times,
              grad_sync=grad_sync, in_tree=traced.inputs, mesh=mesh)


def preset_option(mesh, leaves) -> AutoShardingOption:
  """The costs a preset method's plan is priced with: those ShardParallel
  would take on ``mesh`` with no option given (the device kind of a real
  mesh's devices; the defaults for an AbstractMesh), so that the two
  methods' objectives compare."""
  dtype = dominant_float_dtype([(dtype_name(l.dtype), math.prod(l.shape)) for l in leaves])
  return hardware_option(AutoShardingOption(), mesh, dtype)


def _priced(local, method, mesh, batch_axes, in_specs, traced, zero, collectives,
            cost: MeshCost, d: int, num_grads: int = 1, num_params: int = 1,
            cost_option=None, cache: LayoutPrices | None = None) -> dict:
  """The preset plan's predicted time by stage, by the model ShardParallel's
  ILP minimises (``shard.price_layout``), so that objectives compare
  across methods. ZeRO updates each device's shard of the state, which
  the ILP's space does not hold (it gathers a split leaf to use it): its
  stages are data parallelism's compute, the update's roofline over the
  ``d`` shards, and the preset's own collectives (``_preset_collectives``,
  what XLA compiles: the gradients reduce-scattered, the parameters
  gathered)."""
  rows = traced.micro_batch_size // d
  layout = [PartitionSpec(*s) if l.is_batch or not zero else PartitionSpec()
            for l, s in zip(traced.leaves, in_specs)]
  prices = cache if cache is not None else LayoutPrices()
  stage_times = prices.stage_times(local, method, mesh, batch_axes, layout, rows,
                                   option=cost_option)
  times = predicted_time(stage_times)
  if zero:
    grad, apply = times["gradient"], times["apply"]
    apply["flops"] /= d
    apply["memory"] /= d
    apply["roofline"] = max(apply["flops"], apply["memory"])
    # ZeRO's collectives are one per leaf in the compiled module (XLA does
    # not combine reduce-scatters and all-gathers as it does all-reduces):
    # a latency each.
    pieces = {"gradients": num_grads, "updated parameters": num_grads,
              "parameters for the forward/backward pass": num_params}

    def seconds(c):
      k = max(1, pieces.get(c.what, 1))
      return cost.collective(c.kind, c.bytes / k, c.axes) * k * c.per_step
    grad["collectives"] = sum(seconds(c) for c in collectives if c.stage != "apply_grad")
    apply["collectives"] = sum(seconds(c) for c in collectives if c.stage == "apply_grad")
    for t in (grad, apply):
      t["total"] = t["roofline"] + t["collectives"] + t.get("passes", 0.0)
  return times


def _preset_collectives(split, inputs, grads, params, batch_axes, sizes, n, sync, zero,
                        out_avals, sites):
  if not split.has_marker or not batch_axes or \
      math.prod(sizes[a] for a in batch_axes) == 1:
    return []
  grad_bytes = sum(num_bytes(g.shape, g.dtype) for g in grads)
  out = [CollectivePlan(stage=sync,
                        kind="reduce-scatter" if zero else "all-reduce",
                        axes=batch_axes, bytes=grad_bytes, per_step=1,
                        what="gradients")]
  combined = [a for k, a in zip(split.out_kinds, out_avals)
              if k in (OutputKind.MEAN, OutputKind.SUM, OutputKind.MAX, OutputKind.MIN)]
  combined += split.reduced_avals
  if combined:
    out.append(CollectivePlan(stage=sync, kind="all-reduce", axes=batch_axes,
                              bytes=sum(num_bytes(a.shape, a.dtype) for a in combined),
                              per_step=1, what="sums over the batch's rows (loss, "
                              "metrics)"))
  sharded_params = [k for k in sorted(params)
                    if any(inputs[k].spec) and not split.traced.leaves[k].is_batch]
  if zero == 3 and sharded_params:
    # (Gathered for each reader: ``evaluate.gather_sites``.)
    b = sum(inputs[k].bytes_per_device(sizes) * sites.get(k, 1) for k in sharded_params)
    out.append(CollectivePlan(stage=grad_stage_label(n), kind="all-gather",
                              axes=batch_axes, bytes=b, per_step=n,
                              what="parameters for the forward/backward pass"))
  if zero == 2:
    replicated = [inputs[k] for k in sorted(params)
                  if not split.traced.leaves[k].is_batch and not any(inputs[k].spec)]
    sharded = [g for g in grads if any(g.spec)]
    if replicated and sharded:
      b = sum(g.bytes_per_device(sizes) for g in sharded)
      out.append(CollectivePlan(stage="apply_grad", kind="all-gather",
                                axes=batch_axes, bytes=b, per_step=1,
                                what="updated parameters"))
  return out


def _memory_estimate(inputs, grads, sizes, d, n, accumulate, stacked=(),
                     apart: bool = False) -> int:
  """Bytes per device the step holds besides one micro-batch's pass: its
  inputs and the gradients held apart from the pass's own (which are
  counted with it, ``_preset_activation_peak``). Over several
  micro-batches, the sums carried between them (one whole gradient, in the
  accumulation dtype), with the reduced gradients beside them where they
  cannot take the sums' buffer (scattered over the batch axes, ZeRO, of
  another dtype, or made by their scan, ``stacked``: gradstack.py); over
  one micro-batch split over ``d`` > 1 devices, the reduced gradients;
  else none. Under ``grad_sync="apart"`` (``apart``) the sums alone: the
  reduced gradients are made after the last pass, in ``sync_grad``
  (:func:`_sync_stage_memory`)."""
  state = sum(v.bytes_per_device(sizes) for v in inputs)
  held = 0
  for i, g in enumerate(grads):
    acc = accumulation_dtype(g.dtype, accumulate)
    if n > 1:
      held += num_bytes(g.shape, acc)
      if not apart and (any(g.spec) or acc != np.dtype(g.dtype) or i in stacked):
        held += g.bytes_per_device(sizes)
    elif d > 1:
      held += g.bytes_per_device(sizes)
  return int(state + held)


def _sync_stage_memory(inputs, grads, sizes, accumulate) -> int:
  """Bytes per device while ``sync_grad`` runs (``grad_sync="apart"``):
  the state, the sums (each gradient whole, in the accumulation dtype) and
  the reduced gradients; a gradient scattered over the batch axes along
  a dimension other than its first is reduce-scattered from a copy of its
  sum laid out with that dimension first (what XLA:CPU compiles; a scanned
  layer's stacked gradient, whose first dimension is its layers, is
  scattered so)."""
  state = sum(v.bytes_per_device(sizes) for v in inputs)
  total = state
  for g in grads:
    acc = num_bytes(g.shape, accumulation_dtype(g.dtype, accumulate))
    spec = tuple(g.spec)
    relaid = any(spec[1:]) and not (spec and spec[0])
    total += acc * (2 if relaid else 1) + g.bytes_per_device(sizes)
  return int(total)


def _preset_activation_peak(split: SplitStep, local: SplitStep | None, params, grads,
                            d, zero, n, batch_axes=(), platform: str = "cpu",
                            apart: bool = False) -> int:
  """Bytes per device of the values live at the peak of one device's
  forward/backward pass (its gradients included): read from ``local``, the
  step split at one device's rows, where given; else from ``split`` with
  the values computed from the batch divided over the ``d`` devices of the
  batch axes (the pass's gradients too, which each device holds whole: an
  estimate). Under ZeRO-3 the parameters gathered whole for the pass are
  among them; with one micro-batch, a gradient scattered over the batch
  axes (``grads``' spec) leaves the pass where it is made; a stacked
  gradient a scan makes is never held whole where there is a sum to fold
  it into or a reduction to make (gradstack.py)."""
  if not split.has_marker:
    return 0
  share = d
  if local is not None:
    split, share = local, 1
  jaxpr = split.compute.jaxpr
  nconst = len(split.consts)
  leaves = jaxpr.invars[nconst:]
  rows = depends_on(jaxpr, [v for v, l in zip(leaves, split.traced.leaves) if l.is_batch])
  # ZeRO-3 gathers each parameter whole for the pass, from its first reader
  # to its last.
  gathered = [leaves[k] for k in params if not split.traced.leaves[k].is_batch] \
      if zero == 3 else []
  # In a step of one micro-batch, a gradient reduce-scattered over the
  # batch axes leaves the pass where it is made.
  released = [v for v, g in zip(jaxpr.outvars, grads) if any(g.spec) or n > 1] \
      if (n == 1 and d > 1) or (n > 1 and (zero == 3 or apart)) else []
  folded = folded_values(jaxpr, find_grad_stacks(jaxpr, split.num_grads,
                                                 [g.spec for g in grads], batch_axes)) \
      if n > 1 or d > 1 else []
  peak = max((sum(num_bytes(v.aval.shape, v.aval.dtype) / (share if v in rows else 1)
                  for v in live)
              for live in liveness_peaks(jaxpr, k=3, gathered=gathered,
                                         released=released, folded=folded,
                                         platform=platform)),
             default=0.0)
  return int(peak)
