"""The gradient path every method shares: seeding the loss, accumulating
over micro-batches, reducing over devices, combining outputs.

A gradient stage (``lower.py`` for one mesh, ``backend/stage_executables.py``
for a pipeline stage on its submesh) runs with the batch axes *manual*
(a partial-manual ``jax.shard_map``): each device computes on its own rows
of each micro-batch, one *group* of rows of ``G = n x devices``. What it
does with them is here, once:

* **the seed** (:func:`seed_loss`): each group differentiates the loss's
  entries with the whole batch's cotangents (``loss.py``), so the groups'
  gradients *sum* to the whole batch's: nothing is divided by ``G``
  afterwards. The cotangents may read sums over the whole batch (a token
  count), which a first pass computes (:func:`sums_pass`).
* **accumulation**: each device adds its micro-batches' gradients into its
  own partial sums, in ``accumulation_dtype`` (float32 for bfloat16 and
  float16 gradients by default), donated from one micro-batch to the next;
* **the sync** (:func:`reduce_manual`): once, after the last micro-batch,
  the partial sums are summed over the batch axes (``psum``, or
  ``psum_scatter`` where the gradient is sharded over them) and cast back to
  the gradient's dtype;
* **outputs** (:data:`COMBINE`, :func:`across`, :func:`combine_groups`):
  reductions over the rows are combined over micro-batches and devices as
  they reduce (summed, maxed, mined), per-example values concatenated.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from autopar import jax_compat as jc
from autopar.frontend.loss import SHARE, loss_cotangent_p

__all__ = ["entry_axes", "make_entry", "restrict", "manual_spec", "auto_spec",
           "stacked_spec", "gather_manual", "reduce_manual", "COMBINE", "identity", "across",
           "combine_groups", "seed_loss", "loss_marker", "add_partial", "sums_pass",
           "micro_batch_inputs", "manual_gathers",
           "num_groups"]


# -- specs over the manual (batch) axes -----------------------------------------

def entry_axes(entry) -> tuple[str, ...]:
  """The mesh axes of one entry of a PartitionSpec."""
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def make_entry(axes: Sequence[str]):
  """A PartitionSpec entry for ``axes`` (None, one name, or a tuple)."""
  axes = tuple(axes)
  return None if not axes else axes[0] if len(axes) == 1 else axes


def restrict(spec: PartitionSpec, keep) -> PartitionSpec:
  """``spec`` with only the mesh axes for which ``keep(axis)`` holds."""
  return PartitionSpec(*(make_entry([a for a in entry_axes(e) if keep(a)])
                         for e in spec))


def manual_spec(spec, manual) -> PartitionSpec:
  """``spec`` over the manual axes only (a shard_map in/out spec)."""
  return restrict(spec, lambda a: a in manual)


def auto_spec(spec, manual) -> PartitionSpec:
  """``spec`` over the automatic axes only."""
  return restrict(spec, lambda a: a not in manual)


def stacked_spec(spec: PartitionSpec, manual: Sequence[str]) -> PartitionSpec:
  """Spec of a ``[D, *shape]`` stack of per-device partial sums."""
  return PartitionSpec(make_entry(manual), *auto_spec(spec, manual))


# -- collectives inside the manual region -------------------------------------

def gather_manual(x, spec: PartitionSpec, manual: Sequence[str]):
  """All-gathers the manual-axis sharding of a leaf (ZeRO-3 parameters)."""
  for d, entry in enumerate(spec):
    axes = [a for a in entry_axes(entry) if a in manual]
    if axes:
      x = lax.all_gather(x, tuple(axes), axis=d, tiled=True)
  return x


def reduce_manual(x, spec: PartitionSpec, manual: Sequence[str]):
  """Sums ``x`` over the manual axes, scattering where ``spec`` shards it."""
  scattered = set()
  for d, entry in enumerate(spec):
    axes = tuple(a for a in entry_axes(entry) if a in manual)
    if axes:
      x = lax.psum_scatter(x, axes, scatter_dimension=d, tiled=True)
      scattered.update(axes)
  rest = tuple(a for a in manual if a not in scattered)
  return lax.psum(x, rest) if rest else x


def micro_batch_inputs(leaves, values, i, rows: int) -> list:
  """A device's inputs for its micro-batch ``i``: the ``rows`` rows of each
  batch leaf's local slice (selecting them moves no data); the other
  leaves as they are (a parameter split over the manual axes is gathered
  where the pass reads it: :func:`manual_gathers`)."""
  return [lax.dynamic_slice_in_dim(x, i * rows, rows, axis=0) if leaf.is_batch else x
          for leaf, x in zip(leaves, values, strict=True)]


def manual_gathers(invars, leaves, read, specs, manual) -> dict:
  """``Rules.gathers`` of a pass whose inputs for the leaves are
  ``invars``: each parameter ``read`` (indices) that ``specs`` split over
  the manual axes (ZeRO-3), gathered over them by each equation that reads
  it (``evaluate._gathered``)."""
  out = {}
  for k, (v, leaf) in enumerate(zip(invars, leaves, strict=True)):
    if k in read and not leaf.is_batch and any(
        a in manual for e in specs[k] for a in entry_axes(e)):
      out[v] = functools.partial(gather_manual, spec=specs[k], manual=manual)
  return out


def add_partial(total, g, dtype):
  """``g`` added to this device's partial sum ``total`` (None: the first
  micro-batch) in the accumulation dtype."""
  g = g.astype(dtype)
  return g if total is None else total + g


# -- outputs ----------------------------------------------------------------------

# How values are combined over micro-batches (elementwise).
COMBINE = {"sum": jnp.add, "mean": jnp.add, "max": jnp.maximum, "min": jnp.minimum}


def identity(op: str, dtype):
  """The value that combining by ``op`` leaves any ``dtype`` value unchanged
  (0 for a sum; for a max the dtype's least: -inf, the least finite value
  of a float8 without infinities, its integer minimum, or False), what a
  step's combinations start from before its first micro-batch."""
  if op in ("sum", "mean"):
    return np.zeros((), dtype)
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return np.bool_(op == "min")
  if jnp.issubdtype(dtype, jnp.inexact):
    value = np.array(-np.inf if op == "max" else np.inf, dtype)
    if np.isnan(value.astype(np.float32)):       # a float8 without infinities
      info = jnp.finfo(dtype)
      value = np.array(info.min if op == "max" else info.max, dtype)
    return value
  info = jnp.iinfo(dtype)
  return np.array(info.min if op == "max" else info.max, dtype)


def across(x, op: str, manual: Sequence[str], groups: int):
  """``x`` (one device's combination of its micro-batches) combined over the
  manual (batch) axes: summed, averaged over all ``groups``, maxed, mined."""
  if op in ("sum", "mean"):
    x = lax.psum(x, manual) if manual else x
    return x / groups if op == "mean" else x
  if not manual:
    return x
  if x.dtype == jnp.bool_:            # jnp.any / jnp.all over the rows
    return across(x.astype(jnp.int32), op, manual, groups).astype(jnp.bool_)
  return lax.pmax(x, manual) if op == "max" else lax.pmin(x, manual)


def combine_groups(values: Sequence[Any], op: str | None, row_dim: int | None,
                   groups: int):
  """One output over all micro-batches, outside the stages (a pipeline's):
  per-device values stacked ``[D, ...]`` combined by ``op`` (a mean over
  ``groups = n * D``), or row-split values concatenated along ``row_dim``."""
  if row_dim is not None:
    return jnp.concatenate(values, axis=row_dim) if len(values) > 1 else values[0]
  x = jnp.stack(values)                       # [n, D, ...]
  if op in ("sum", "mean"):
    total = jnp.sum(x, axis=(0, 1))
    return total / groups if op == "mean" else total
  return jnp.max(x, axis=(0, 1)) if op == "max" else jnp.min(x, axis=(0, 1))


# -- the loss's seed ----------------------------------------------------------------

def loss_marker(jaxpr) -> int | None:
  """The index of ``jaxpr``'s ``autopar_loss_cotangent`` equation, if any."""
  return next((i for i, e in enumerate(jaxpr.eqns) if e.primitive is loss_cotangent_p),
              None)


def seed_loss(scale, groups: int, sums: Sequence[Any]) -> Callable:
  """An ``evaluate.Rules.override`` for the ``autopar_loss_cotangent``
  equation: the whole batch's cotangents ``scale(sums, inputs, seeds)``
  (``scale``: ``LossGradient.scale`` at the whole batch's size; ``sums``:
  the whole batch's, from the first pass), over ``groups`` for the entries
  every group shares."""
  def run(eqn, args, rules):
    del rules
    p = eqn.params
    k, ns, nh = len(p["kinds"]), len(p["sum_ops"]), p["num_inputs"]
    inputs, seeds = args[k + ns:k + ns + nh], args[k + ns + nh:]
    c = jc.eval_jaxpr(scale.jaxpr, scale.consts, *sums, *inputs, *seeds)
    return [(x / groups if kind == SHARE else x).astype(a.dtype)
            for x, kind, a in zip(c, p["kinds"], args[:k], strict=True)]
  return run


def sums_pass(evaluate: Callable, n: int, ops: Sequence[str], manual: Sequence[str],
              groups: int) -> list:
  """The whole batch's sums the loss's cotangents read: ``evaluate(i)``
  gives one device's sums over micro-batch ``i``; they are combined over
  its ``n`` micro-batches, then over the devices."""
  total = evaluate(0)
  if n > 1:
    def body(i, acc):
      return [COMBINE[op](a, x) for a, x, op in zip(acc, evaluate(i), ops, strict=True)]
    total = lax.fori_loop(1, n, body, list(total))
  return [across(x, op, manual, groups) for x, op in zip(total, ops, strict=True)]


def num_groups(n: int, sizes, manual: Sequence[str]) -> int:
  """``G``: micro-batches times devices along the batch axes."""
  return n * math.prod(sizes[a] for a in manual)
