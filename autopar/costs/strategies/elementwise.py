"""Elementwise primitives: every input of the output's shape shares its spec."""

from __future__ import annotations

import math

from jax.extend.core import Literal

from autopar.costs.strategies.base import RuleContext, Strategy, enumerate_specs, register

ELEMENTWISE = (
    "add", "add_any", "sub", "mul", "div", "rem", "pow", "max", "min", "atan2",
    "nextafter", "and", "or", "xor", "not", "eq", "ne", "lt", "le", "gt", "ge",
    "neg", "sign", "floor", "ceil", "round", "is_finite", "abs", "exp", "exp2",
    "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan", "asin",
    "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "sqrt", "rsqrt",
    "cbrt", "square", "integer_pow", "erf", "erfc", "erf_inv", "lgamma",
    "digamma", "select_n", "clamp", "convert_element_type", "stop_gradient",
    "copy", "copy_p", "reduce_precision", "shift_left", "shift_right_logical",
    "shift_right_arithmetic", "population_count", "imag", "real", "conj",
    "optimization_barrier", "autopar_value", "autopar_loss_input",
    "one_minus_square",     # 1 - x**2 (tanh's derivative; jax >= 0.12)
    "name",                 # jax.ad_checkpoint.checkpoint_name: an identity (MaxText)
)


def is_elementwise(eqn) -> bool:
  return eqn.primitive.name in ELEMENTWISE


@register("bitcast_convert_type")
def bitcast(eqn, ctx: RuleContext) -> list[Strategy]:
  """Elementwise between types of one width (uint32 -> float32 in a random
  draw); between widths the shape changes: kept replicated."""
  if tuple(eqn.invars[0].aval.shape) != tuple(eqn.outvars[0].aval.shape):
    return []
  return elementwise(eqn, ctx)


@register(*ELEMENTWISE)
def elementwise(eqn, ctx: RuleContext) -> list[Strategy]:
  out = eqn.outvars[0].aval
  size = math.prod(out.shape)
  strategies = []
  for spec in enumerate_specs(out.shape, ctx.axes, ctx.sizes):
    ins = []
    for v in eqn.invars:
      if isinstance(v, Literal):
        ins.append(None)
      elif tuple(v.aval.shape) == tuple(out.shape):
        ins.append(spec)
      elif len(v.aval.shape) == len(out.shape):
        # Implicit broadcasting of size-1 dims ([8, 2048] + [1, 2048]).
        ins.append(tuple(e if n == m else ()
                         for e, n, m in zip(spec, v.aval.shape, out.shape)))
      else:                       # a scalar operand (select_n predicate, clamp bounds)
        ins.append(((),) * len(v.aval.shape))
    outs = tuple(spec for _ in eqn.outvars)
    strategies.append(Strategy(str(spec), outs, tuple(ins),
                               compute=ctx.compute(size, spec)))
  return strategies
