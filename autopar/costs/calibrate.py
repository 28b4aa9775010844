"""Measured costs: ``autopar.calibrate(mesh)``.

Times all-reduce, all-gather, reduce-scatter and all-to-all along every mesh
axis (each operand size from ``min_bytes`` to ``max_bytes`` per device, by
powers of 4) and a large matmul per dtype on one device, fits the cost
model's α (seconds per ring step) and β (seconds per byte) per axis by least
squares over every kind and size (the formulas of ``cost_model.py``), and
keeps the result on disk (``$AUTOPAR_CACHE_DIR/calibration``, default
``~/.cache/autopar``) under the device kind, the mesh and the process count,
so the second call reads it. ``AutoShardingOption(costs="measured")`` plans
with it (``measured_option``); α and β given by hand still win per axis.

On simulated CPU devices the sizes stop at 4 MiB per device by default (all
eight "devices" share this machine's memory); on accelerators at 256 MiB.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P

from autopar.disk import cache_root, write_atomic
from autopar.errors import InputError, PlanError

__all__ = ["Calibration", "calibrate", "cached_calibration", "measured_option"]

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")
CALIBRATION_FORMAT = 1


@dataclasses.dataclass(frozen=True)
class Calibration:
  """What ``calibrate`` measured on one mesh.

  Attributes:
    device_kind: the devices' kind (``jax.Device.device_kind``).
    mesh_shape, axis_names: the mesh.
    alpha, beta: per mesh axis (of size > 1), the fitted seconds per ring
      step and seconds per byte.
    seconds_per_flop: per dtype, one device's time per flop of a large matmul.
    memory_bandwidth: bytes per second one device reads and writes of a large
      element-wise operation (None in calibrations made before it was
      measured).
    samples: (axis, kind, bytes per device, seconds) of every timing.
    cached: whether this came from the disk cache.
  """
  device_kind: str
  mesh_shape: tuple[int, ...]
  axis_names: tuple[str, ...]
  alpha: Mapping[str, float]
  beta: Mapping[str, float]
  seconds_per_flop: Mapping[str, float]
  memory_bandwidth: float | None = None
  samples: tuple[tuple[str, str, int, float], ...] = ()
  cached: bool = False

  def to_json(self) -> str:
    d = dataclasses.asdict(self)
    d.pop("cached")
    d["format"] = CALIBRATION_FORMAT
    return json.dumps(d, indent=1)

  @classmethod
  def from_json(cls, text: str) -> "Calibration":
    d = json.loads(text)
    if d.pop("format", None) != CALIBRATION_FORMAT:
      raise ValueError("calibration format")
    return cls(device_kind=d["device_kind"], mesh_shape=tuple(d["mesh_shape"]),
               axis_names=tuple(d["axis_names"]), alpha=dict(d["alpha"]),
               beta=dict(d["beta"]), seconds_per_flop=dict(d["seconds_per_flop"]),
               memory_bandwidth=d.get("memory_bandwidth"),
               samples=tuple(tuple(s) for s in d["samples"]), cached=True)


def _cache_path(device_kind: str, shape, names, processes: int) -> Path:
  safe = "".join(c if c.isalnum() else "_" for c in device_kind)
  mesh = "x".join(map(str, shape)) + "-" + "-".join(names)
  return cache_root() / "calibration" / f"{safe}-{mesh}-p{processes}.json"


def cached_calibration(device_kind: str, mesh_shape: Sequence[int],
                       axis_names: Sequence[str], processes: int = 1) -> Calibration | None:
  """The calibration kept on disk for this device kind and mesh, if any."""
  path = _cache_path(device_kind, tuple(mesh_shape), tuple(axis_names), processes)
  try:
    return Calibration.from_json(path.read_text())
  except (OSError, ValueError, KeyError, TypeError):
    return None


def calibrate(mesh: Mesh, *, min_bytes: int = 1024, max_bytes: int | None = None,
              dtypes: Sequence[str] = ("float32", "bfloat16"), repeats: int = 5,
              cache: bool = True) -> Calibration:
  """Measures α and β per axis of ``mesh`` and seconds per flop per dtype
  (see the module docstring); read from the disk cache when there."""
  if not isinstance(mesh, Mesh):
    raise InputError(f"calibrate: mesh must be a jax.sharding.Mesh of real devices "
                     f"(got {type(mesh).__name__}); an AbstractMesh has none to time. "
                     f"Fix: calibrate on the cluster, e.g. calibrate(jax.make_mesh(...)).")
  devices = np.asarray(mesh.devices)
  kind = devices.flat[0].device_kind
  shape, names = tuple(mesh.axis_sizes), tuple(mesh.axis_names)
  if cache:
    hit = cached_calibration(kind, shape, names, jax.process_count())
    if hit is not None:
      return hit
  if max_bytes is None:
    max_bytes = 4 * 2**20 if devices.flat[0].platform == "cpu" else 256 * 2**20
  if min_bytes < 4 or max_bytes < min_bytes:
    raise InputError(f"calibrate: min_bytes={min_bytes}, max_bytes={max_bytes}; expected "
                     f"4 <= min_bytes <= max_bytes.")
  sizes = []
  b = min_bytes
  while b <= max_bytes:
    sizes.append(b)
    b *= 4
  samples = []
  alpha, beta = {}, {}
  for axis, p in zip(names, shape, strict=True):
    if p == 1:
      continue
    rows = []
    for kind_ in KINDS:
      for nbytes in sizes:
        t = _time_collective(mesh, axis, p, kind_, nbytes, repeats)
        samples.append((axis, kind_, nbytes, t))
        rows.append((kind_, nbytes, t))
    alpha[axis], beta[axis] = _fit(rows, p)
  flops = {d: _time_matmul(devices.flat[0], d, repeats) for d in dtypes}
  result = Calibration(device_kind=kind, mesh_shape=shape, axis_names=names,
                       alpha=alpha, beta=beta, seconds_per_flop=flops,
                       memory_bandwidth=_memory_bandwidth(devices.flat[0], repeats),
                       samples=tuple(samples))
  if cache:
    write_atomic(_cache_path(kind, shape, names, jax.process_count()), result.to_json())
  return result


def _coefficients(kind: str, nbytes: float, p: int) -> tuple[float, float]:
  """(multiplier of α, of β) in the cost model's formula for ``kind``."""
  if kind == "all-reduce":
    return 2 * (p - 1), 2 * nbytes * (p - 1) / p
  if kind == "all-gather":
    return p - 1, nbytes * (p - 1)
  return p - 1, nbytes * (p - 1) / p        # reduce-scatter, all-to-all


def _fit(rows, p: int) -> tuple[float, float]:
  """Least-squares α, β >= 0 over ``rows`` of (kind, bytes, seconds),
  relative errors weighted alike (small and large sizes both count)."""
  a = np.array([_coefficients(k, b, p) for k, b, _ in rows], dtype=np.float64)
  t = np.array([s for _, _, s in rows], dtype=np.float64)
  w = 1.0 / np.maximum(t, 1e-9)
  sol, *_ = np.linalg.lstsq(a * w[:, None], t * w, rcond=None)
  alpha, beta = (float(x) for x in sol)
  if alpha < 0:        # one parameter alone, the other pinned at zero
    alpha, beta = 0.0, float(np.sum(a[:, 1] * t * w**2) / np.sum((a[:, 1] * w)**2))
  if beta <= 0:
    beta, alpha = 1e-15, float(np.sum(a[:, 0] * t * w**2) / np.sum((a[:, 0] * w)**2))
  return alpha, beta


def _time_collective(mesh: Mesh, axis: str, p: int, kind: str, nbytes: int,
                     repeats: int) -> float:
  """Median seconds of one ``kind`` of ``nbytes`` per device along ``axis``."""
  n = max(p, (nbytes // 4) // p * p)          # float32 elements per device
  if kind == "all-reduce":
    body = lambda x: jax.lax.psum(x, axis)
  elif kind == "all-gather":
    body = lambda x: jax.lax.all_gather(x, axis, tiled=True)
  elif kind == "reduce-scatter":
    body = lambda x: jax.lax.psum_scatter(x, axis, tiled=True)
  else:
    body = lambda x: jax.lax.all_to_all(x, axis, 0, 0, tiled=True)
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P(axis),
                            check_vma=False))
  x = jax.device_put(jnp.ones((n * p,), jnp.float32), NamedSharding(mesh, P(axis)))
  return _median_seconds(f, x, repeats)


def _time_matmul(device, dtype: str, repeats: int) -> float:
  """Seconds per flop of a square matmul on ``device`` (side 1024 on a CPU,
  8192 on an accelerator)."""
  side = 1024 if device.platform == "cpu" else 8192
  a = jax.device_put(jnp.ones((side, side), dtype), device)
  return _median_seconds(jax.jit(lambda x: x @ x), a, repeats) / (2 * side**3)


def _memory_bandwidth(device, repeats: int) -> float:
  """Bytes per second of an element-wise ``x * 2 + 1`` on ``device`` (read
  once, written once; 64 MiB on a CPU, 1 GiB on an accelerator)."""
  n = (16 if device.platform == "cpu" else 256) * 2**20
  x = jax.device_put(jnp.ones((n,), jnp.float32), device)
  return 2 * 4 * n / _median_seconds(jax.jit(lambda v: v * 2 + 1), x, repeats)


def _median_seconds(f, x, repeats: int) -> float:
  """Median seconds of ``f(x)`` over ``repeats`` calls, after one to compile."""
  jax.block_until_ready(f(x))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(f(x))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def measured_option(option, mesh):
  """``option`` with ``costs="measured"`` resolved for ``mesh``: α, β and
  seconds per flop from its calibration (measured now for a mesh of real
  devices without one; a PlanError for an AbstractMesh without one). α and
  β the option gives by hand are kept."""
  if getattr(option, "costs", None) != "measured":
    return option
  if isinstance(mesh, AbstractMesh):
    kind = option.device_kind
    cal = None if kind is None else cached_calibration(
        kind, tuple(mesh.axis_sizes), tuple(mesh.axis_names))
    if cal is None:
      raise PlanError(
          f"AutoShardingOption(costs='measured'): no calibration on disk for "
          f"device_kind={kind!r} and mesh {dict(zip(mesh.axis_names, mesh.axis_sizes))}. "
          f"Fix: run autopar.calibrate(mesh) on the devices once (it is kept under "
          f"$AUTOPAR_CACHE_DIR/calibration), and give device_kind= for an AbstractMesh.")
  else:
    cal = calibrate(mesh)
  dtype = "float32" if "float32" in cal.seconds_per_flop else next(
      iter(cal.seconds_per_flop), None)
  return dataclasses.replace(
      option, costs=None, device_kind=cal.device_kind,
      mesh_alpha={**cal.alpha, **option.alpha}, mesh_beta={**cal.beta, **option.beta},
      seconds_per_flop=(cal.seconds_per_flop[dtype] if dtype else option.flop_seconds),
      seconds_per_flop_by_dtype=(
          option.seconds_per_flop_by_dtype if option.seconds_per_flop is not None
          or option.seconds_per_flop_by_dtype else dict(cal.seconds_per_flop)),
      memory_bandwidth=(option.memory_bandwidth or cal.memory_bandwidth))
