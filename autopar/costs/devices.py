"""Device kinds: the figures the cost model takes from the hardware.

Each :class:`DeviceKind` has its peak dense flop rate per dtype ("tfloat32":
the tensor cores' rate for float32 matmuls, which XLA's GPU backend runs as
TF32 at JAX's default precision), its memory
and memory bandwidth, and the bandwidth (per device, one direction) and
latency (per ring step) of the links inside a node and between nodes, with
the public source of the figures. ``AutoShardingOption(device_kind=...,
devices_per_host=...)`` names them for an ``AbstractMesh``; with real
devices autopar reads ``jax.Device.device_kind`` and which mesh axes cross
processes (hosts). :func:`hardware_costs` turns them into the planner's
α, β per axis and seconds per flop; α and β given by hand still win.

Latencies are not in the datasheets: 2 µs per ring step inside a node and
5 µs between nodes are this table's assumptions (NCCL's ring step on
NVLink and on InfiniBand is of that order), as are the TPU data-center
network figures. The CPU entry is the cost model's former defaults (1 µs,
10 GB/s, 1 TFLOP/s), kept for the simulated CPU devices of tests and
examples; it describes no real machine.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import numpy as np
from jax.sharding import Mesh

from autopar.errors import InputError

__all__ = ["DeviceKind", "DEVICE_KINDS", "device_kind", "axes_crossing_hosts",
           "hardware_costs", "hardware_option", "dominant_float_dtype", "platform_of"]

GB = 1e9


@dataclasses.dataclass(frozen=True)
class DeviceKind:
  """One kind of device (see the module docstring)."""
  name: str
  match: tuple[str, ...]            # lower-case substrings of jax's device_kind
  flops: Mapping[str, float]        # dtype -> peak dense FLOP/s
  memory: float                     # bytes per device
  memory_bandwidth: float           # bytes/s
  intra_bandwidth: float            # bytes/s per device, one direction, in a node
  intra_latency: float              # s per ring step
  inter_bandwidth: float            # bytes/s per device, between nodes
  inter_latency: float
  source: str

  def seconds_per_flop(self, dtype: str) -> float:
    """1 / peak rate for ``dtype`` (float32's for a dtype not listed)."""
    rate = self.flops.get(dtype) or self.flops.get("float32") or min(self.flops.values())
    return 1.0 / rate


_NV = "NVIDIA datasheet, dense (no sparsity); NVLink per GPU one direction; 400 Gb/s NIC per GPU"
DEVICE_KINDS: tuple[DeviceKind, ...] = (
    DeviceKind("H100", ("h100",), {"bfloat16": 989e12, "float16": 989e12,
                                   "float8_e4m3fn": 1979e12, "float32": 67e12,
                                   "tfloat32": 494.7e12},
               80e9, 3.35e12, 450 * GB, 2e-6, 50 * GB, 5e-6,
               "nvidia.com/en-us/data-center/h100 (H100 SXM5: 989 TFLOP/s BF16, 67 "
               "TFLOP/s FP32, 3.35 TB/s HBM3, NVLink 900 GB/s); " + _NV),
    DeviceKind("H200", ("h200",), {"bfloat16": 989e12, "float16": 989e12,
                                   "float8_e4m3fn": 1979e12, "float32": 67e12,
                                   "tfloat32": 494.7e12},
               141e9, 4.8e12, 450 * GB, 2e-6, 50 * GB, 5e-6,
               "nvidia.com/en-us/data-center/h200 (H200 SXM: 989 TFLOP/s BF16, 67 "
               "TFLOP/s FP32, 4.8 TB/s HBM3e, 141 GB, NVLink 900 GB/s); " + _NV),
    DeviceKind("A100", ("a100",), {"bfloat16": 312e12, "float16": 312e12,
                                   "float32": 19.5e12, "tfloat32": 156e12},
               80e9, 2.039e12, 300 * GB, 2e-6, 25 * GB, 5e-6,
               "nvidia.com/en-us/data-center/a100 (A100 80GB SXM: 312 TFLOP/s BF16, "
               "19.5 TFLOP/s FP32, 2,039 GB/s HBM2e, NVLink 600 GB/s; 200 Gb/s HDR "
               "NIC per GPU)"),
    DeviceKind("B200", ("b200",), {"bfloat16": 2250e12, "float16": 2250e12,
                                   "float8_e4m3fn": 4500e12, "float32": 75e12,
                                   "tfloat32": 1100e12},
               180e9, 8e12, 900 * GB, 2e-6, 50 * GB, 5e-6,
               "nvidia.com/en-us/data-center/dgx-b200 and HGX B200 (per GPU: 2.25 "
               "PFLOP/s dense BF16, 4.5 PFLOP/s dense FP8, 75 TFLOP/s FP32, 8 TB/s "
               "HBM3e, NVLink 5 1.8 TB/s); " + _NV),
    DeviceKind("TPU v4", ("tpu v4",), {"bfloat16": 275e12, "float32": 275e12 / 4},
               32 * 2**30, 1.228e12, 300 * GB, 2e-6, 25 * GB, 10e-6,
               "cloud.google.com/tpu/docs/v4 (275 TFLOP/s BF16, 32 GiB HBM2 at "
               "1,228 GB/s, ICI 2,400 Gbps per chip); FP32 as BF16/4 and the data-center "
               "network between slices are assumptions"),
    DeviceKind("TPU v5e", ("tpu v5 lite", "tpu v5e"), {"bfloat16": 197e12,
                                                      "int8": 394e12,
                                                      "float32": 197e12 / 4},
               16e9, 819e9, 200 * GB, 2e-6, 25 * GB, 10e-6,
               "cloud.google.com/tpu/docs/v5e (197 TFLOP/s BF16, 394 TOPS INT8, 16 GB "
               "HBM2 at 819 GB/s, ICI 1,600 Gbps per chip); FP32 and the data-center "
               "network are assumptions"),
    DeviceKind("TPU v5p", ("tpu v5p", "tpu v5"), {"bfloat16": 459e12, "int8": 918e12,
                                                 "float32": 459e12 / 4},
               95e9, 2.765e12, 600 * GB, 2e-6, 25 * GB, 10e-6,
               "cloud.google.com/tpu/docs/v5p (459 TFLOP/s BF16, 918 TOPS INT8, 95 GB "
               "HBM2e at 2,765 GB/s, ICI 4,800 Gbps per chip); FP32 and the data-center "
               "network are assumptions"),
    DeviceKind("CPU", ("cpu",), {"float32": 1e12, "bfloat16": 1e12},
               16e9, 50e9, 10 * GB, 1e-6, 10 * GB, 1e-6,
               "the cost model's former defaults (1 us, 10 GB/s, 1 TFLOP/s) for the "
               "simulated CPU devices of tests; not a measurement of any CPU"),
)


def device_kind(name: str) -> DeviceKind:
  """The table's entry for ``name`` (``"H100"``, or ``jax.Device.device_kind``
  such as ``"NVIDIA H100 80GB HBM3"``)."""
  low = name.lower()
  for k in DEVICE_KINDS:
    if low == k.name.lower() or any(m in low for m in k.match):
      return k
  raise InputError(f"AutoShardingOption(device_kind={name!r}): not a device kind autopar "
                   f"knows ({', '.join(k.name for k in DEVICE_KINDS)}). Fix: name one of "
                   f"those, or give mesh_alpha, mesh_beta and seconds_per_flop (or "
                   f"costs='measured' after autopar.calibrate).")


def platform_of(name: str | None) -> str:
  """The XLA platform ("cpu", "gpu", "tpu") of the device kind ``name``,
  whose fusion and layout rules the memory model applies (``liveness.py``).
  No kind named: "cpu", the platform of the default costs."""
  if name is None:
    return "cpu"
  kind = device_kind(name).name
  return "tpu" if kind.startswith("TPU") else "cpu" if kind == "CPU" else "gpu"


def axes_crossing_hosts(mesh, devices_per_host: int | None) -> tuple[str, ...]:
  """The mesh axes along which two devices lie on different hosts: read
  from the devices' processes for a real mesh; for an AbstractMesh, with
  ``devices_per_host`` devices per host in ``jax.devices()`` order (None:
  no axis crosses)."""
  names = tuple(mesh.axis_names)
  shape = tuple(mesh.axis_sizes)
  if isinstance(mesh, Mesh):
    hosts = np.vectorize(lambda d: d.process_index)(np.asarray(mesh.devices))
  else:
    if not devices_per_host:
      return ()
    hosts = (np.arange(math.prod(shape)) // devices_per_host).reshape(shape)
  out = []
  for i, name in enumerate(names):
    moved = np.moveaxis(hosts, i, 0)
    if shape[i] > 1 and np.any(moved != moved[:1]):
      out.append(name)
  return tuple(out)


def hardware_costs(kind: DeviceKind, mesh, devices_per_host: int | None,
                   dtype: str) -> tuple[dict, dict, float, tuple[str, ...]]:
  """(α per axis, β per axis, seconds per flop, axes crossing hosts) of
  ``kind`` on ``mesh``: an axis that crosses hosts gets the network's
  figures, the others the links inside a node."""
  crossing = axes_crossing_hosts(mesh, devices_per_host)
  alpha, beta = {}, {}
  for name in mesh.axis_names:
    inter = name in crossing
    alpha[name] = kind.inter_latency if inter else kind.intra_latency
    beta[name] = 1.0 / (kind.inter_bandwidth if inter else kind.intra_bandwidth)
  return alpha, beta, kind.seconds_per_flop(dtype), crossing


def dominant_float_dtype(dtypes_and_bytes: Sequence[tuple[str, int]]) -> str:
  """The floating dtype holding the most bytes (float32 if none)."""
  totals: dict[str, int] = {}
  for dtype, nbytes in dtypes_and_bytes:
    if "float" in dtype:
      totals[dtype] = totals.get(dtype, 0) + nbytes
  return max(totals, key=totals.get) if totals else "float32"


def hardware_option(option, mesh, dtype: str = "float32"):
  """``option`` with the costs of its device kind filled in for ``mesh``
  (the kind ``option.device_kind`` names, or that of a real mesh's
  devices): α and β per axis, and seconds per flop for ``dtype``; what the
  option gives by hand is kept. Unchanged for an AbstractMesh with no
  device kind named. Each dtype's 1 / peak rate goes in ``seconds_per_flop_by_dtype`` (unless
  ``seconds_per_flop`` is given by hand: it then prices every dtype)."""
  name = option.device_kind
  if name is None and isinstance(mesh, Mesh):
    name = np.asarray(mesh.devices).flat[0].device_kind
  if name is None:
    return option
  kind = device_kind(name)
  alpha, beta, spf, _ = hardware_costs(kind, mesh, option.devices_per_host, dtype)
  by_hand = option.seconds_per_flop is not None
  rates = option.seconds_per_flop_by_dtype if (
      by_hand or option.seconds_per_flop_by_dtype) else {
      d: 1.0 / r for d, r in kind.flops.items()}
  return dataclasses.replace(
      option, device_kind=kind.name, mesh_alpha={**alpha, **option.alpha},
      seconds_per_flop_by_dtype=rates,
      mesh_beta={**beta, **option.beta},
      seconds_per_flop=spf if option.seconds_per_flop is None else option.seconds_per_flop,
      memory_bandwidth=(kind.memory_bandwidth if option.memory_bandwidth is None
                        else option.memory_bandwidth))
