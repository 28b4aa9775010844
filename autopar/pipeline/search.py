"""Choosing the stages: layers per stage, submeshes, batch axes."""

from __future__ import annotations

import math

import numpy as np
from jax.sharding import PartitionSpec

from autopar.method import axis_sizes_of
from autopar.pipeline.planner import cut
from autopar.pipeline.program import eqn_flops, sizer
from autopar.pipeline.submesh import block_shape_of, tile


def _layer_flops(ctx):
  size = sizer(ctx.micro)
  flops = np.array([eqn_flops(e, size) for e in ctx.program.eqns], dtype=float)
  cum = np.concatenate([[0.0], np.cumsum(flops)])
  out = []
  for a in range(ctx.num_layers):
    lo, hi = ctx.layer_range(a, a + 1)
    out.append(cum[hi] - cum[lo])
  return out


def _groups(flops, S):
  """S consecutive groups of about equal flops."""
  L = len(flops)
  cum = np.concatenate([[0.0], np.cumsum(flops)])
  bounds = [0]
  for j in range(1, S):
    target = cum[-1] * j / S
    lo = bounds[-1] + 1
    hi = L - (S - j)
    b = min(range(lo, hi + 1), key=lambda q: abs(cum[q] - target))
    bounds.append(b)
  bounds.append(L)
  return [(bounds[i], bounds[i + 1]) for i in range(S)]


def search(pre, method, mesh):
  from autopar.pipeline.compile import StageChoice
  ctx = pre.ctx
  sizes = axis_sizes_of(mesh)
  shape = tuple(sizes.values())
  S = method.num_stages if method.num_stages != "auto" else 2
  layers = _groups(_layer_flops(ctx), S)
  if method.stage_mesh_shapes != "auto":
    shapes = method.stage_mesh_shapes
  else:
    shapes = [block_shape_of(shape, math.prod(shape) // S)] * S
  offsets = tile(shape, shapes)
  c = cut(ctx, layers)
  choices = []
  for s, st in enumerate(c.stages):
    sub = dict(zip(sizes, shapes[s]))
    axes = []
    d = 1
    for a, k in sub.items():
      if k > 1 and ctx.micro % (d * k) == 0:
        axes.append(a)
        d *= k
    choices.append(StageChoice(layers=layers[s], offset=offsets[s], shape=tuple(shapes[s]),
                               batch_axes=tuple(axes),
                               root_specs=tuple(PartitionSpec() for _ in st.roots),
                               leaf_specs=tuple(PartitionSpec() for _ in st.leaves)))
  return c, choices
