"""Submeshes: the sub-blocks of the mesh that stages run on.

A submesh is a block of consecutive devices in the mesh's row-major order
whose shape is ``(1, ..., 1, c, a[j+1], ..., a[k])`` for a mesh of shape
``a``, with ``c`` dividing ``a[j]``: a slice of the outer axes and all of
the inner ones (Alpa's submesh shapes; inner axes are the fast links, the
devices of one host). Stages take consecutive blocks: stage 0 starts at
device 0, each next stage where the one before ends.

The link between two consecutive stages is the outermost mesh axis whose
index changes between the last device of one and the first of the next:
activations cross it (``link_axis``).
"""

from __future__ import annotations

import math
from typing import Sequence

from autopar.errors import InputError

__all__ = ["block_shapes", "tile", "link_axis", "block_shape_of"]


def block_shapes(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
  """Every submesh shape of a mesh of ``mesh_shape``, smallest first."""
  k = len(mesh_shape)
  out = set()
  for j in range(k):
    for c in range(1, mesh_shape[j] + 1):
      if mesh_shape[j] % c == 0:
        out.add((1,) * j + (c,) + tuple(mesh_shape[j + 1:]))
  return sorted(out, key=lambda s: (math.prod(s), s))


def block_shape_of(mesh_shape: Sequence[int], devices: int) -> tuple[int, ...] | None:
  """The submesh shape of ``devices`` devices, or None if there is none."""
  for s in block_shapes(mesh_shape):
    if math.prod(s) == devices:
      return s
  return None


def fits(mesh_shape: Sequence[int], offset: int, shape: Sequence[int]) -> bool:
  """Whether a block of ``shape`` can start at flattened ``offset``."""
  if tuple(shape) not in block_shapes(mesh_shape):
    return False
  size = math.prod(shape)
  j = next((i for i, d in enumerate(shape) if d != 1), len(shape) - 1)
  span = math.prod(mesh_shape[j:])            # devices under one index of axes < j
  inner = math.prod(mesh_shape[j + 1:])
  return offset % inner == 0 and offset % span + size <= span and \
      offset + size <= math.prod(mesh_shape)


def tile(mesh_shape: Sequence[int], shapes: Sequence[Sequence[int]]) -> list[int]:
  """Where each stage's submesh starts (flattened device offsets), for
  ``shapes`` placed one after another; an ``InputError`` if they do not
  tile the mesh."""
  mesh_shape = tuple(mesh_shape)
  offsets, at = [], 0
  for s, shape in enumerate(shapes):
    shape = tuple(shape)
    if len(shape) != len(mesh_shape):
      raise InputError(
          f"PipeshardParallel: stage_mesh_shapes[{s}] = {shape} has rank "
          f"{len(shape)}, the mesh {mesh_shape} rank {len(mesh_shape)}. Fix: give "
          f"each stage a shape of the mesh's rank, e.g. {block_shapes(mesh_shape)[-2:]}.")
    if not fits(mesh_shape, at, shape):
      raise InputError(
          f"PipeshardParallel: stage_mesh_shapes {list(map(tuple, shapes))} do not "
          f"tile the mesh {mesh_shape}: stage {s}'s {shape} cannot start at device "
          f"{at} (submeshes are consecutive blocks (1, .., c, rest of the mesh), "
          f"one after another in row-major order). Fix: use shapes from "
          f"{block_shapes(mesh_shape)} that add up to the mesh, e.g. "
          f"{[block_shape_of(mesh_shape, math.prod(mesh_shape) // len(shapes))] * len(shapes)}.")
    offsets.append(at)
    at += math.prod(shape)
  if at != math.prod(mesh_shape):
    raise InputError(
        f"PipeshardParallel: stage_mesh_shapes {list(map(tuple, shapes))} cover {at} "
        f"of the mesh's {math.prod(mesh_shape)} devices. Fix: give shapes whose "
        f"devices add up to the whole mesh {mesh_shape}.")
  return offsets


def link_axis(mesh_shape: Sequence[int], names: Sequence[str], offset: int) -> str | None:
  """The mesh axis the link between device ``offset - 1`` and ``offset``
  crosses (the outermost whose index changes); None at 0."""
  if offset <= 0:
    return None
  a, b = offset - 1, offset
  for j, name in enumerate(names):
    inner = math.prod(mesh_shape[j + 1:])
    if a // inner != b // inner:
      return name
  return names[-1]
