"""Reductions: a split reduced dimension leaves partial results to all-reduce."""

from __future__ import annotations

import math

from autopar.costs.strategies.base import (RuleContext, Strategy, enumerate_specs,
                                local_bytes, register)


@register("reduce_sum", "reduce_max", "reduce_min", "reduce_and", "reduce_or",
          "reduce_prod")
def reduce(eqn, ctx: RuleContext) -> list[Strategy]:
  op = eqn.invars[0].aval
  out = eqn.outvars[0].aval
  axes = set(eqn.params["axes"])
  # A product's partial results could be all-reduced with `mul`, but XLA's
  # partitioner does not always; keep its reduced dims whole.
  fixed = tuple(axes) if eqn.primitive.name == "reduce_prod" else ()
  strategies = []
  for spec in enumerate_specs(op.shape, ctx.axes, ctx.sizes, fixed=fixed):
    ospec = tuple(e for d, e in enumerate(spec) if d not in axes)
    reduced = tuple(a for d, e in enumerate(spec) if d in axes for a in e)
    comm, colls = 0.0, ()
    if reduced:
      b = local_bytes(out, ospec, ctx.sizes)
      comm = ctx.cost.all_reduce(b, reduced)
      colls = (("all-reduce", reduced, b),)
    strategies.append(Strategy(str(spec), (ospec,), (spec,),
                               compute=ctx.compute(math.prod(op.shape), spec),
                               comm=comm, collectives=colls))
  return strategies


@register("argmax", "argmin")
def arg_reduce(eqn, ctx: RuleContext) -> list[Strategy]:
  op = eqn.invars[0].aval
  axes = tuple(eqn.params["axes"])
  strategies = []
  for spec in enumerate_specs(op.shape, ctx.axes, ctx.sizes, fixed=axes):
    ospec = tuple(e for d, e in enumerate(spec) if d not in axes)
    strategies.append(Strategy(str(spec), (ospec,), (spec,),
                               compute=ctx.compute(math.prod(op.shape), spec)))
  return strategies
