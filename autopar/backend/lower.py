"""Lower a plan and a split step to compiled XLA executables.

The back end (``backend/``): (:class:`~autopar.frontend.split.SplitStep`,
:class:`~autopar.plan.Plan`, mesh) -> :class:`LoweredStep`, a dict of
``jax.stages.Compiled`` plus what the executor needs to call them.

Gradient stages (one per micro-batch position, see
``plan.grad_stage_names``) run the ``compute_grad`` jaxpr inside
``jax.shard_map`` over the plan's batch axes, which are *manual* there; all
other mesh axes stay under XLA's automatic partitioner. Each device thus
computes the gradient of its own slice of the micro-batch and adds it to its
own partial sum, and no gradient bytes cross devices. The partial sums are
stored with a leading stacked axis, one slot per device along the batch axes
(global shape ``[D, *grad.shape]``, spec ``P(batch_axes, ...)``), which keeps
them ordinary, honestly typed arrays that can be donated from one micro-batch
to the next and updated in place. They are reduced once, after the last
micro-batch's gradient: ``psum`` (all-reduce) for replicated gradients,
``psum_scatter`` (reduce-scatter) for sharded ones, either in that
micro-batch's stage (``*_sync``, the plan's ``grad_sync="last"``, the
default: on GPUs XLA overlaps the reduction with its backward pass) or in a
small ``sync_grad`` stage of its own (``"apart"``: ``zero_grad`` makes the
sums before the first micro-batch, so that every micro-batch runs one
``accumulate_grad`` module and one gradient module is compiled, not two).
``docs/design.md`` says why this was chosen over JAX's ``unreduced``
shardings.

Inside a gradient stage, device ``d`` along the batch axes holds rows
``[d*n*m, (d+1)*n*m)`` of the batch (``m`` = rows per device per micro-batch)
and micro-batch ``i`` is its local rows ``[i*m, (i+1)*m)``: selecting a
micro-batch moves no data. Per-example outputs are written back to the same
rows, so they come out in the original batch order.

``apply_grad`` runs the ``apply_grad`` jaxpr under plain ``jax.jit`` with the
plan's in/out shardings; the donated state is aliased to the new state.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import os
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Var
from jax.sharding import NamedSharding, PartitionSpec

from autopar import jax_compat as jc
from autopar.frontend import rng
from autopar.disk import use_compilation_cache
from autopar.frontend.evaluate import (DEBUG_CALLBACKS, Rules, check_pins, eqn_at, eval_jaxpr,
                                       eval_scan)
from autopar.backend import saved_stages
from autopar.backend.lowering_errors import explained
from autopar.backend.gradients import (COMBINE, add_partial, across, identity, loss_marker,
                                       make_entry, manual_gathers, manual_spec,
                                       micro_batch_inputs, reduce_manual, seed_loss,
                                       stacked_spec, sums_pass)
from autopar.frontend.gradstack import GradStack, find_grad_stacks, slots
from autopar.frontend.hints import hint_rule
from autopar.method import accumulation_dtype, auto_mesh
from autopar.costs.strategies import batch_spec
from autopar.plan import SYNC_STAGE, ZERO_STAGE, Plan, grad_stage_names, plan_constraints
from autopar.frontend.trace import eqns_by_path
from autopar.frontend.split import (BY_DEVICE, OutputKind, SplitStep, dce,
                                    leaves_read_by_compute)

__all__ = ["LoweredStep", "StageCompiler", "lower_step", "SUMS_STAGE", "ONE_STAGE", "grad_stage_leaves"]

# The first pass over the batch, for the sums the loss's cotangents read.
SUMS_STAGE = "loss_sums"


# One executable for the gradient and the update (one micro-batch, unless
# ``one_executable=False``): ``grad_and_apply(donated, kept, batch) ->
# (apply_outs, micro_outs)``.
ONE_STAGE = "grad_and_apply"


@dataclasses.dataclass(frozen=True)
class _StageFn:
  """A stage's function and how to jit it: each stage is jitted on its own,
  or (``_one_executable``) called inside one jitted function with the others."""
  fn: Callable
  in_shardings: Any
  out_shardings: Any
  donate_argnums: tuple[int, ...] = ()

  def jit(self):
    return jax.jit(self.fn, in_shardings=self.in_shardings,
                   out_shardings=self.out_shardings, donate_argnums=self.donate_argnums)


@dataclasses.dataclass(frozen=True)
class LoweredStep:
  """Compiled stages of one step and how to call them.

  Stage calling conventions (``leaves`` = all non-static argument leaves,
  ``donated``/``kept`` = the non-batch ones that are / are not donated):

  * ``loss_sums(leaves) -> sums`` (only where the loss's cotangents read
    sums over the whole batch, a token count: the first pass)
  * ``compute_grad(used, sums) -> acc``
  * ``accumulate_grad(used, i, acc, sums) -> acc`` (acc donated)
  * ``compute_grad_sync(used, sums) -> (grads, micro_outs)``
  * ``accumulate_grad_sync(used, i, acc, sums) -> (grads, micro_outs)``
  * ``zero_grad() -> acc``, ``sync_grad(acc) -> (grads, micro_outs)`` (acc
    donated): with ``grad_sync="apart"``, before the first and after the
    last micro-batch's ``accumulate_grad``
  * ``apply_grad(donated, kept, grads) -> apply_outs`` (donated donated)
  * ``step(donated, kept, batch) -> outs`` (a step without a grad marker)
  * ``grad_and_apply(donated, kept, batch) -> (apply_outs, micro_outs)``
    (one micro-batch, ``one_executable``: the stages above in one)

  ``used`` = the leaves at ``grad_leaves``: those the gradient computation
  reads and the batch (not the optimizer state: each argument is a cost of
  every call's dispatch).
  """
  stages: dict[str, Any]
  schedule: tuple[str, ...]
  in_shardings: tuple[NamedSharding, ...]
  micro_batch_index: tuple[Any, ...]
  donated: tuple[int, ...]
  kept: tuple[int, ...]
  batch: tuple[int, ...]
  grad_leaves: tuple[int, ...] = ()
  # The key the stages were loaded under (``saved_stages``), None where
  # they were compiled in this process.
  loaded_from: str | None = None


def _manual_axes(plan: Plan) -> tuple[str, ...]:
  """The axes a gradient stage is manual over: the plan's batch axes of size
  > 1. One of size 1 (a user may name it) splits nothing, and left manual it
  breaks XLA's partitioner where the other axes are automatic ("Cross-
  partition allreduce must be in (partial) manual partitioning mode")."""
  return tuple(a for a in plan.batch_axes if plan.axis_sizes[a] > 1)


def _grad_stage(split: SplitStep, plan: Plan, amesh, user_mesh, *, first: bool,
                sync: bool, micro_rows: int, accumulate: str | None,
                stacks: Sequence[GradStack] = (), scale=None, role: str = "grad",
                acc_avals=None):
  """A jitted gradient stage (see LoweredStep for its signature).

  ``role``: ``"grad"``, a micro-batch's gradient (``first``: the only one,
  with no partial sums to add to; ``sync``: summed over the batch axes at
  the end); ``ZERO_STAGE``, the partial sums before the first micro-batch
  (each combination's identity; ``acc_avals``: their global shapes, from
  ``_acc_avals`` of the step at the whole micro-batch); ``SYNC_STAGE``, the
  partial sums after the last micro-batch summed over the batch axes (both
  with ``grad_sync="apart"``).

  ``stacks``: the gradients that scans make stacked (``gradstack.py``),
  accumulated and reduced inside their scan; the partial sums (and the
  reduced gradients) of a stack of sliced gradients are one stacked slot.
  ``scale``: the loss's cotangents from the whole batch's sums
  (``split.scale_at``), with which each group seeds the loss (None: one
  group, whose own cotangents are the whole batch's).
  """
  manual = _manual_axes(plan)
  sizes = plan.axis_sizes
  n = plan.num_micro_batches
  devices = math.prod(sizes[a] for a in manual)
  groups = n * devices
  leaves = split.traced.leaves
  num_grads = split.num_grads
  compute = split.compute.jaxpr
  consts = split.consts
  read = leaves_read_by_compute(split)
  grad_vars = compute.outvars[:num_grads]
  acc_dtypes = [accumulation_dtype(v.aval.dtype, accumulate) for v in grad_vars]
  # Reductions over the rows that apply_grad computes outputs from
  # (combine.py): accumulated beside the gradients, each as it combines.
  reduced = split.reduced
  grad_slots = slots(num_grads, list(stacks))
  num_slots = len(grad_slots)
  whole = {s.grads[0]: s for s in stacks if s.whole}
  kinds = [k for k in split.out_kinds if k is not OutputKind.APPLY]
  row_dims = [d for k, d in zip(split.out_kinds, split.out_dims, strict=True)
              if k is not OutputKind.APPLY]
  in_specs = [v.spec for v in plan.inputs]
  used = grad_stage_leaves(split)
  grad_specs = [g.spec for g in plan.grads]
  slot_specs = [s.spec(grad_specs) if isinstance(s, GradStack) else grad_specs[s]
                for s in grad_slots]
  batch_entry = make_entry(manual)
  micro_out_specs = [plan.outputs[j].spec for j, k in enumerate(split.out_kinds)
                     if k is not OutputKind.APPLY]
  # The plan's constraints name only the automatic axes. Inside shard_map a
  # bare spec refers to its (partially manual) mesh.
  auto_axes = [a for a in plan.mesh_axis_names if a not in manual]
  constraints = plan_constraints(plan, "compute") if auto_axes else {}
  check_pins(constraints, compute, "compute")
  if manual:
    pin = lambda x, spec: lax.with_sharding_constraint(x, spec)
  else:
    pin = lambda x, spec: lax.with_sharding_constraint(x, NamedSharding(amesh, spec))
  assert split.draws is not None or groups == 1, "draws not found (split not annotated)"
  # With one device and one micro-batch every draw is already the whole batch's.
  draws = dict(split.draws or {}) if groups > 1 else {}
  for path in draws:
    eqn = eqn_at(compute, path)
    assert eqn is not None and eqn.primitive.name in rng.DRAW_PRIMITIVES, path
  callbacks = any(e.primitive.name in DEBUG_CALLBACKS for _, e in eqns_by_path(compute))
  hinted = any(h.part == "compute" for h in split.hints)

  def fold(st: GradStack, part):
    """How the scan of ``st`` folds its stacked gradient into this device's
    partial sums ``part`` (``[1, L, *shape]``, as the stage takes them;
    None in the first stage), as ``evaluate.eval_scan``'s ``folds``, and
    whether the folded value is reduced (else it is ``[1, L, *shape]``,
    ``[L, *shape]`` in the first stage)."""
    g = st.grads[0]
    dtype = acc_dtypes[g]
    layer_spec = PartitionSpec(*tuple(grad_specs[g])[st.whole:])
    if sync:
      # Each trip reduces its layer's total at once: the stage keeps only
      # the reduced shares, never every layer's unreduced gradient.
      def reduce_layer(state, k, y):
        total = y.astype(dtype)
        if part is not None:
          total = total + lax.dynamic_index_in_dim(part[0], k, 0, keepdims=False)
        red = reduce_manual(total, layer_spec, manual)
        return state, red.astype(grad_vars[g].aval.dtype)
      return (st.out, reduce_layer, None), True
    if part is None:
      return (st.out, lambda state, k, y: (state, y.astype(dtype)), None), False

    # The sums are carried at the shape the stage takes them, [1, L, ...]:
    # carrying the slice part[0] makes XLA copy them into the loop and out
    # of it (as for the sums added outside scans, ``body``).
    def add_layer(state, k, y):
      at = (0, k) + (0,) * y.ndim
      layer = lax.dynamic_slice(state, at, (1, 1, *y.shape))
      return lax.dynamic_update_slice(state, layer + y.astype(dtype)[None, None], at), None
    return (st.out, add_layer, part), False

  marker = loss_marker(compute)
  gathers = manual_gathers(compute.invars[len(consts):], leaves, read, in_specs, manual)

  def body(leaf_vals, i, acc, sums):
    # The stacks' scans, evaluated with their fold; what each folded to.
    folded = {}

    def fold_scan(scan_stacks):
      def run(eqn, args, rules):
        how = [fold(st, None if first else acc[0][slot_of[st.slot]])
               for st in scan_stacks]
        outs = eval_scan(eqn, args, rules, [h for h, _ in how])
        for st, (_, is_reduced) in zip(scan_stacks, how, strict=True):
          folded[st] = outs[st.out], is_reduced
          # Nothing else reads the stacked output (gradstack.py); its
          # slices are evaluated on zeros, which XLA drops.
          y = eqn.outvars[st.out].aval
          outs[st.out] = jnp.zeros(y.shape, y.dtype)
        return outs
      return run
    slot_of = {s: j for j, s in enumerate(grad_slots)}
    by_scan: dict[int, list] = {}
    for st in stacks:
      by_scan.setdefault(st.eqn, []).append(st)
    override = {str(e): fold_scan(sts) for e, sts in by_scan.items()}
    if scale is not None and marker is not None:
      override[str(marker)] = seed_loss(scale, groups, sums)
    args = micro_batch_inputs(leaves, leaf_vals, i, micro_rows)
    # This device holds rows [d*n*m, (d+1)*n*m) of the batch, and micro-batch
    # i is its rows [i*m, (i+1)*m) (see the module docstring).
    device = lax.axis_index(manual) if manual else 0
    first_row = (device * n + i) * micro_rows
    rules = Rules(pins=constraints, pin=pin, draws=draws,
                   rows=(first_row, groups * micro_rows),
                   once_axes=manual if callbacks else (),
                   hint=hint_rule(pin, manual) if hinted else None,
                   override=override, gathers=gathers)
    outs = eval_jaxpr(compute, consts, args, rules)
    num_acc = num_grads + len(reduced)
    grads, sums, micro = outs[:num_grads], outs[num_grads:num_acc], outs[num_acc:]
    # Per slot: this device's total over its micro-batches so far, and
    # whether its scan reduced it already.
    # A stage that carries the sums on adds at their stacked shape,
    # (1, *shape) per device: adding the slice acc[0][j][0] and stacking the
    # result again makes XLA copy every donated sum into its output
    # (measured: a sum's bytes written twice per micro-batch, and a second
    # sum's buffer at the peak). One that reduces them adds at the
    # gradient's shape (stacked, the sum was held beside the reduced one).
    # (A stage that reduces carries no sums on: acc_g is read where not sync.)
    totals, acc_g = [], []
    for j, slot in enumerate(grad_slots):
      st = slot if isinstance(slot, GradStack) else whole.get(slot)
      if st is not None and folded[st][1]:      # reduced inside its scan (sync)
        totals.append(folded[st])
        continue
      if st is not None:
        stacked = folded[st][0][None] if first else folded[st][0]
      elif sync:
        totals.append((add_partial(None if first else acc[0][j][0], grads[slot],
                                   acc_dtypes[slot]), False))
        continue
      else:
        stacked = add_partial(None if first else acc[0][j], grads[slot][None],
                              acc_dtypes[slot])
      totals.append((stacked[0], False))
      acc_g.append(stacked)
    # The loss's and metrics' sums over the batch's rows (combine.py).
    if first:
      acc_r = [r[None] for r in sums]
    else:
      acc_r = [COMBINE[op](a, r[None]) for a, r, op in
               zip(acc[0][num_slots:], sums, reduced, strict=True)]
    acc_m = []
    for j, (kind, val) in enumerate(zip(kinds, micro, strict=True)):
      if kind is OutputKind.CONCAT:
        if n == 1:
          acc_m.append(val)
          continue
        dim = row_dims[j].dim
        size = val.shape[dim]              # factor x rows of one micro-batch
        buf = (jnp.zeros((*val.shape[:dim], n * size, *val.shape[dim + 1:]), val.dtype)
               if first else acc[1][j])
        acc_m.append(lax.dynamic_update_slice_in_dim(buf, val, i * size, dim))
      elif kind in BY_DEVICE:
        op = BY_DEVICE[kind]
        acc_m.append(val[None] if first else COMBINE[op](acc[1][j], val[None]))
      else:  # OTHER: only possible with one micro-batch on one device
        acc_m.append(val)
    if not sync:
      return acc_g + acc_r, acc_m
    return synced(totals, acc_r, acc_m)

  def synced(totals, acc_reduced, acc_m):
    """The gradients and outputs from this device's partial sums (``totals``:
    per slot, its sum and whether it is reduced already), summed over the
    batch axes."""
    red_g = []
    for slot, spec, (t, is_reduced) in zip(grad_slots, slot_specs, totals, strict=True):
      g = slot.grads[0] if isinstance(slot, GradStack) else slot
      red_g.append(t if is_reduced else
                   reduce_manual(t, spec, manual).astype(grad_vars[g].aval.dtype))
    red_g += [across(a[0], op, manual, groups)
              for a, op in zip(acc_reduced, reduced, strict=True)]
    red_m = [across(a[0], BY_DEVICE[kind], manual, groups) if kind in BY_DEVICE else a
             for kind, a in zip(kinds, acc_m, strict=True)]
    return red_g, red_m

  def rows_spec(j, kind):
    """Where output j's rows (CONCAT) or its per-device stack (MEAN, ...) are."""
    if kind is OutputKind.CONCAT:
      return batch_spec(len(micro_avals[j].shape), row_dims[j].dim, batch_entry)
    if kind in BY_DEVICE:
      return PartitionSpec(batch_entry)
    return PartitionSpec()

  micro_avals = [v.aval for k, v in zip(split.out_kinds, split.traced.jaxpr.jaxpr.outvars)
                 if k is not OutputKind.APPLY]
  leaf_specs_manual = [PartitionSpec(batch_entry) if l.is_batch else
                       manual_spec(s, manual) for l, s in zip(leaves, in_specs)]
  acc_specs = ([PartitionSpec(batch_entry)] * (num_slots + len(reduced)),
               [rows_spec(j, k) for j, k in enumerate(kinds)])
  if sync:
    out_specs = ([manual_spec(s, manual) for s in slot_specs] +
                 [PartitionSpec()] * len(reduced),
                 [rows_spec(j, k) if k is OutputKind.CONCAT else PartitionSpec()
                  for j, k in enumerate(kinds)])
  else:
    out_specs = acc_specs

  def manual_over_batch_axes(f, in_specs):
    # No batch axes: nothing is manual (an empty `axis_names` would mean all).
    if not manual:
      return f
    return jax.shard_map(f, mesh=amesh, in_specs=in_specs, out_specs=out_specs,
                         axis_names=set(manual), check_vma=False)

  # The whole batch's sums the loss's cotangents read (the first pass's).
  num_sums = split.loss.num_sums if scale is not None else 0
  sums_specs = [PartitionSpec()] * num_sums
  used_specs_manual = [leaf_specs_manual[k] for k in used]

  def every_leaf(used_vals):
    """The stage's inputs in the places of all the leaves (None where the
    gradient computation reads none)."""
    out = [None] * len(leaves)
    for k, x in zip(used, used_vals, strict=True):
      out[k] = x
    return out

  if first:
    def fn(used_vals, sums):
      return manual_over_batch_axes(lambda uv, sm: body(every_leaf(uv), 0, None, sm),
                                    (used_specs_manual, sums_specs))(used_vals, sums)
  else:
    def fn(used_vals, i, acc, sums):
      return manual_over_batch_axes(
          lambda uv, j, a, sm: body(every_leaf(uv), j, a, sm),
          (used_specs_manual, PartitionSpec(), acc_specs, sums_specs))(
              used_vals, i, acc, sums)

  ns = lambda s, m=amesh: NamedSharding(m, s)
  leaf_shardings = [ns(in_specs[k]) for k in used]
  acc_shardings = ([ns(stacked_spec(s, manual)) for s in slot_specs] +
                   [ns(PartitionSpec(batch_entry))] * len(reduced),
                   [ns(rows_spec(j, k)) for j, k in enumerate(kinds)])
  if sync:
    out_shardings = ([ns(s) for s in slot_specs] + [ns(PartitionSpec())] * len(reduced),
                     [ns(s, user_mesh) for s in micro_out_specs])
  else:
    out_shardings = acc_shardings
  sums_shardings = [ns(PartitionSpec())] * num_sums
  if role == ZERO_STAGE:
    ops = ["sum"] * num_slots + list(reduced) + [BY_DEVICE.get(k, "sum") for k in kinds]
    avals = [*acc_avals[0], *acc_avals[1]]

    def zero():
      flat = [jnp.full(a.shape, identity(op, a.dtype), a.dtype)
              for a, op in zip(avals, ops, strict=True)]
      return flat[:len(acc_avals[0])], flat[len(acc_avals[0]):]
    return _StageFn(zero, (), acc_shardings)
  if role == SYNC_STAGE:
    def fn(acc):
      return manual_over_batch_axes(
          lambda a: synced([(t[0], False) for t in a[0][:num_slots]], a[0][num_slots:],
                           a[1]),
          (acc_specs,))(acc)
    # The sums are not donated: a reduced gradient the size of this device's
    # sum would be aliased to it, and XLA:CPU's all-reduce, which does not
    # write in place, would then copy every gradient into the sum's buffer
    # (measured: a gradient's bytes read and written once more). The caller
    # drops the sums once the stage is dispatched.
    return _StageFn(fn, (acc_shardings,), out_shardings)
  if first:
    return _StageFn(fn, (leaf_shardings, sums_shardings), out_shardings)
  return _StageFn(fn, (leaf_shardings, ns(PartitionSpec()), acc_shardings, sums_shardings),
                  out_shardings, donate_argnums=(2,))


def grad_stage_leaves(split: SplitStep) -> tuple[int, ...]:
  """The leaves a gradient stage takes: those its computation reads, and
  the batch's."""
  read = leaves_read_by_compute(split)
  return tuple(k for k, l in enumerate(split.traced.leaves) if k in read or l.is_batch)


def _sums_stage(split: SplitStep, plan: Plan, amesh, *, micro_rows: int):
  """The jitted first pass, ``loss_sums(leaves) -> sums``: the whole batch's
  sums that the loss's cotangents read (a token count), replicated.

  Each device evaluates the program that makes them on its rows of every
  micro-batch (with the gradient stages' random draws, without their
  effects), and they are combined over micro-batches and devices.
  """
  manual = _manual_axes(plan)
  sizes = plan.axis_sizes
  n = plan.num_micro_batches
  groups = n * math.prod(sizes[a] for a in manual)
  leaves = split.traced.leaves
  compute = split.compute.jaxpr
  eqn = compute.eqns[loss_marker(compute)]
  k = len(eqn.outvars)
  ops = split.loss.sum_ops
  quiet = compute.replace(
      eqns=[e for e in compute.eqns if not (e.effects and jc.has_effects(e))],
      outvars=list(eqn.invars[k:k + len(ops)]))
  program = dce(quiet)
  # The gradient stages' rules, their paths found again by equation (dce
  # keeps the equations): random draws, the plan's pins, the user's hints.
  at = {id(e): str(i) for i, e in enumerate(program.eqns)}

  def moved(table):
    out = {}
    for path, value in table.items():
      top, _, rest = path.partition(".")
      new = at.get(id(compute.eqns[int(top)]))
      if new is not None:
        out[new + ("." + rest if rest else "")] = value
    return out
  draws = moved(split.draws or {})
  auto_axes = [a for a in plan.mesh_axis_names if a not in manual]
  pins = moved(plan_constraints(plan, "compute")) if auto_axes else {}
  if manual:
    pin = lambda x, spec: lax.with_sharding_constraint(x, spec)
  else:
    pin = lambda x, spec: lax.with_sharding_constraint(x, NamedSharding(amesh, spec))
  hinted = any(h.part == "compute" for h in split.hints)
  nc = len(split.consts)
  used = {v for e in program.eqns for v in e.invars if isinstance(v, Var)}
  read = [k for k, v in enumerate(program.invars[nc:]) if v in used]
  in_specs = [v.spec for v in plan.inputs]
  batch_entry = make_entry(manual)
  gathers = manual_gathers(program.invars[nc:], leaves, read, in_specs, manual)

  def body(leaf_vals):
    device = lax.axis_index(manual) if manual else 0

    def evaluate(i):
      args = micro_batch_inputs(leaves, leaf_vals, i, micro_rows)
      rules = Rules(draws=draws, rows=((device * n + i) * micro_rows, groups * micro_rows),
                    pins=pins, pin=pin, gathers=gathers,
                    hint=hint_rule(pin, manual) if hinted else None)
      return eval_jaxpr(program, split.consts, args, rules)
    return sums_pass(evaluate, n, ops, manual, groups)

  specs = [PartitionSpec(batch_entry) if l.is_batch else manual_spec(s, manual)
           for l, s in zip(leaves, in_specs)]
  fn = body if not manual else jax.shard_map(
      body, mesh=amesh, in_specs=(specs,), out_specs=[PartitionSpec()] * len(ops),
      axis_names=set(manual), check_vma=False)
  ns = lambda s: NamedSharding(amesh, s)
  return _StageFn(fn, ([ns(s) for s in in_specs],), [ns(PartitionSpec())] * len(ops))


def _apply_stage(split: SplitStep, plan: Plan, amesh, user_mesh,
                 donated: Sequence[int], kept: Sequence[int],
                 stacks: Sequence[GradStack] = ()):
  """The jitted ``apply_grad``; its gradients come as the gradient stages'
  slots (``gradstack.slots``): a stack of sliced gradients is sliced here."""
  leaves = split.traced.leaves
  grad_slots = slots(split.num_grads, list(stacks))
  jaxpr = split.apply.jaxpr
  consts = split.consts
  apply_specs = [plan.outputs[j].spec for j, k in enumerate(split.out_kinds)
                 if k is OutputKind.APPLY]
  constraints = plan_constraints(plan, "apply")
  check_pins(constraints, jaxpr, "apply")
  if plan.batch_axes:
    # The plan fixes only the planned axes here; dims it leaves unsplit stay
    # free for XLA to keep state split over the batch axes (ZeRO/FSDP).
    constraints = {i: {j: _unconstrained_where_unsplit(sp) for j, sp in outs.items()}
                   for i, outs in constraints.items()}
  pin = lambda x, spec: lax.with_sharding_constraint(x, NamedSharding(amesh, spec))
  rules = Rules(pins=constraints, pin=pin,
                 hint=pin if any(h.part == "apply" for h in split.hints) else None)

  def fn(donated_vals, kept_vals, grads):
    # (batch leaves are never read here)
    vals = _leaf_values(len(leaves), (donated, donated_vals), (kept, kept_vals))
    each: list[Any] = [None] * split.num_grads
    for slot, x in zip(grad_slots, grads, strict=False):
      if isinstance(slot, GradStack):
        for k, g in enumerate(slot.grads):
          each[g] = x[k]
      else:
        each[slot] = x
    rest = grads[len(grad_slots):]
    return eval_jaxpr(jaxpr, consts, [*vals, *each, *rest], rules)

  ns = lambda s, m=amesh: NamedSharding(m, s)
  in_shardings = ([ns(plan.inputs[k].spec) for k in donated],
                  [ns(plan.inputs[k].spec) for k in kept],
                  [ns(s.spec([g.spec for g in plan.grads]) if isinstance(s, GradStack)
                      else plan.grads[s].spec) for s in grad_slots] +
                  [ns(PartitionSpec())] * len(split.reduced))
  out_shardings = [ns(s, user_mesh) for s in apply_specs]
  return _StageFn(fn, in_shardings, out_shardings, (0,) if donated else ())


def _one_executable(sums: _StageFn | None, grad: _StageFn, apply: _StageFn,
                    used: Sequence[int], donated: Sequence[int], kept: Sequence[int],
                    batch: Sequence[int], num_leaves: int, in_shardings) -> _StageFn:
  """``grad_and_apply``: the sums pass (if any), the one micro-batch's
  gradient stage and the update in one function. The values between them
  keep the shardings the separate stages give them (the plan's), so the
  numbers are the separate stages'; XLA may overlap and fuse across them,
  and no gradient is written out between two executables."""
  wsc = jax.lax.with_sharding_constraint

  def fn(donated_vals, kept_vals, batch_vals):
    vals = _leaf_values(num_leaves, (donated, donated_vals), (kept, kept_vals),
                        (batch, batch_vals))
    partial = wsc(sums.fn(vals), sums.out_shardings) if sums is not None else []
    grads, micro_outs = grad.fn([vals[k] for k in used], partial)
    grads = wsc(grads, apply.in_shardings[2])     # (as the update takes them)
    apply_outs = apply.fn([vals[k] for k in donated], [vals[k] for k in kept], grads)
    return apply_outs, micro_outs

  shardings = tuple([in_shardings[k] for k in idx] for idx in (donated, kept, batch))
  return _StageFn(fn, shardings, (apply.out_shardings, grad.out_shardings[1]),
                  (0,) if donated else ())


def _leaf_values(num_leaves: int, *groups) -> list[Any]:
  """The values in the places of all the step's leaves, from groups of
  (leaf positions, values) (None where no group gives one)."""
  vals: list[Any] = [None] * num_leaves
  for idx, values in groups:
    for k, x in zip(idx, values, strict=True):
      vals[k] = x
  return vals


def _unconstrained_where_unsplit(spec: PartitionSpec) -> PartitionSpec:
  return PartitionSpec(*(PartitionSpec.UNCONSTRAINED if e is None else e
                         for e in spec))


def _whole_step(split: SplitStep, plan: Plan, amesh, user_mesh,
                donated: Sequence[int], kept: Sequence[int], batch: Sequence[int]):
  leaves = split.traced.leaves
  jaxpr = split.apply.jaxpr
  consts = split.consts

  # Only the user's hints apply: the whole step runs under XLA's partitioner.
  pin = lambda x, spec: lax.with_sharding_constraint(x, NamedSharding(amesh, spec))
  rules = Rules(hint=pin if split.hints else None)

  def fn(donated_vals, kept_vals, batch_vals):
    vals = _leaf_values(len(leaves), (donated, donated_vals), (kept, kept_vals),
                        (batch, batch_vals))
    return eval_jaxpr(jaxpr, consts, vals, rules)

  ns = lambda s, m=amesh: NamedSharding(m, s)
  in_shardings = tuple([ns(plan.inputs[k].spec) for k in idx]
                       for idx in (donated, kept, batch))
  out_shardings = [ns(v.spec, user_mesh) for v in plan.outputs]
  return jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings,
                 donate_argnums=(0,) if donated else ())


# -- compile ------------------------------------------------------------------

def _abstract(shape, dtype, weak=False):
  return jax.ShapeDtypeStruct(tuple(shape), dtype, weak_type=weak)


# XLA options that let collectives run asynchronously and overlap compute on
# GPUs: the latency-hiding scheduler issues each collective's start as early
# as its operands allow (a gradient's reduce-scatter while the backward pass
# of the layers below is still running) and its done as late as possible;
# the pipelining options move the collectives of a loop (scanned layers)
# across iterations. Used for GPU compiles only, and only the options the
# user has not set in XLA_FLAGS. XLA renames and retires these between
# releases; options the installed XLA does not know are left out (see
# _known_option).
GPU_OVERLAP_OPTIONS = {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_gpu_enable_pipelined_all_gather": True,
    "xla_gpu_enable_pipelined_reduce_scatter": True,
    "xla_gpu_enable_pipelined_all_reduce": True,
    "xla_gpu_enable_while_loop_double_buffering": True,
    "xla_gpu_enable_highest_priority_async_stream": True,
}
# (platform, option) -> whether this XLA takes it (process-wide: asked once).
_KNOWN: dict[tuple[str, str], bool] = {}


def compiler_options(mesh, xla_flags: str | None = None,
                     known: Callable[[str, Any], bool] | None = None) -> dict[str, Any]:
  """Per-executable XLA options for stages compiled on ``mesh``'s devices.

  Empty on CPUs (autopar never changes their flags); on GPUs the overlap
  options above that the installed XLA knows, minus any the user set in
  ``XLA_FLAGS`` (``xla_flags`` and ``known`` stand in for the variable and
  the check in tests).
  """
  devices = list(np.asarray(mesh.devices).flat)
  if not {d.platform for d in devices} & {"gpu", "cuda", "rocm"}:
    return {}
  user = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
  known = known or (lambda k, v: _known_option(k, v, devices[0]))
  return {k: v for k, v in GPU_OVERLAP_OPTIONS.items()
          if f"--{k}" not in user and known(k, v)}


def _known_option(name: str, value: Any, device) -> bool:
  """Whether this XLA accepts compiler option ``name`` (a tiny compile, cached)."""
  key = (device.platform, name)
  if key not in _KNOWN:
    try:
      x = jax.ShapeDtypeStruct((), np.float32,
                               sharding=jax.sharding.SingleDeviceSharding(device))
      jax.jit(lambda x: x + 1).lower(x).compile({name: value})
      _KNOWN[key] = True
    except Exception:  # noqa: BLE001 - "No such compile option", or a bad value
      _KNOWN[key] = False
  return _KNOWN[key]


class StageCompiler:
  """Compiles each stage as it is lowered (``compiler[name] = lowered``),
  on threads: XLA compiles, and reads a module from JAX's persistent cache,
  without holding the GIL, so one stage compiles while the next is traced
  and lowered. Each is looked up in JAX's persistent compilation cache
  first (:func:`autopar.disk.use_compilation_cache`), and kept there
  however quickly it compiled where that cache is autopar's. Used as a
  context manager: ``results()`` inside it waits for every compile;
  ``compiled_here()`` says whether each was compiled, not read from JAX's
  cache."""

  def __init__(self, options=None):
    self.options = options
    self.keep_all = use_compilation_cache()
    self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1)
    self._futures: dict[str, concurrent.futures.Future] = {}

  def _compile(self, lowered):
    hits = jc.persistent_cache_hits()
    if not self.keep_all:
      compiled = lowered.compile(self.options)
    else:
      with jc.persistent_cache_keeps_all():
        compiled = lowered.compile(self.options)
    return compiled, jc.persistent_cache_hits() == hits

  def __setitem__(self, name: str, lowered) -> None:
    self._futures[name] = self._pool.submit(self._compile, lowered)

  def results(self) -> dict:
    """name -> compiled stage, in the order the stages were lowered."""
    return {k: f.result()[0] for k, f in self._futures.items()}

  def compiled_here(self) -> bool:
    """Whether every stage was compiled in this process (none read from
    JAX's persistent cache)."""
    return all(f.result()[1] for f in self._futures.values())

  def __enter__(self) -> "StageCompiler":
    return self

  def __exit__(self, *exc) -> None:
    # On an error, the compiles not started are dropped and those running
    # waited for (they would hold the cores after the error), except on an
    # interrupt.
    interrupted = exc[0] is not None and not issubclass(exc[0], Exception)
    self._pool.shutdown(wait=not interrupted, cancel_futures=exc[0] is not None)


def lower_step(split: SplitStep, split_local: SplitStep, plan: Plan, mesh, *,
               accumulate: str | None = "float32", scale=None,
               one_executable: bool = False, keep: str | None = None,
               hint: str | None = None,
               prefetched: saved_stages.Prefetched | None = None) -> LoweredStep:
  """Compiles every stage of ``split`` under ``plan`` on the concrete ``mesh``.

  ``split`` is the step traced at the global micro-batch size; ``split_local``
  the same step traced at the rows one device holds of a micro-batch (they
  are the same object when the batch axes hold one device). ``accumulate``:
  the method's ``grad_accumulation_dtype``. ``scale``: the loss's
  cotangents from the sums at the whole batch's size (``split.scale_at``),
  given when the batch is split (over micro-batches or devices).
  ``one_executable``: with one micro-batch, the stages as one executable
  (``grad_and_apply``). ``keep``: the key (``saved_stages.stage_key``) the
  compiled stages are loaded from (from ``prefetched`` where it loads
  them), or kept under once compiled, with ``hint`` naming it.
  """
  amesh = auto_mesh(mesh)
  # Results are handed back on the user's own mesh (its axis types), except
  # where the step holds a primitive that lowers with the devices in hand:
  # JAX then wants every sharding of a program on one mesh, so they come
  # back on the same devices and specs with axes of type Auto.
  out_mesh = amesh if jc.needs_devices_to_lower(split.traced.jaxpr.jaxpr) else mesh
  leaves = split.traced.leaves
  donated = tuple(k for k, l in enumerate(leaves) if l.is_donated)
  kept = tuple(k for k, l in enumerate(leaves) if not l.is_donated and not l.is_batch)
  batch = tuple(k for k, l in enumerate(leaves) if l.is_batch)
  in_shardings = tuple(NamedSharding(amesh, v.spec) for v in plan.inputs)
  n = plan.num_micro_batches
  loaded = saved_stages.load(keep, mesh, prefetched, hint) if keep else None
  if loaded is not None:
    compiled, schedule = loaded
  else:
    compiled, schedule, here = _compile_stages(
        split, split_local, plan, mesh, amesh, out_mesh, donated, kept, batch,
        in_shardings, accumulate=accumulate, scale=scale, one_executable=one_executable)
    # (Stages read from JAX's cache are not kept: serialize_compiled.)
    if keep and here:
      saved_stages.store(keep, compiled, schedule, hint)
  index = ()
  if split.has_marker:
    replicated = NamedSharding(amesh, PartitionSpec())
    index = tuple(jax.device_put(np.int32(i), replicated) for i in range(n))
  return LoweredStep(stages=compiled, schedule=schedule, in_shardings=in_shardings,
                     micro_batch_index=index, donated=donated, kept=kept, batch=batch,
                     grad_leaves=grad_stage_leaves(split_local) if split.has_marker else (),
                     loaded_from=keep if loaded is not None else None)


def _compile_stages(split: SplitStep, split_local: SplitStep, plan: Plan, mesh, amesh,
                    out_mesh, donated, kept, batch, in_shardings, *, accumulate, scale,
                    one_executable) -> tuple[dict[str, Any], tuple[str, ...], bool]:
  """``lower_step``'s stages traced, lowered and compiled: (name -> compiled
  stage, schedule, whether every stage was compiled in this process)."""
  leaves = split.traced.leaves
  leaf_avals = [l.abstract() for l in leaves]
  of = lambda idx: [leaf_avals[k] for k in idx]   # noqa: E731
  n = plan.num_micro_batches
  options = compiler_options(mesh) or None

  # (An op that JAX cannot lower where the stages put it is said with its
  # fix: lowering_errors.py.) Each stage compiles as soon as it is lowered.
  with explained(split.traced.jaxpr.jaxpr, where="the step's stages",
                 batch_axes=plan.batch_axes, mesh_axes=mesh.axis_names), \
       warnings.catch_warnings(), StageCompiler(options) as stages:
    # The last gradient stage donates its partial sums although the reduced
    # gradients have another shape: the buffers are freed, not reused.
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    if not split.has_marker:
      fn = _whole_step(split, plan, amesh, out_mesh, donated, kept, batch)
      stages["step"] = fn.lower(of(donated), of(kept), of(batch))
      schedule = ("step",)
    else:
      rows = split_local.traced.micro_batch_size
      names = grad_stage_names(n, plan.grad_sync)
      stacks = find_grad_stacks(split_local.compute.jaxpr, split.num_grads,
                                [g.spec for g in plan.grads], _manual_axes(plan))
      acc_avals = _acc_avals(split, plan, accumulate, stacks)
      sums_avals, sums = [], None
      if scale is not None and split_local.loss is not None and split_local.loss.num_sums:
        compute = split_local.compute.jaxpr
        marker = compute.eqns[loss_marker(compute)]
        k = len(marker.outvars)
        sums_avals = [_abstract(v.aval.shape, v.aval.dtype)
                      for v in marker.invars[k:k + split_local.loss.num_sums]]
        sums = _sums_stage(split_local, plan, amesh, micro_rows=rows)
      used = grad_stage_leaves(split_local)
      stage = functools.partial(_grad_stage, split_local, plan, amesh, out_mesh,
                                micro_rows=rows, accumulate=accumulate, stacks=stacks,
                                scale=scale)
      grad_fns = {name: stage(first=name.startswith("compute_grad"),
                              sync=name.endswith("_sync"))
                  for name in dict.fromkeys(names)}
      apply = _apply_stage(split, plan, amesh, out_mesh, donated, kept, stacks)
      if one_executable and n == 1:
        (grad,) = grad_fns.values()
        fn = _one_executable(sums, grad, apply, used, donated, kept, batch, len(leaves),
                             in_shardings).jit()
        stages[ONE_STAGE] = fn.lower(of(donated), of(kept), of(batch))
        schedule = (ONE_STAGE,)
      else:
        schedule = ()
        if sums is not None:
          stages[SUMS_STAGE] = sums.jit().lower(leaf_avals)
          schedule += (SUMS_STAGE,)
        apart = n > 1 and plan.grad_sync == "apart"
        if apart:
          stages[ZERO_STAGE] = stage(first=False, sync=False, role=ZERO_STAGE,
                                     acc_avals=acc_avals).jit().lower()
          schedule += (ZERO_STAGE,)
        for name, grad in grad_fns.items():
          if name.startswith("compute_grad"):
            stages[name] = grad.jit().lower(of(used), sums_avals)
          else:
            stages[name] = grad.jit().lower(of(used), _abstract((), np.int32), acc_avals,
                                            sums_avals)
        schedule += tuple(names)
        if apart:
          stages[SYNC_STAGE] = stage(first=False, sync=True, role=SYNC_STAGE).jit().lower(
              acc_avals)
          schedule += (SYNC_STAGE,)
        grad_avals = [_abstract(a.shape, a.dtype)
                      for a in (*_slot_avals(split, stacks), *split.reduced_avals)]
        stages["apply_grad"] = apply.jit().lower(of(donated), of(kept), grad_avals)
        schedule += ("apply_grad",)
    return stages.results(), schedule, stages.compiled_here()


def _slot_avals(split: SplitStep, stacks: Sequence[GradStack]) -> list:
  """The shape and dtype of each gradient slot (``gradstack.slots``)."""
  avals = split.grad_avals
  return [jax.ShapeDtypeStruct((len(s.grads), *avals[s.grads[0]].shape),
                               avals[s.grads[0]].dtype)
          if isinstance(s, GradStack) else avals[s]
          for s in slots(split.num_grads, list(stacks))]


def _acc_avals(split: SplitStep, plan: Plan, accumulate: str | None,
               stacks: Sequence[GradStack] = ()):
  sizes = plan.axis_sizes
  d = math.prod(sizes[a] for a in plan.batch_axes)
  grads = [_abstract((d, *a.shape), accumulation_dtype(a.dtype, accumulate))
           for a in _slot_avals(split, stacks)]
  grads += [_abstract((d, *a.shape), a.dtype) for a in split.reduced_avals]
  micro = []
  outvars = split.traced.jaxpr.jaxpr.outvars
  batch_size = split.traced.micro_batch_size * plan.num_micro_batches
  for kind, v, rows in zip(split.out_kinds, outvars, split.out_dims, strict=True):
    shape = tuple(v.aval.shape)
    if kind is OutputKind.APPLY:
      continue
    if kind is OutputKind.CONCAT:
      shape = (*shape[:rows.dim], rows.factor * batch_size, *shape[rows.dim + 1:])
      micro.append(_abstract(shape, v.aval.dtype))
    elif kind in BY_DEVICE:
      micro.append(_abstract((d, *shape), v.aval.dtype))
    else:
      micro.append(_abstract(shape, v.aval.dtype))
  return grads, micro
