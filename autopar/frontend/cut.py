"""``P`` cut into pipeline stages, and each stage's passes and layout.

:func:`cut` cuts ``P`` (``program.py``) at layer boundaries into stage
programs (``stages.py``), says which stage each argument leaf, root and
output lives on, and cuts the update per stage (``apply_segments.py``).
:func:`stage_functions` gives a stage's forward and backward jaxprs at a
size (with the layers checkpointed under the method's ``remat``);
:func:`home_specs` and :func:`update_leaf_specs` where each argument leaf
lives and in which spec, from the planner's choices (``StageChoice``).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from jax.extend.core import Jaxpr
from jax.sharding import PartitionSpec

from autopar.frontend.apply_segments import ApplyPartition, partition_apply
from autopar.frontend.pipeline import Context
from autopar.frontend.stages import (StageFunctions, StageProgram, forward_backward,
                                     instantiate_stage, stage_at, stage_program)

__all__ = ["Cut", "cut", "stage_functions", "stage_specs", "home_specs", "update_leaf_specs"]


@dataclasses.dataclass
class Cut:
  """``P`` cut into stages.

  Attributes:
    layers: per stage, its layers ``(first, last)``.
    ranges: per stage, the positions of ``P`` it covers.
    stages: per stage, its program.
    leaf_home: argument leaf -> the stage its array lives on (the first that
      reads it; the update's own state: the first whose update reads it).
    root_home: root -> the stage whose gradient of it is the gradient.
    final_stage: output of ``P`` -> the stage that makes it.
    apply: the update cut per stage.
  """
  layers: list[tuple[int, int]]
  ranges: list[tuple[int, int]]
  stages: list[StageProgram]
  leaf_home: dict[int, int]
  root_home: dict[int, int]
  final_stage: dict[int, int]
  apply: ApplyPartition

  @property
  def num_stages(self) -> int:
    return len(self.stages)


def cut(ctx: Context, layers: Sequence[tuple[int, int]]) -> Cut:
  """``P`` cut into stages of consecutive ``layers`` ((first, last) each)."""
  key = ("cut", tuple(layers))
  if key in ctx.cache:
    return ctx.cache[key]
  program = ctx.program
  ranges = [ctx.layer_range(a, b) for a, b in layers]
  stages = [stage_program(program, ctx.analysis, ranges, s) for s in range(len(ranges))]
  leaf_home: dict[int, int] = {}
  root_home: dict[int, int] = {}
  final_stage: dict[int, int] = {}
  for s, st in enumerate(stages):
    for k in st.roots:
      root_home.setdefault(k, s)
      leaf = program.roots[k].leaf
      if leaf is not None:
        leaf_home.setdefault(leaf, s)
    for leaf in st.leaves:
      leaf_home.setdefault(leaf, s)
    for j in st.finals:
      final_stage[j] = s
  for k, r in enumerate(program.roots):
    if r.leaf is not None:
      # A parameter no stage reads (its gradient is zero) lives on the last.
      root_home[k] = leaf_home.setdefault(r.leaf, len(stages) - 1)
  aj = ctx.apply.jaxpr
  nc, nl = ctx.num_consts, len(program.leaves)
  homes = {}
  for leaf, s in leaf_home.items():
    homes[aj.invars[nc + leaf]] = s
  grads = aj.invars[nc + nl:nc + nl + len(program.grad_roots)]
  for v, k in zip(grads, program.grad_roots, strict=True):
    homes[v] = root_home[k]
  reduced = aj.invars[nc + nl + len(program.grad_roots):]
  for r, v in enumerate(reduced):
    homes[v] = final_stage[program.num_seeded + r]
  donated = {j: aj.invars[nc + leaf] for j, leaf in ctx.donation.items()}
  apply = partition_apply(aj, homes, len(stages), donated)
  for v, s in apply.home.items():
    k = _leaf_of(aj, v, nc, nl)
    if k is not None:
      leaf_home.setdefault(k, s)
  out = Cut(layers=list(layers), ranges=ranges, stages=stages, leaf_home=leaf_home,
            root_home=root_home, final_stage=final_stage, apply=apply)
  ctx.cache[key] = out
  return out


def _leaf_of(apply_jaxpr, v, nc: int, nl: int) -> int | None:
  try:
    k = apply_jaxpr.invars.index(v)
  except ValueError:
    return None
  return k - nc if nc <= k < nc + nl else None


def stage_functions(ctx: Context, st: StageProgram, rows: int) -> StageFunctions:
  """The stage's forward and backward passes as jaxprs at ``rows`` rows per
  micro-batch (``stages.StageFunctions``; cached in ``ctx``)."""
  key = ("functions", st.signature, rows, _remat_key(ctx.remat))
  if key not in ctx.cache:
    if ctx.program_at is None:
      g, draws, _ = instantiate_stage(st, rows)
    else:      # (traced at concrete sizes: P traced at these rows)
      g, draws = stage_at(st, ctx.program, ctx.program_at(rows)), st.draws
    groups = _layer_groups(ctx, st, g) if ctx.remat != "none" else None
    policy = None if ctx.remat in ("none", "layers") else ctx.remat
    ctx.cache[key] = forward_backward(st, g, draws, total_rows=ctx.batch,
                                      remat_groups=groups, policy=policy)
  return ctx.cache[key]


def _remat_key(remat):
  return remat if isinstance(remat, str) else id(remat)


def _layer_groups(ctx: Context, st: StageProgram, g: Jaxpr) -> list[tuple[int, int]]:
  """Equation ranges of ``g`` for the stage's layers (floating equations
  join the first), checkpointed one by one under ``remat``."""
  starts = [p for p in ctx.layers if st.lo < p < st.hi]
  # g's equations are P's (written out) in P's order, floating ones included:
  # split where P's layers start, counted in g's equations.
  eqns = st.jaxpr.eqns
  index = {id(e): i for i, e in enumerate(ctx.program.eqns)}
  pos = [index[id(e)] for e in eqns]
  bounds = [0]
  for p in starts:
    k = next((j for j, q in enumerate(pos) if q >= p and q not in
              ctx.analysis.floating), len(pos))
    if bounds[-1] < k < len(pos):
      bounds.append(k)
  # g has the equations of st.jaxpr minus the symbolic ones written out
  # (dim_as_value): map by counting the others.
  kept = [j for j, e in enumerate(eqns) if e.primitive.name != "dim_as_value"]
  where = {j: k for k, j in enumerate(kept)}
  gb = sorted({where.get(b, next((where[j] for j in kept if j >= b), len(kept)))
               for b in bounds})
  gb = [b for b in gb if b < len(g.eqns)]
  return [(a, b) for a, b in zip(gb, gb[1:] + [len(g.eqns)]) if a < b]



# -- where the leaves live ----------------------------------------------------------

def stage_specs(ctx, st, ch):
  """(argument leaf, spec, kind) of what stage ``st`` holds on its submesh:
  its roots that are argument leaves ("root"), the other leaves it reads
  ("leaf"; batch leaves split over its batch axes) and the leaves only its
  update reads ("update")."""
  program = ctx.program
  for k, spec in zip(st.roots, ch.root_specs, strict=True):
    leaf = program.roots[k].leaf
    if leaf is not None:
      yield leaf, spec, "root"
  for leaf, spec in zip(st.leaves, ch.leaf_specs, strict=True):
    if program.leaves[leaf].is_batch:
      spec = PartitionSpec(ch.batch_axes or None)
    yield leaf, spec, "leaf"
  for leaf, spec in update_leaf_specs(ctx, ch):
    yield leaf, spec, "update"


def home_specs(ctx, cut_, choices) -> dict[int, PartitionSpec]:
  """Argument leaf -> its spec on the stage it lives on (``cut_.leaf_home``)."""
  out: dict[int, PartitionSpec] = {}
  for s, (st, ch) in enumerate(zip(cut_.stages, choices, strict=True)):
    for leaf, spec, _ in stage_specs(ctx, st, ch):
      if cut_.leaf_home.get(leaf) == s:
        out.setdefault(leaf, spec)
  return out


def update_leaf_specs(ctx, ch):
  """(argument leaf, spec) of the leaves only the stage's update reads
  (optimizer state), as its plan gives them."""
  aj = ctx.apply.jaxpr
  nc, nl = ctx.num_consts, len(ctx.program.leaves)
  index = {v: k - nc for k, v in enumerate(aj.invars) if nc <= k < nc + nl}
  return [(index[v], spec) for v, spec in ch.update_specs.items() if v in index]
