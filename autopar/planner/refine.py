"""Colour refinement: which nodes of a graph have the same neighbourhood.

The ILP (``ilp.py``) gives the nodes of one colour one set of variables, so
that the layers of a deep model, which trace to the same equations, are
decided once (see ``ShardingProblem._classes``).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["refine_colors"]


def _mix(x):
  """splitmix64's finaliser: a well-spread 64-bit hash of each element."""
  x = x + np.uint64(0x9E3779B97F4A7C15)
  x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return x ^ (x >> np.uint64(31))


def refine_colors(color: Sequence[int], edges: Sequence[tuple[int, int, int, int]],
                  rounds: int) -> list[int]:
  """Colour refinement (1-WL) of a graph whose edges are ``(src, dst, src
  output position, dst operand position)``.

  Each round a node's new colour is its colour with the multisets of
  (producer colour, positions) and (consumer colour, positions); it stops
  after ``rounds`` rounds or when no class splits. A multiset is summed as
  64-bit hashes, so it runs as a few numpy passes over the edges (the
  planner calls it on graphs of ~10^5 edges); two different neighbourhoods
  would get one colour only if their hash sums collided (~2^-64).
  """
  color = np.unique(np.asarray(color, np.int64), return_inverse=True)[1]
  if not len(edges) or not len(color):
    return color.tolist()
  src, dst, spos, dpos = (np.asarray(c, np.int64).astype(np.uint64)
                          for c in zip(*edges))
  pos = _mix(_mix(spos) + dpos)
  n = len(color)
  count = len(np.unique(color))
  for _ in range(rounds):
    c = color.astype(np.uint64)
    into = np.zeros(n, np.uint64)
    outof = np.zeros(n, np.uint64)
    np.add.at(into, dst, _mix(_mix(c[src]) ^ pos))
    np.add.at(outof, src, _mix(_mix(c[dst] + np.uint64(1)) ^ pos))
    sig = np.stack([c, into, outof], axis=1)
    _, new = np.unique(sig, axis=0, return_inverse=True)
    new = new.reshape(-1)
    new_count = int(new.max()) + 1
    if new_count == count:
      break                          # stable: no class split this round
    color, count = new, new_count
  return color.tolist()
