"""dot_general: batch, free and contracting dimensions split on any mesh axis.

Each planned mesh axis is put on one "slot": a batch dimension pair, a free
dimension of either operand, a contracting dimension pair (each device then
holds a partial sum and the output is all-reduced over that axis), or none.
"""

from __future__ import annotations

import itertools
import math

from autopar.costs.cost_model import itemsize
from autopar.costs.strategies.base import RuleContext, Strategy, local_bytes, register


def dot_flops(lhs_shape, out_shape, contracting) -> int:
  """Flops of a dot_general: 2 x its output's size x its contracted dims'.
  The planner's cost lower bound (planner._matmul_flops) counts with it too."""
  return 2 * math.prod(out_shape) * math.prod(lhs_shape[d] for d in contracting)


def work_dtype(*avals, precision=None) -> str:
  """The dtype a matmul or convolution runs at: its operands' (the slower
  of the two where they differ). The accumulation type
  (``preferred_element_type``) does not set the rate: bfloat16 operands
  with float32 accumulation run at bfloat16's peak. float32 operands at
  JAX's default precision run as "tfloat32" where the device has such a
  rate (XLA's GPU backend uses TF32 tensor cores then: measured on an
  H200, a float32 MLP step ran 3.7 times faster than float32's peak
  allows); at ``Precision.HIGHEST`` (or with
  ``jax_default_matmul_precision="highest"``) at float32's."""
  dtype = max((str(a.dtype) for a in avals), key=lambda d: itemsize(d))
  if dtype == "float32" and _default_precision(precision):
    return "tfloat32"
  return dtype


def _default_precision(precision) -> bool:
  """Whether a dot's ``precision`` param lets XLA use TF32 for float32."""
  import jax
  from jax.lax import Precision
  configured = jax.config.jax_default_matmul_precision
  if configured not in (None, "default", "fastest", "bfloat16", "tensorfloat32",
                        "bfloat16_3x", "ANY_F32_F32_F32"):
    return False
  parts = precision if isinstance(precision, tuple) else (precision,)
  return all(p is None or p == Precision.DEFAULT for p in parts)


@register("dot_general")
def dot_general(eqn, ctx: RuleContext) -> list[Strategy]:
  lhs, rhs = (v.aval for v in eqn.invars)
  out = eqn.outvars[0].aval
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  lf = [d for d in range(len(lhs.shape)) if d not in lc and d not in lb]
  rf = [d for d in range(len(rhs.shape)) if d not in rc and d not in rb]
  slots = ([("b", i) for i in range(len(lb))] + [("l", d) for d in lf] +
           [("r", d) for d in rf] + [("c", i) for i in range(len(lc))])

  def slot_size(slot):
    kind, i = slot
    if kind == "b":
      return lhs.shape[lb[i]]
    if kind == "c":
      return lhs.shape[lc[i]]
    return (lhs if kind == "l" else rhs).shape[i]

  flops = dot_flops(lhs.shape, out.shape, lc)
  strategies = []
  for assign in itertools.product([None, *slots], repeat=len(ctx.axes)):
    axes_of = {s: tuple(a for a, t in zip(ctx.axes, assign) if t == s) for s in slots}
    if any(slot_size(s) % math.prod(ctx.sizes[a] for a in axes_of[s])
           for s in slots if axes_of[s]):
      continue
    lspec = [()] * len(lhs.shape)
    rspec = [()] * len(rhs.shape)
    for i, (l, r) in enumerate(zip(lb, rb)):
      lspec[l] = rspec[r] = axes_of[("b", i)]
    for i, (l, r) in enumerate(zip(lc, rc)):
      lspec[l] = rspec[r] = axes_of[("c", i)]
    for d in lf:
      lspec[d] = axes_of[("l", d)]
    for d in rf:
      rspec[d] = axes_of[("r", d)]
    ospec = tuple([axes_of[("b", i)] for i in range(len(lb))] +
                  [axes_of[("l", d)] for d in lf] + [axes_of[("r", d)] for d in rf])
    reduce_axes = tuple(a for i in range(len(lc)) for a in axes_of[("c", i)])
    shards = math.prod(ctx.sizes[a] for a, t in zip(ctx.axes, assign) if t is not None)
    comm, colls = 0.0, ()
    if reduce_axes:
      b = local_bytes(out, ospec, ctx.sizes)
      comm = ctx.cost.all_reduce(b, reduce_axes)
      colls = (("all-reduce", reduce_axes, b),)
    strategies.append(Strategy(
        name=f"lhs{tuple(lspec)} x rhs{tuple(rspec)}",
        out_specs=(ospec,), in_specs=(tuple(lspec), tuple(rspec)),
        compute=ctx.compute(flops, shards, work_dtype(
            lhs, rhs, precision=eqn.params.get("precision"))),
        comm=comm, collectives=colls))
  return strategies


@register("conv_general_dilated")
def conv_general_dilated(eqn, ctx: RuleContext) -> list[Strategy]:
  """Convolutions: split the batch, the output features, or the input features
  (partial sums, all-reduced). Spatial dims stay whole: halo exchanges are not
  modelled."""
  if eqn.params["feature_group_count"] != 1 or eqn.params["batch_group_count"] != 1:
    return []
  lhs, rhs = (v.aval for v in eqn.invars)
  out = eqn.outvars[0].aval
  dn = eqn.params["dimension_numbers"]
  lb, lf = dn.lhs_spec[0], dn.lhs_spec[1]
  ro, ri = dn.rhs_spec[0], dn.rhs_spec[1]
  ob, of = dn.out_spec[0], dn.out_spec[1]
  slots = {"batch": lhs.shape[lb], "out": rhs.shape[ro], "in": lhs.shape[lf]}
  flops = 2 * math.prod(out.shape) * math.prod(rhs.shape) / rhs.shape[ro]
  strategies = []
  for assign in itertools.product([None, *slots], repeat=len(ctx.axes)):
    axes_of = {s: tuple(a for a, t in zip(ctx.axes, assign) if t == s) for s in slots}
    if any(slots[s] % math.prod(ctx.sizes[a] for a in axes_of[s]) for s in slots):
      continue
    lspec = [()] * len(lhs.shape)
    rspec = [()] * len(rhs.shape)
    ospec = [()] * len(out.shape)
    lspec[lb] = ospec[ob] = axes_of["batch"]
    rspec[ro] = ospec[of] = axes_of["out"]
    lspec[lf] = rspec[ri] = axes_of["in"]
    shards = math.prod(ctx.sizes[a] for a, t in zip(ctx.axes, assign) if t is not None)
    comm, colls = 0.0, ()
    if axes_of["in"]:
      b = local_bytes(out, tuple(ospec), ctx.sizes)
      comm = ctx.cost.all_reduce(b, axes_of["in"])
      colls = (("all-reduce", axes_of["in"], b),)
    strategies.append(Strategy(
        f"conv lhs{tuple(lspec)} x rhs{tuple(rspec)}", (tuple(ospec),),
        (tuple(lspec), tuple(rspec)),
        compute=ctx.compute(flops, shards, work_dtype(
            lhs, rhs, precision=eqn.params.get("precision"))),
        comm=comm, collectives=colls))
  return strategies
