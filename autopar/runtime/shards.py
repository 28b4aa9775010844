"""Which shards of an array each host of a Ray cluster holds.

The driver cuts each NumPy input into the blocks each host's devices hold
(:func:`host_shards`) and sends each host only its own; the host workers
name a shard by :func:`normalize_index`.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np
from jax.sharding import PartitionSpec

__all__ = ["normalize_index", "host_shards", "block"]


def normalize_index(index, shape) -> tuple[tuple[int, int], ...]:
  """A shard's index (a tuple of slices) as ((start, stop), ...)."""
  out = []
  for d, s in enumerate(shape):
    sl = index[d] if d < len(index) else slice(None)
    start, stop, _ = sl.indices(s)
    out.append((start, stop))
  return tuple(out)


def host_shards(shape, spec: PartitionSpec, mesh_shape, mesh_names,
                device_hosts: Sequence[int]) -> dict[int, set]:
  """host -> the indices ((start, stop) per dim) of the shards its devices hold.

  Devices fill the mesh in ``jax.devices()`` order; ``device_hosts[k]`` is
  the host of device ``k``.
  """
  entries = (list(spec) + [None] * len(shape))[:len(shape)]
  pos = {a: i for i, a in enumerate(mesh_names)}
  out: dict[int, set] = {}
  for flat, coord in enumerate(itertools.product(*[range(s) for s in mesh_shape])):
    index = []
    for d, entry in enumerate(entries):
      axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
      k, count = 0, 1
      for a in axes:
        k = k * mesh_shape[pos[a]] + coord[pos[a]]
        count *= mesh_shape[pos[a]]
      size = shape[d] // count
      index.append((k * size, (k + 1) * size))
    out.setdefault(device_hosts[flat], set()).add(tuple(index))
  return out


def block(array: np.ndarray, index) -> np.ndarray:
  """The block of ``array`` at ``index`` ((start, stop) per dim), a copy."""
  return np.array(array[tuple(slice(a, b) for a, b in index)], copy=True, order="C")
