"""Shape primitives: broadcast, reshape, transpose, slicing, concatenation, ...

Many of them keep the rank and only need some dimensions whole (the one
concatenated along, the ones sliced or padded): :func:`_same_rank` covers
those. ``reshape`` maps a split dimension through merges and splits of
dimensions (hidden -> heads x head_dim) as long as the split is on the major
dimension of each merged group.
"""

from __future__ import annotations

import math

from jax.extend.core import Literal

from autopar.costs.strategies.base import (RuleContext, Strategy, enumerate_specs, register,
                                replicated)


def _same_rank(eqn, ctx: RuleContext, fixed, *, operands=None) -> list[Strategy]:
  """Outputs and the same-shaped inputs share a spec; ``fixed`` dims stay whole."""
  out = eqn.outvars[0].aval
  strategies = []
  for spec in enumerate_specs(out.shape, ctx.axes, ctx.sizes, fixed=fixed):
    ins = []
    for k, v in enumerate(eqn.invars):
      if isinstance(v, Literal):
        ins.append(None)
      elif (operands is None or k in operands) and len(v.aval.shape) == len(out.shape):
        ins.append(spec)
      else:
        ins.append(replicated(len(v.aval.shape)))
    strategies.append(Strategy(str(spec), tuple(spec for _ in eqn.outvars), tuple(ins)))
  return strategies


@register("broadcast_in_dim")
def broadcast_in_dim(eqn, ctx):
  op = eqn.invars[0]
  out = eqn.outvars[0].aval
  dims = eqn.params["broadcast_dimensions"]
  strategies = []
  for spec in enumerate_specs(out.shape, ctx.axes, ctx.sizes):
    if isinstance(op, Literal):
      in_spec = None
    else:
      in_spec = tuple(spec[d] if op.aval.shape[i] == out.shape[d] else ()
                      for i, d in enumerate(dims))
    extra = [None] * (len(eqn.invars) - 1)    # dynamic shape operands, if any
    strategies.append(Strategy(str(spec), (spec,), (in_spec, *extra)))
  return strategies


@register("transpose")
def transpose(eqn, ctx):
  perm = eqn.params["permutation"]
  out = eqn.outvars[0].aval
  strategies = []
  for spec in enumerate_specs(out.shape, ctx.axes, ctx.sizes):
    in_spec = [()] * len(perm)
    for o, i in enumerate(perm):
      in_spec[i] = spec[o]
    strategies.append(Strategy(str(spec), (spec,), (tuple(in_spec),)))
  return strategies


def _reshape_groups(src, dst):
  """Pairs (src dims, dst dims) whose sizes multiply to the same number.

  ``(8, 64) -> (8, 4, 16)`` gives ``[([0], [0]), ([1], [1, 2])]``. Size-1 dims
  join the group after them (or the last group). None if sizes do not match.
  """
  if 0 in src or 0 in dst or math.prod(src) != math.prod(dst):
    return None
  if not src or not dst:      # a scalar to size-1 dims, or back: one group
    return [(list(range(len(src))), list(range(len(dst))))]
  groups, i, j = [], 0, 0
  while i < len(src) and j < len(dst):
    gi, gj, ps, pd = [i], [j], src[i], dst[j]
    i, j = i + 1, j + 1
    while ps != pd:
      if ps < pd:
        ps *= src[i]
        gi.append(i)
        i += 1
      else:
        pd *= dst[j]
        gj.append(j)
        j += 1
    groups.append((gi, gj))
  for k in range(i, len(src)):
    groups[-1][0].append(k)
  for k in range(j, len(dst)):
    groups[-1][1].append(k)
  return groups


@register("reshape")
def reshape(eqn, ctx):
  if eqn.params.get("dimensions") is not None:
    return []
  src = tuple(eqn.invars[0].aval.shape)
  dst = tuple(eqn.outvars[0].aval.shape)
  groups = _reshape_groups(src, dst)
  if groups is None:
    return []
  strategies = []
  for spec in enumerate_specs(dst, ctx.axes, ctx.sizes):
    in_spec = [()] * len(src)
    ok = True
    for gi, gj in groups:
      split = [d for d in gj if spec[d]]
      if not split:
        continue
      major_out = next((d for d in gj if dst[d] != 1), None)
      major_in = next((d for d in gi if src[d] != 1), None)
      if split != [major_out] or major_in is None:
        ok = False
        break
      n = math.prod(ctx.sizes[a] for a in spec[major_out])
      if src[major_in] % n:
        ok = False
        break
      in_spec[major_in] = spec[major_out]
    if ok:
      strategies.append(Strategy(str(spec), (spec,), (tuple(in_spec),)))
  return strategies


@register("squeeze")
def squeeze(eqn, ctx):
  dims = set(eqn.params["dimensions"])
  rank_in = len(eqn.invars[0].aval.shape)
  kept = [d for d in range(rank_in) if d not in dims]
  out = eqn.outvars[0].aval
  strategies = []
  for spec in enumerate_specs(out.shape, ctx.axes, ctx.sizes):
    in_spec = [()] * rank_in
    for o, d in enumerate(kept):
      in_spec[d] = spec[o]
    strategies.append(Strategy(str(spec), (spec,), (tuple(in_spec),)))
  return strategies


@register("expand_dims")
def expand_dims(eqn, ctx):
  dims = set(eqn.params["dimensions"])
  out = eqn.outvars[0].aval
  kept = [d for d in range(len(out.shape)) if d not in dims]
  strategies = []
  for spec in enumerate_specs(out.shape, ctx.axes, ctx.sizes, fixed=tuple(dims)):
    strategies.append(Strategy(str(spec), (spec,), (tuple(spec[d] for d in kept),)))
  return strategies


@register("iota", "empty2", "full", "rng_bit_generator", "random_bits",
          "random_seed", "random_wrap", "random_unwrap", "random_split",
          "random_fold_in", "threefry2x32", "autopar_iota_rows")
def _generated(eqn, ctx):
  # iota, and empty2 (an uninitialised buffer JAX makes for a cond's
  # residuals): any sharding of the output.
  if eqn.primitive.name not in ("iota", "empty2"):
    # PRNG internals (with autopar_iota_rows, the positions of a device's
    # rows in a draw, frontend/rng.py): keep replicated (the fallback), quietly.
    return []
  return _same_rank(eqn, ctx, ())


@register("stack")
def stack(eqn, ctx):
  """``stack[axis]``: every input has the output's spec without ``axis``, which
  stays whole (stacked layer weights keep each layer's slice whole too)."""
  axis = eqn.params["axis"]
  out = eqn.outvars[0].aval
  strategies = []
  for spec in enumerate_specs(out.shape, ctx.axes, ctx.sizes, fixed=(axis,)):
    in_spec = spec[:axis] + spec[axis + 1:]
    strategies.append(Strategy(str(spec), (spec,),
                               tuple(None if isinstance(v, Literal) else in_spec
                                     for v in eqn.invars)))
  return strategies


@register("unstack")
def unstack(eqn, ctx):
  """``unstack[axis]``: the inverse of ``stack``."""
  axis = eqn.params["axis"]
  src = eqn.invars[0].aval
  strategies = []
  for spec in enumerate_specs(src.shape, ctx.axes, ctx.sizes, fixed=(axis,)):
    out_spec = spec[:axis] + spec[axis + 1:]
    strategies.append(Strategy(str(spec), tuple(out_spec for _ in eqn.outvars), (spec,)))
  return strategies


@register("concatenate")
def concatenate(eqn, ctx):
  return _same_rank(eqn, ctx, (eqn.params["dimension"],))


@register("split")
def split_(eqn, ctx):
  """``split[axis, sizes]``: every piece and the operand share a spec, with
  ``axis`` whole."""
  axis = eqn.params["axis"]
  src = eqn.invars[0].aval
  return [Strategy(str(spec), tuple(spec for _ in eqn.outvars), (spec,))
          for spec in enumerate_specs(src.shape, ctx.axes, ctx.sizes, fixed=(axis,))]


@register("slice")
def slice_(eqn, ctx):
  op = eqn.invars[0].aval
  out = eqn.outvars[0].aval
  fixed = tuple(d for d in range(len(op.shape)) if op.shape[d] != out.shape[d])
  return _same_rank(eqn, ctx, fixed)


@register("pad")
def pad(eqn, ctx):
  config = eqn.params["padding_config"]
  fixed = tuple(d for d, (lo, hi, mid) in enumerate(config) if lo or hi or mid)
  return _same_rank(eqn, ctx, fixed, operands=(0,))


@register("rev")
def rev(eqn, ctx):
  return _same_rank(eqn, ctx, tuple(eqn.params["dimensions"]))


@register("dynamic_slice")
def dynamic_slice(eqn, ctx):
  op = eqn.invars[0].aval
  out = eqn.outvars[0].aval
  fixed = tuple(d for d in range(len(op.shape)) if op.shape[d] != out.shape[d])
  return _same_rank(eqn, ctx, fixed, operands=(0,))


@register("dynamic_update_slice")
def dynamic_update_slice(eqn, ctx):
  op = eqn.invars[0].aval
  upd = eqn.invars[1].aval
  fixed = tuple(d for d in range(len(op.shape)) if op.shape[d] != upd.shape[d])
  return _same_rank(eqn, ctx, fixed, operands=(0, 1))


@register("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
def cumulative(eqn, ctx):
  return _same_rank(eqn, ctx, (eqn.params["axis"],))


@register("sort")
def sort(eqn, ctx):
  return _same_rank(eqn, ctx, (eqn.params["dimension"],))
