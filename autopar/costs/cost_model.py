"""α-β cost of collectives on a device mesh, and bytes per device.

A collective over mesh axes ``A`` (``p = prod(mesh[a] for a in A)`` devices)
moving an operand of ``b`` bytes per device costs, with ring algorithms,

=================  ==========================================
all-reduce         ``α·2(p-1) + β·2b(p-1)/p``
all-gather         ``α·(p-1) + β·b(p-1)``   (b = input bytes per device)
reduce-scatter     ``α·(p-1) + β·b(p-1)/p`` (b = input bytes per device)
all-to-all         ``α·(p-1) + β·b(p-1)/p``
=================  ==========================================

``α`` (latency, seconds) and ``β`` (seconds per byte) are per mesh axis. A
collective over several axes uses the slowest axis's α and β, since a ring
over them crosses that axis. By default they come from the device kind
(``devices.py``: an axis that spans hosts costs the network's numbers, one
inside a host the node's links; the CPU kind, and an AbstractMesh with no
kind named, treat all axes alike); they can be given per axis by hand (see
``docs/planner.md``, "Costs: setting α and β for a real cluster").

The same formulas give "bytes each device sends per step" when α = 0 and
β = 1, which is how tests and benchmarks read communication from HLO.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Mapping, Sequence

import jax.numpy as jnp
import numpy as np

__all__ = ["MeshCost", "bytes_per_device", "num_bytes", "itemsize", "dtype_name",
           "dtype_flop_seconds",
           "COLLECTIVE_KINDS"]

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                    "collective-permute")

DEFAULT_ALPHA = 1e-6      # 1 us per ring step
DEFAULT_BETA = 1e-10      # 10 GB/s


def itemsize(dtype) -> int:
  """Bytes per element of ``dtype``: a numpy/JAX dtype or its name.

  Handles ml_dtypes names ("bfloat16") and JAX's extended dtypes such as
  PRNG keys ("key<fry>": two uint32 words).
  """
  if not isinstance(dtype, str):
    return int(dtype.itemsize)
  try:
    return int(np.dtype(dtype).itemsize)
  except TypeError:
    pass
  try:
    return int(jnp.dtype(dtype).itemsize)
  except TypeError:
    if dtype.startswith("key<"):
      return 8
    raise


@functools.lru_cache(maxsize=None)
def dtype_name(dtype) -> str:
  """A dtype's name as plans store it ("float32", "bfloat16", "key<fry>")."""
  return str(dtype)    # cached: numpy's dtype __str__ is slow, and plans call it per value


def num_bytes(shape: Sequence[int], dtype) -> int:
  return int(math.prod(shape)) * itemsize(dtype)


def bytes_per_device(shape: Sequence[int], dtype, spec: Sequence,
                     axis_sizes: Mapping[str, int]) -> int:
  """Bytes one device holds of an array of ``shape`` sharded as ``spec``."""
  local = list(shape)
  for d, entry in enumerate(spec):
    for a in _axes(entry):
      local[d] = -(-local[d] // axis_sizes[a])
  return num_bytes(local, dtype)


def _axes(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  if isinstance(entry, str):
    return (entry,)
  return tuple(entry)


@dataclasses.dataclass(frozen=True)
class MeshCost:
  """α-β collective costs on one mesh.

  Args:
    axis_sizes: mesh axis name -> number of devices along it.
    alpha, beta: mesh axis name -> latency (s) and inverse bandwidth (s/byte);
      axes not given get the defaults.
  """
  axis_sizes: Mapping[str, int]
  alpha: Mapping[str, float] = dataclasses.field(default_factory=dict)
  beta: Mapping[str, float] = dataclasses.field(default_factory=dict)

  def group_size(self, axes: Sequence[str]) -> int:
    return int(math.prod(self.axis_sizes[a] for a in axes))

  def _ab(self, axes: Sequence[str]) -> tuple[float, float]:
    a = max((self.alpha.get(x, DEFAULT_ALPHA) for x in axes), default=0.0)
    b = max((self.beta.get(x, DEFAULT_BETA) for x in axes), default=0.0)
    return a, b

  def collective(self, kind: str, nbytes: float, axes: Sequence[str]) -> float:
    """Seconds for collective ``kind`` on ``nbytes`` per device over ``axes``."""
    p = self.group_size(axes)
    if p <= 1 or nbytes == 0:
      return 0.0
    a, b = self._ab(axes)
    if kind == "all-reduce":
      return 2 * (p - 1) * a + b * 2 * nbytes * (p - 1) / p
    if kind == "all-gather":
      return (p - 1) * a + b * nbytes * (p - 1)
    if kind == "reduce-scatter":
      return (p - 1) * a + b * nbytes * (p - 1) / p
    if kind == "all-to-all":
      return (p - 1) * a + b * nbytes * (p - 1) / p
    if kind == "collective-permute":          # each device sends its shard once
      return a + b * nbytes
    raise ValueError(f"unknown collective kind {kind!r}; one of {COLLECTIVE_KINDS}")

  def latency(self, kind: str, axes: Sequence[str]) -> float:
    """The α part of :meth:`collective` (its ring steps' latency)."""
    p = self.group_size(axes)
    if p <= 1:
      return 0.0
    steps = {"all-reduce": 2 * (p - 1), "collective-permute": 1}.get(kind, p - 1)
    return steps * self._ab(axes)[0]

  def all_reduce(self, nbytes: float, axes: Sequence[str]) -> float:
    return self.collective("all-reduce", nbytes, axes)

  def all_gather(self, nbytes: float, axes: Sequence[str]) -> float:
    return self.collective("all-gather", nbytes, axes)

  def reduce_scatter(self, nbytes: float, axes: Sequence[str]) -> float:
    return self.collective("reduce-scatter", nbytes, axes)

  def all_to_all(self, nbytes: float, axes: Sequence[str]) -> float:
    return self.collective("all-to-all", nbytes, axes)


def dtype_flop_seconds(rates: Mapping[str, float], dtype: str | None,
                       default: float) -> float:
  """Seconds per flop of work in ``dtype`` from ``rates`` (dtype name ->
  seconds per flop; None: float32, the vector units' rate for element-wise
  work); "tfloat32" falls back to float32's where the device has no TF32
  tensor cores, and a dtype without a rate to ``default``."""
  name = "float32" if dtype is None else str(dtype)
  if name == "tfloat32" and name not in rates:
    name = "float32"
  return float(rates.get(name, default))


def assumed_costs(axis_sizes: Mapping[str, int], option=None) -> dict:
  """The costs a plan assumed, per mesh axis (defaults filled in): what
  ``Plan.costs`` records for a person to read and question."""
  alpha = dict(getattr(option, "alpha", None) or {})
  beta = dict(getattr(option, "beta", None) or {})
  budget = getattr(option, "memory_budget_per_device", None)
  return {"seconds_per_flop": float(getattr(option, "flop_seconds", 1e-12)),
          "seconds_per_byte": float(getattr(option, "byte_seconds", 2e-11)),
          "alpha": {a: float(alpha.get(a, DEFAULT_ALPHA)) for a in axis_sizes},
          "beta": {a: float(beta.get(a, DEFAULT_BETA)) for a in axis_sizes},
          "memory_budget_per_device": None if budget is None else float(budget),
          "device_kind": getattr(option, "device_kind", None),
          "seconds_per_flop_by_dtype": dict(
              getattr(option, "seconds_per_flop_by_dtype", None) or {})}


def ring_bytes_sent(kind: str, operand_bytes: float, group: int) -> float:
  """Bytes one device sends for a collective, by the ring formulas.

  ``operand_bytes`` is the per-device operand size as it appears in HLO (the
  input of all-reduce, reduce-scatter and all-to-all; the *input* of
  all-gather, i.e. one shard).
  """
  if group <= 1:
    return 0.0
  if kind == "all-reduce":
    return 2 * operand_bytes * (group - 1) / group
  if kind == "all-gather":
    return operand_bytes * (group - 1)
  if kind == "reduce-scatter":
    return operand_bytes * (group - 1) / group
  if kind == "all-to-all":
    return operand_bytes * (group - 1) / group
  if kind == "collective-permute":
    return operand_bytes
  raise ValueError(f"unknown collective kind {kind!r}")
