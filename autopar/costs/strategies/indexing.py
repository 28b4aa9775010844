"""gather and scatter: embedding look-ups and their gradients.

``gather`` (``table[ids]``): each mesh axis may split a batch dimension of
the indices (and of the output), or a dimension of the table that is sliced
whole (an "offset" dimension, e.g. the embedding width), at no communication
cost. The indexed dimension of the table stays whole.

``scatter-add`` (the gradient of a look-up): each axis may split a window
dimension (the embedding width) of the operand and the updates, or a batch
dimension of the updates and indices, in which case every device holds
partial sums of the whole operand, all-reduced over that axis.
"""

from __future__ import annotations

import itertools
import math

from autopar.costs.strategies.base import (RuleContext, Strategy, local_bytes, register,
                                replicated)


def _assignments(ctx: RuleContext, slots):
  for assign in itertools.product([None, *slots], repeat=len(ctx.axes)):
    yield {s: tuple(a for a, t in zip(ctx.axes, assign) if t == s) for s in slots}


def _divides(size: int, axes, sizes) -> bool:
  return size % math.prod(sizes[a] for a in axes) == 0


@register("gather")
def gather(eqn, ctx: RuleContext) -> list[Strategy]:
  operand, indices = (v.aval for v in eqn.invars)
  out = eqn.outvars[0].aval
  dn = eqn.params["dimension_numbers"]
  if getattr(dn, "operand_batching_dims", ()):
    return []
  slice_sizes = eqn.params["slice_sizes"]
  offset_dims = tuple(dn.offset_dims)
  kept = [d for d in range(len(operand.shape)) if d not in dn.collapsed_slice_dims]
  out_batch = [d for d in range(len(out.shape)) if d not in offset_dims]
  idx_batch = list(range(len(indices.shape) - 1))   # the last is the index vector
  if len(out_batch) != len(idx_batch):
    return []
  # slots: ("b", k) a batch dim; ("o", k) an offset dim taken whole from the table
  slots = [("b", k) for k in range(len(out_batch))]
  slots += [("o", k) for k, d in enumerate(kept)
            if slice_sizes[d] == operand.shape[d] and d not in dn.start_index_map]
  strategies = []
  for axes_of in _assignments(ctx, slots):
    ospec = [()] * len(out.shape)
    ispec = [()] * len(indices.shape)
    tspec = [()] * len(operand.shape)
    ok = True
    for (kind, k), axes in axes_of.items():
      if not axes:
        continue
      if kind == "b":
        ok &= _divides(out.shape[out_batch[k]], axes, ctx.sizes)
        ospec[out_batch[k]] = axes
        ispec[idx_batch[k]] = axes
      else:
        ok &= _divides(operand.shape[kept[k]], axes, ctx.sizes)
        ospec[offset_dims[k]] = axes
        tspec[kept[k]] = axes
    if ok:
      strategies.append(Strategy(f"gather {tuple(ospec)}", (tuple(ospec),),
                                 (tuple(tspec), tuple(ispec))))
  return strategies


@register("scatter-add", "scatter_add")
def scatter_add(eqn, ctx: RuleContext) -> list[Strategy]:
  operand, indices, updates = (v.aval for v in eqn.invars)
  dn = eqn.params["dimension_numbers"]
  if getattr(dn, "operand_batching_dims", ()):
    return []
  window = tuple(dn.update_window_dims)
  op_window = [d for d in range(len(operand.shape)) if d not in dn.inserted_window_dims]
  upd_batch = [d for d in range(len(updates.shape)) if d not in window]
  idx_batch = list(range(len(indices.shape) - 1))
  if len(upd_batch) != len(idx_batch) or len(op_window) != len(window):
    return []
  slots = [("b", k) for k in range(len(upd_batch))]
  slots += [("w", k) for k, d in enumerate(op_window)
            if updates.shape[window[k]] == operand.shape[d]
            and d not in dn.scatter_dims_to_operand_dims]
  strategies = []
  for axes_of in _assignments(ctx, slots):
    ospec = [()] * len(operand.shape)
    ispec = [()] * len(indices.shape)
    uspec = [()] * len(updates.shape)
    reduce_axes = ()
    ok = True
    for (kind, k), axes in axes_of.items():
      if not axes:
        continue
      if kind == "b":
        ok &= _divides(updates.shape[upd_batch[k]], axes, ctx.sizes)
        uspec[upd_batch[k]] = axes
        ispec[idx_batch[k]] = axes
        reduce_axes += axes
      else:
        ok &= _divides(operand.shape[op_window[k]], axes, ctx.sizes)
        ospec[op_window[k]] = axes
        uspec[window[k]] = axes
    if not ok:
      continue
    comm, colls = 0.0, ()
    if reduce_axes:
      b = local_bytes(operand, tuple(ospec), ctx.sizes)
      comm = ctx.cost.all_reduce(b, reduce_axes)
      colls = (("all-reduce", reduce_axes, b),)
    ins = [tuple(ospec), tuple(ispec), tuple(uspec)]
    ins += [replicated(len(v.aval.shape)) for v in eqn.invars[3:]]
    strategies.append(Strategy(f"scatter-add {tuple(ospec)}", (tuple(ospec),),
                               tuple(ins), comm=comm, collectives=colls))
  return strategies
