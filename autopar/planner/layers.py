"""Where the pipeline's layers start, and what the stage search weighs:
an equation's flops and a value's bytes in the pipeline program
(``program.Program``), for cutting it into layers of about equal work."""

from __future__ import annotations

import numpy as np

from autopar.costs.cost_model import itemsize
from autopar.errors import InputError
from autopar.frontend.program import Analysis, Program, find_cuts, sizer
from autopar.frontend.remat import find_layers
from autopar.frontend.retype import jaxprs_in
from autopar.costs.strategies.dot import dot_flops

__all__ = ["layer_starts", "eqn_flops", "value_bytes"]


def eqn_flops(eqn, size) -> float:
  """Rough flops of one equation (``size``: a function from a shape to its
  element count): a matmul's, or one per output element."""
  if eqn.primitive.name == "dot_general":
    lhs = size(eqn.invars[0].aval.shape, dims=True)
    out = size(eqn.outvars[0].aval.shape, dims=True)
    return float(dot_flops(lhs, out, eqn.params["dimension_numbers"][0][0]))
  total = 0.0
  for v in eqn.outvars:
    total += size(getattr(v.aval, "shape", ()))
  for sub in jaxprs_in(eqn):
    total += sum(eqn_flops(e, size) for e in sub.eqns)
  return total


def value_bytes(v, size) -> float:
  return size(getattr(v.aval, "shape", ())) * itemsize(v.aval.dtype)


def layer_starts(program: Program, analysis: Analysis, mode: str, *,
                 max_layers: int, rows: int) -> list[int]:
  """The positions where layers start (the first is 0).

  ``mode``: ``"manual"`` (the user's boundary markers) or ``"auto"`` (the
  starts of repeated blocks, else cuts of balanced flops).
  """
  ok, why = find_cuts(analysis)
  n = len(program.eqns)
  if mode == "manual":
    if not program.boundaries:
      raise InputError(
          f"{program.fn_name}: PipeshardParallel(layers='manual') but the loss "
          f"function calls autopar.mark_pipeline_boundary() nowhere at its top "
          f"level. Fix: mark the boundaries between layers, or use layers='auto'.")
    for c in program.boundaries:
      if not ok[c]:
        raise InputError(
            f"{program.fn_name}: a pipeline boundary (autopar.mark_pipeline_boundary, "
            f"before equation {c} of the forward pass) is where {why[c]}. Fix: move "
            f"the boundary to between two layers.")
    return [0, *program.boundaries]
  starts = []
  for stack in find_layers(program.jaxpr):
    starts.extend(stack.start + k * stack.length for k in range(stack.count))
  starts = sorted(s for s in set(starts) if 0 < s < n and ok[s])
  if len(starts) >= 1:
    return [0, *starts]
  return _balanced(program, ok, max_layers, rows)


def _balanced(program: Program, ok: list[bool], k: int, rows: int) -> list[int]:
  """Up to ``k`` layers of about equal flops, cut at valid positions."""
  size = sizer(rows)
  flops = np.array([eqn_flops(e, size) for e in program.eqns], dtype=float)
  cum = np.concatenate([[0.0], np.cumsum(flops)])
  total = cum[-1]
  valid = [p for p in range(1, len(program.eqns)) if ok[p]]
  if not valid or total <= 0 or k <= 1:
    return [0]
  starts = []
  for j in range(1, k):
    target = total * j / k
    p = min(valid, key=lambda q: abs(cum[q] - target))
    if p not in starts and (not starts or p > starts[-1]):
      starts.append(p)
  return [0, *starts]
