"""Moving a value from one stage's submesh to another's.

In one process this is ``jax.device_put``. Across processes (a Ray cluster's
host workers, joined by ``jax.distributed``) every process runs the same
schedule (JAX's multi-controller model) and :func:`move` is called by all of
them in the same order; a value crosses hosts by JAX's cross-host transfer
(the PJRT transfer server, started by each host worker with
``jax_cross_host_transfer_socket_address``): the sending host's devices
stream their shards straight to the receiving host's devices, and no value
passes through the driver.

JAX transfers across hosts only between shardings of the same layout over
the same number of devices, so :func:`move` sends:

* between submeshes of the same size: each shard as it is, to the
  destination devices arranged like the source's (the *wire* sharding),
  then reshards there, on the destination's devices alone;
* between submeshes of different sizes, each on one host: the value
  gathered on one device of the source, to one device of the destination,
  then spread there;
* from a mesh onto a part of it (the whole mesh onto a stage's submesh, as
  a restored checkpoint is): replicated over the mesh, then each device of
  the part keeps its block.

A process that holds none of a value's devices keeps a placeholder (a
global array with no shards of its own), as JAX's own multi-controller
arrays are.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from autopar.errors import PlanError

__all__ = ["move", "check_movable"]


def move(x, dst: NamedSharding):
  """``x`` with sharding ``dst`` (see the module docstring)."""
  if not isinstance(x, jax.Array) or not x.committed:
    # The same value on every process (a constant): each fills its own shards.
    return jax.device_put(x, dst)
  src = x.sharding
  if src == dst:
    return x
  if jax.process_count() == 1 or src.device_set == dst.device_set or (
      x.is_fully_addressable and dst.is_fully_addressable):
    return jax.device_put(x, dst)
  # (Raised by every process alike, before any of them sends.)
  check_movable(src.device_set, dst.device_set, what=f"a value of shape {x.shape}")
  here = jax.process_index()
  if here not in _processes(src) and here not in _processes(dst):
    return _placeholder(x, dst)
  src = _named(x)
  x = jax.device_put(x, src) if src != x.sharding else x
  if dst.device_set < src.device_set:
    return _onto_part(x, src, dst)
  if src.num_devices == dst.num_devices:
    wire = NamedSharding(_mesh(dst, src.mesh), src.spec)
    y = jax.device_put(x, wire)
    return y if wire == dst else jax.device_put(y, dst)
  one_src = SingleDeviceSharding(_first(src))
  one_dst = SingleDeviceSharding(_first(dst))
  g = _local(x, one_src)
  h = jax.device_put(g, one_dst)
  return _local(h, dst)


def check_movable(src_devices, dst_devices, what: str = "a value") -> None:
  """Raises PlanError unless :func:`move` can move values from
  ``src_devices`` to ``dst_devices``: across hosts, between sets of the
  same size, onto a part of the source, or between sets within one host
  each."""
  src, dst = set(src_devices), set(dst_devices)
  if len(src) == len(dst) or dst < src:
    return
  spans = [len({d.process_index for d in ds}) > 1 for ds in (src, dst)]
  if any(spans):
    raise PlanError(
        f"autopar: in the pipeline {what} moves from a submesh of {len(src)} devices "
        f"to one of {len(dst)}, and the {'first' if spans[0] else 'second'} spans "
        f"several hosts; across hosts autopar moves values between submeshes of the "
        f"same size, or between submeshes within one host each. Fix: give the "
        f"stages submeshes of the same size (stage_mesh_shapes=...), or each "
        f"within one host.")


def _onto_part(x, src: NamedSharding, dst: NamedSharding):
  """``x`` onto ``dst``, whose devices are some of ``src``'s (an array on
  the whole mesh, such as a restored checkpoint, onto a stage's submesh):
  replicated over ``src`` (a collective of every process holding part of
  it), then each of ``dst``'s devices keeps its block."""
  full = jax.device_put(x, NamedSharding(src.mesh, PartitionSpec()))
  on = {s.device: s.data for s in full.addressable_shards}
  blocks = dst.addressable_devices_indices_map(x.shape)
  return jax.make_array_from_single_device_arrays(
      x.shape, dst, [on[d][index] for d, index in blocks.items()], dtype=x.dtype)


def _local(x, dst):
  """``x`` resharded onto ``dst`` by the one process that holds both; a
  placeholder on the others."""
  if x.is_fully_addressable and dst.is_fully_addressable:
    return jax.device_put(x, dst)
  return _placeholder(x, dst)


def _placeholder(x, dst):
  """An array like ``x`` on ``dst`` with no shards on this process."""
  return jax.make_array_from_single_device_arrays(x.shape, dst, [], dtype=x.dtype)


def _named(x) -> NamedSharding:
  """``x``'s sharding as a NamedSharding (a single device: a mesh of one;
  another kind: replicated over its devices)."""
  s = x.sharding
  if isinstance(s, NamedSharding) and isinstance(s.mesh, Mesh):
    return s
  devices = sorted(s.device_set, key=lambda d: d.id)
  if isinstance(s, SingleDeviceSharding) or len(devices) == 1:
    return NamedSharding(Mesh(np.array(devices), ("_one",)), PartitionSpec())
  return NamedSharding(Mesh(np.array(devices), ("_all",)), PartitionSpec())


def _mesh(dst: NamedSharding, like: Mesh) -> Mesh:
  """``dst``'s devices (in their mesh order) arranged as ``like``."""
  devices = np.asarray(dst.mesh.devices).reshape(-1)
  return Mesh(devices.reshape(like.devices.shape), like.axis_names)


def _processes(s) -> set[int]:
  return {d.process_index for d in s.device_set}


def _first(s: NamedSharding):
  return np.asarray(s.mesh.devices).reshape(-1)[0]
