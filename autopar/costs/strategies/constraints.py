"""The user's sharding hints (``hints.py``): the hinted value takes the
hint's spec on the planned axes, and nothing else.

Batch axes in a hint are met by the batch split itself (``hints.py`` checks
where they may be), so only the planned axes ``ctx.axes`` are kept; a
dimension the hint leaves ``UNCONSTRAINED`` is free.
"""

from __future__ import annotations

from jax.extend.core import Literal
from jax.sharding import PartitionSpec

from autopar.frontend.hints import HINT_PRIMITIVES, entry_axes, spec_of
from autopar.costs.strategies.base import RuleContext, Strategy, enumerate_specs, register


@register(*HINT_PRIMITIVES)
def hinted(eqn, ctx: RuleContext) -> list[Strategy]:
  shape = eqn.outvars[0].aval.shape
  want = [None if e is PartitionSpec.UNCONSTRAINED else
          tuple(a for a in entry_axes(e) if a in ctx.axes)
          for e in spec_of(eqn)]
  specs = [s for s in enumerate_specs(shape, ctx.axes, ctx.sizes)
           if all(w is None or s[d] == w for d, w in enumerate(want))]
  if not specs:   # the hint splits a dimension the axes do not divide: as asked
    specs = [tuple(w or () for w in want)]
  literal = isinstance(eqn.invars[0], Literal)
  return [Strategy(f"hint {s}", (s,), (None if literal else s,)) for s in specs]
