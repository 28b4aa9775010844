"""A stage's jitted functions on its submesh.

Per stage, on its own submesh, with its batch axes ``B`` manual (a
partial-manual ``jax.shard_map``, as ``lower.py`` does for one mesh) and
the other axes under XLA's partitioner pinned to the stage's plan:

* ``forward(i, roots, acts_in, leaves) -> (outputs, stored residuals)`` for
  micro-batch ``i`` (``first``: the outputs alone, for a first pass that
  computes what the loss's cotangents read). Batch leaves come whole, as ``[n, M, ...]`` with the
  rows of a micro-batch split over ``B``; the stage takes micro-batch ``i``.
  A device holds rows ``[i*M + d*m, i*M + (d+1)*m)`` of the whole batch
  (``d``: its index over ``B``, ``m = M / |B|``), which is where its random
  draws start.
* ``backward(i, acc, roots, acts_in, leaves, outputs, stored, cotangents,
  seeds) -> (acc, cotangents of the tangent acts_in)``: adds this device's
  gradient of the stage's roots to ``acc`` (``[|B|, ...]``, one partial sum
  per device, updated in place); no gradient crosses devices. ``seeds``:
  the cotangents of the loss's entries the stage makes, the whole batch's
  (``loss.py``; the runtime gives them per step).
* ``backward_input(i, roots, acts_in, leaves, outputs, stored, cotangents,
  seeds) -> (cotangents of the tangent acts_in, carried)`` and
  ``backward_weight(i, acc, roots, acts_in, leaves, outputs, stored,
  cotangents, seeds, carried) -> acc``: the backward split in two, for
  zero-bubble schedules (``stages.split_input_weight``): the first makes
  what the stage before waits for, the second adds the gradient, reading
  what the first computed on the way (``carried``, stacked ``[|B|, ...]``)
  instead of computing it again. Made only where the schedule splits it.
* ``sync(acc) -> grads``: sums the partial sums over ``B``: the only
  gradient communication of a step, after the last micro-batch. As the
  groups' seeds are the whole batch's, the sum is the whole batch's
  gradient (``gradients.py``).

Values that are not split by rows (a device's reductions over its rows, its
partial sums, its residuals) leave the manual region stacked on a leading
``[|B|]`` axis.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autopar.frontend.evaluate import DEBUG_CALLBACKS, Rules, eval_jaxpr
from autopar.frontend.retype import primitive_names
from autopar.frontend.hints import hint_rule
from autopar.backend.gradients import (add_partial, entry_axes, gather_manual, make_entry,
                                       manual_spec, reduce_manual, stacked_spec)
from autopar.method import accumulation_dtype
from autopar.frontend.stages import StageFunctions, StageProgram, split_input_weight
from autopar.costs.strategies import batch_spec

__all__ = ["StageLayout", "StageExecutables", "build_stage"]


@dataclasses.dataclass(frozen=True)
class StageLayout:
  """Where a stage runs and how its values are laid out.

  Attributes:
    mesh: the stage's submesh (Auto axes).
    batch_axes: the axes its micro-batches' rows are split over.
    micro: rows of one micro-batch (all devices); n: micro-batches.
    root_specs, leaf_specs: per root / argument leaf the stage reads (in
      ``StageProgram`` order), its spec on the submesh (batch leaves: unused).
    grad_specs: per root, the spec of its gradient (default: the root's).
    batch_leaf: per argument leaf the stage reads, whether it is batch data.
    final_rows: per final of the stage, its row dimension if it is
      concatenated over micro-batches (per-example outputs), else None.
    pins: ``(forward, backward)`` equation path -> {output: spec} from the
      stage's plan, over the planned (non-batch) axes.
    accumulate: the gradient accumulation dtype setting.
  """
  mesh: Mesh
  batch_axes: tuple[str, ...]
  micro: int
  n: int
  root_specs: tuple
  leaf_specs: tuple
  batch_leaf: tuple[bool, ...]
  final_rows: tuple
  grad_specs: tuple = ()
  pins: tuple = ({}, {})
  accumulate: str | None = "float32"

  @property
  def devices(self) -> int:
    sizes = dict(zip(self.mesh.axis_names, self.mesh.devices.shape))
    return math.prod(sizes[a] for a in self.batch_axes)

  @property
  def rows(self) -> int:
    return self.micro // self.devices

  def sharding(self, spec: PartitionSpec) -> NamedSharding:
    return NamedSharding(self.mesh, spec)

  @property
  def entry(self):
    return make_entry(self.batch_axes)

  def rows_spec(self, rank: int, dim: int) -> PartitionSpec:
    return batch_spec(rank, dim, self.entry)

  def batch_leaf_spec(self) -> PartitionSpec:
    """Of a batch leaf laid out as ``[n, M, ...]``."""
    return PartitionSpec(None, self.entry)


@dataclasses.dataclass
class StageExecutables:
  """A stage's jitted functions (see the module docstring), and the layout
  of what they take and give."""
  layout: StageLayout
  forward: Any
  first: Any                       # forward's outputs alone (the first pass)
  backward: Any
  backward_input: Any              # (None where the schedule does not split it)
  backward_weight: Any
  sync: Any
  init: Any
  out_specs: tuple                 # per forward output
  out_rows: tuple                  # per forward output: its row dim, or None (stacked)
  act_in_specs: tuple
  ct_out_specs: tuple              # per tangent act_in
  grad_specs: tuple
  act_out_specs: tuple             # per acts_out (their cotangents come back so)
  fns_out_order: tuple             # G output of each forward output
  ct_from_next: tuple              # acts_out whose cotangents the backward takes
  num_stored: int
  index: tuple                     # per micro-batch, its index on the submesh

  def compiled(self, name: str, *avals):
    return getattr(self, name).lower(*avals).compile()


def _stack(x):
  return x[None]


def build_stage(st: StageProgram, fns: StageFunctions, layout: StageLayout, *,
                step_consts: Sequence[Any], fn_consts: Sequence[Any],
                split_backward: bool = False) -> StageExecutables:
  """The stage's jitted functions. ``step_consts``/``fn_consts``: the values
  of the consts the stage reads (``StageProgram.step_consts``/``fn_consts``);
  ``split_backward``: also the backward in two (``backward_input``,
  ``backward_weight``)."""
  L = layout
  manual = tuple(L.batch_axes)
  D, m, M = L.devices, L.rows, L.micro
  nr = len(st.roots)
  fj, bj = fns.forward, fns.backward
  n_out = fns.num_outputs
  n_acts = len(st.acts_out)
  consts = [*step_consts, *fn_consts]
  fwd_pins, bwd_pins = L.pins
  pin = lambda x, spec: lax.with_sharding_constraint(
      x, spec if manual else NamedSharding(L.mesh, spec))
  # The user's hints, on the stage's submesh (its batch axes are where the
  # rows are: hints.in_stage); the stage's ILP pinned them (constraints.py).
  hint = hint_rule(pin, manual) if st.hints else None
  # jax.debug.print runs on the first device of the batch axes: once per
  # micro-batch, as on one device.
  once = manual if primitive_names(fj.jaxpr) & set(DEBUG_CALLBACKS) else ()

  # Layout of the forward's outputs: rows split over B, or stacked [D, ...].
  out_rows = []
  for k in fns.out_order:
    if k < n_acts:
      out_rows.append(st.row_out[k])
    else:
      out_rows.append(L.final_rows[k - n_acts])
  out_avals = [v.aval for v in fj.jaxpr.outvars]
  out_specs = [L.rows_spec(len(a.shape), r) if r is not None else
               PartitionSpec(L.entry) for a, r in zip(out_avals[:n_out], out_rows)]
  stored_specs = [PartitionSpec(L.entry)] * (len(out_avals) - n_out)
  act_in_specs = [L.rows_spec(len(v.aval.shape), r) for v, r in
                  zip(st.acts_in, st.row_in, strict=True)]
  tangent_in = [k for k, t in enumerate(st.tangent_in) if t]
  ct_out_specs = [act_in_specs[k] for k in tangent_in]
  root_in = [manual_spec(s, manual) for s in L.root_specs]
  leaf_in = [PartitionSpec(None, L.entry) if b else manual_spec(s, manual)
             for b, s in zip(L.batch_leaf, L.leaf_specs, strict=True)]
  grad_specs = list(L.grad_specs or L.root_specs)
  grad_avals = [bj.jaxpr.outvars[k].aval for k in range(nr)]
  acc_dtypes = [accumulation_dtype(a.dtype, L.accumulate) for a in grad_avals]

  def first_row(i):
    d = lax.axis_index(manual) if manual else 0
    return (i * M + d * m).astype(np.int32)

  def local_inputs(i, roots, acts, leaves):
    leaves = [lax.dynamic_index_in_dim(x, i, 0, keepdims=False) if b else x
              for b, x in zip(L.batch_leaf, leaves, strict=True)]
    return [first_row(i), *roots, *acts, *leaves, *consts]

  def manual_region(f, in_specs, out_specs_):
    if not manual:
      return f
    return jax.shard_map(f, mesh=L.mesh, in_specs=in_specs, out_specs=out_specs_,
                         axis_names=set(manual), check_vma=False)

  # Parameters split over the batch axes (ZeRO-3) come as a device's
  # shard; each equation that reads one gathers it (``evaluate._gathered``),
  # in the forward pass and again in the backward pass.
  input_specs = [PartitionSpec(), *L.root_specs,
                 *[PartitionSpec()] * len(st.acts_in),
                 *[PartitionSpec() if b else s_ for b, s_ in zip(L.batch_leaf, L.leaf_specs,
                                                                 strict=True)]]
  split_inputs = {k: s_ for k, s_ in enumerate(input_specs)
                  if any(a in manual for e in s_ for a in entry_axes(e))}

  def gathers_of(invars: dict) -> dict:
    """Rules.gathers for the pass whose invar ``v`` is input ``invars[v]``."""
    return {v: functools.partial(gather_manual, spec=split_inputs[k], manual=manual)
            for v, k in invars.items() if k in split_inputs}
  fwd_gathers = gathers_of({v: k for k, v in enumerate(fj.jaxpr.invars)})
  bwd_gathers = gathers_of({v: k for (kind, k), v in zip(fns.residuals.sources,
                                                         bj.jaxpr.invars)
                            if kind == "input"})

  def fwd_body(i, roots, acts, leaves, quiet=False):
    ins = local_inputs(i, roots, acts, leaves)
    outs = eval_jaxpr(fj.jaxpr, (), ins, Rules(pins=fwd_pins, pin=pin, hint=hint,
                                                once_axes=once, quiet=quiet,
                                                gathers=fwd_gathers),
                       constvals=fj.consts)
    main = [x if r is not None else _stack(x) for x, r in zip(outs[:n_out], out_rows)]
    return main, [_stack(x) for x in outs[n_out:]]

  def forward(i, roots, acts, leaves):
    return manual_region(fwd_body, (PartitionSpec(), root_in, act_in_specs, leaf_in),
                         (out_specs, stored_specs))(i, roots, acts, leaves)

  # The first pass's forward: the outputs alone (XLA drops what only the
  # residuals need), its debug prints silent (the schedule's forward prints).
  def first(i, roots, acts, leaves):
    return manual_region(lambda *a: fwd_body(*a, quiet=True)[0],
                         (PartitionSpec(), root_in, act_in_specs, leaf_in),
                         out_specs)(i, roots, acts, leaves)

  # The cotangents the backward pass is given: the next stages' for the
  # tangent acts_out, the seeds for the seeded finals (the loss's entries).
  diff_out = fns.out_order[:fns.num_diff_out]
  ct_from_next = [k for k in diff_out if k < n_acts]
  ct_specs = [L.rows_spec(len(st.acts_out[k].aval.shape), st.row_out[k])
              for k in ct_from_next]

  def bwd_inputs(i, roots, acts, leaves, outs, stored, cts, seeds) -> list:
    """The backward's inputs: every residual, then every cotangent."""
    ins = local_inputs(i, roots, acts, leaves)
    outs = [x if r is not None else x[0] for x, r in zip(outs, out_rows)]
    stored = [x[0] for x in stored]
    res = []
    for (kind, k), v in zip(fns.residuals.sources, bj.jaxpr.invars):
      if kind == "stored":
        res.append(stored[k])
      elif kind == "input":
        res.append(ins[k])
      elif kind == "output":
        res.append(outs[k])
      else:
        res.append(jnp.asarray(k, v.aval.dtype))
    ct_iter, seed_iter = iter(cts), iter(seeds)
    ct_all = []
    for k, v in zip(diff_out, bj.jaxpr.invars[len(res):], strict=True):
      if k < n_acts:
        ct_all.append(next(ct_iter))
      else:
        ct_all.append(jnp.broadcast_to(next(seed_iter), v.aval.shape).astype(v.aval.dtype))
    return [*res, *ct_all]

  def accumulate(acc, grads):
    return [add_partial(a, g[None], t) for a, g, t in zip(acc, grads, acc_dtypes, strict=True)]

  def bwd_body(i, acc, roots, acts, leaves, outs, stored, cts, seeds):
    r = eval_jaxpr(bj.jaxpr, (), bwd_inputs(i, roots, acts, leaves, outs, stored, cts, seeds),
                   Rules(pins=bwd_pins, pin=pin, hint=hint, once_axes=once,
                         gathers=bwd_gathers),
                   constvals=bj.consts)
    grads, ct_in = r[:nr], r[nr:]
    return accumulate(acc, grads), ct_in

  acc_local = [PartitionSpec(L.entry)] * nr

  seed_specs = [PartitionSpec()] * len(st.seeded_finals)

  def backward(i, acc, roots, acts, leaves, outs, stored, cts, seeds):
    return manual_region(
        bwd_body, (PartitionSpec(), acc_local, root_in, act_in_specs, leaf_in,
                   out_specs, stored_specs, ct_specs, seed_specs),
        (acc_local, ct_out_specs))(i, acc, roots, acts, leaves, outs, stored, cts, seeds)

  backward_input = backward_weight = None
  if split_backward:
    parts = split_input_weight(bj, nr)
    b_pins, w_pins = parts.pins(bwd_pins)
    bI, bW = parts.inputs, parts.weights
    n_ct = len(ct_out_specs)
    w_gathers = {v: g for v, g in bwd_gathers.items() if v in set(bW.jaxpr.invars)}
    carried_specs = [PartitionSpec(L.entry)] * parts.num_carried

    def bwd_input_body(i, roots, acts, leaves, outs, stored, cts, seeds):
      r = eval_jaxpr(bI.jaxpr, (), bwd_inputs(i, roots, acts, leaves, outs, stored, cts,
                                               seeds),
                     Rules(pins=b_pins, pin=pin, hint=hint, once_axes=once,
                           gathers=bwd_gathers),
                     constvals=bI.consts)
      return r[:n_ct], [_stack(x) for x in r[n_ct:]]

    def bwd_weight_body(i, acc, roots, acts, leaves, outs, stored, cts, seeds, carried):
      every = bwd_inputs(i, roots, acts, leaves, outs, stored, cts, seeds)
      grads = eval_jaxpr(bW.jaxpr, (), [*(every[k] for k in parts.reads),
                                        *(x[0] for x in carried)],
                         Rules(pins=w_pins, pin=pin, hint=hint, once_axes=once,
                               gathers=w_gathers),
                         constvals=bW.consts)
      return accumulate(acc, grads)

    pass_specs = (root_in, act_in_specs, leaf_in, out_specs, stored_specs, ct_specs,
                  seed_specs)

    def backward_input_fn(i, roots, acts, leaves, outs, stored, cts, seeds):
      return manual_region(bwd_input_body, (PartitionSpec(), *pass_specs),
                           (ct_out_specs, carried_specs))(
          i, roots, acts, leaves, outs, stored, cts, seeds)

    def backward_weight_fn(i, acc, roots, acts, leaves, outs, stored, cts, seeds, carried):
      return manual_region(bwd_weight_body, (PartitionSpec(), acc_local, *pass_specs,
                                             carried_specs), acc_local)(
          i, acc, roots, acts, leaves, outs, stored, cts, seeds, carried)
    backward_input = jax.jit(backward_input_fn)
    backward_weight = jax.jit(backward_weight_fn, donate_argnums=(1,))

  def sync_body(acc):
    return [reduce_manual(a[0], s, manual).astype(v.dtype)
            for a, s, v in zip(acc, grad_specs, grad_avals, strict=True)]

  def sync(acc):
    return manual_region(sync_body, (acc_local,),
                         [manual_spec(s, manual) for s in grad_specs])(acc)

  ns = L.sharding
  acc_shardings = [ns(stacked_spec(s, manual)) for s in grad_specs]

  def init():
    return [jnp.zeros((D, *a.shape), t) for a, t in zip(grad_avals, acc_dtypes,
                                                         strict=True)]
  replicated = ns(PartitionSpec())
  index = tuple(jax.device_put(np.int32(i), replicated) for i in range(L.n))
  return StageExecutables(
      layout=L,
      forward=jax.jit(forward),
      first=jax.jit(first),
      backward=jax.jit(backward, donate_argnums=(1,)),
      backward_input=backward_input, backward_weight=backward_weight,
      sync=jax.jit(sync, out_shardings=[ns(s) for s in grad_specs], donate_argnums=(0,)),
      init=jax.jit(init, out_shardings=acc_shardings),
      out_specs=tuple(out_specs), out_rows=tuple(out_rows),
      act_in_specs=tuple(act_in_specs), ct_out_specs=tuple(ct_out_specs),
      grad_specs=tuple(grad_specs),
      act_out_specs=tuple(L.rows_spec(len(v.aval.shape), r) for v, r in
                          zip(st.acts_out, st.row_out, strict=True)),
      fns_out_order=tuple(fns.out_order), ct_from_next=tuple(ct_from_next),
      num_stored=len(stored_specs), index=index)
