"""The Ray actor that owns one host's devices (see ``cluster.py``).

Every host worker runs in its own process, joins the others with
``jax.distributed.initialize`` (gloo collectives on CPU), and runs the same
SPMD program on its own shards (JAX's multi-controller model). Arrays stay
here, in ``self.arrays`` under ids the driver assigns; the driver holds
:class:`~autopar.runtime.cluster.RemoteArray` handles to them.

Only plain data crosses to and from the driver: numpy shards, pickled
functions, plan JSON, shapes and dtypes.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from autopar.runtime import checkpoint
from autopar.errors import InputError
from autopar.plan import Plan
from autopar.frontend.pytrees import partition
from autopar.runtime.shards import normalize_index


def pickled(cache: dict, key, value, owner=None) -> bytes:
  """``cloudpickle.dumps(value)``, kept in ``cache`` under ``key`` (and, if
  ``owner`` is not None, only while ``owner`` is the object it was made for).

  A step's method and its argument and output structures are the same from
  step to step, and a TrainState's treedef pickles its apply_fn and
  optimizer: milliseconds each call, on the driver and on every worker. A
  key that cannot be hashed (a treedef with unhashable node data) is pickled
  every time.
  """
  from ray import cloudpickle
  try:
    hit = cache.get(key)
  except TypeError:
    return cloudpickle.dumps(value)
  if hit is not None and (owner is None or hit[0] is owner):
    return hit[1]
  data = cloudpickle.dumps(value)
  cache[key] = (owner, data)
  return data


class HostWorker:
  """One per host. Methods are called by the driver, in the same order on
  every worker (collectives need every process to run the same program)."""

  def __init__(self, host_index: int, num_devices: int | None, platform: str | None):
    self.host_index = host_index
    if platform == "cpu":
      os.environ["JAX_PLATFORMS"] = "cpu"
      os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                 f" --xla_force_host_platform_device_count="
                                 f"{num_devices or 1}").strip()
    self.arrays: dict[int, Any] = {}
    self.functions: dict[int, Any] = {}
    self.sources: dict[int, Any] = {}        # id -> a DataSource (data.py)
    self.trees: dict[str, Any] = {}
    self.tree_pickles: dict = {}            # see pickled
    self.mesh = None

  # -- start-up ------------------------------------------------------------------

  def address(self) -> tuple[str, int]:
    """This host's IP and a free port (host 0's is the coordinator's)."""
    import ray
    return ray.util.get_node_ip_address(), _free_port()

  def initialize(self, coordinator: str, num_hosts: int) -> dict:
    import jax
    import ray
    if os.environ.get("JAX_PLATFORMS") == "cpu":
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # Pipeline stages on different hosts send activations device to device
    # through JAX's transfer server (see runtime/transfer.py); it needs a
    # port of its own (port 0 is not published to the peers).
    jax.config.update("jax_cross_host_transfer_socket_address",
                      f"{ray.util.get_node_ip_address()}:{_free_port()}")
    jax.distributed.initialize(coordinator, num_processes=num_hosts,
                               process_id=self.host_index,
                               initialization_timeout=120)
    return {"process_index": jax.process_index(), "pid": os.getpid(),
            "local_devices": jax.local_device_count(),
            "devices": jax.device_count(),
            "platform": jax.devices()[0].platform,
            "device_processes": [d.process_index for d in jax.devices()],
            "device_ids": [int(d.id) for d in jax.devices()]}

  def ping(self) -> int:
    return self.host_index

  # -- arrays --------------------------------------------------------------------

  def _mesh(self, shape, names, offset: int = 0):
    """The mesh of ``shape`` over the global devices from ``offset`` on
    (the whole mesh, or a pipeline stage's submesh)."""
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh
    devices = np.array(jax.devices())[offset:offset + int(np.prod(shape))].reshape(shape)
    return Mesh(devices, tuple(names), axis_types=(AxisType.Auto,) * len(names))

  def put(self, array_id: int, shape, dtype, mesh_shape, mesh_names, spec,
          shards: dict, key_impl: str | None = None, offset: int = 0) -> None:
    """Builds a global array from this host's shards ({index: numpy block})
    on the mesh of ``mesh_shape`` from device ``offset``; with ``key_impl``,
    the blocks are key data, wrapped into PRNG keys."""
    import jax
    from jax.sharding import NamedSharding
    sharding = NamedSharding(self._mesh(mesh_shape, mesh_names, offset), spec)
    x = _global_array(shape, sharding, dtype, lambda idx: shards[
        normalize_index(idx, shape)].astype(dtype, copy=False))
    self.arrays[array_id] = jax.random.wrap_key_data(x, impl=key_impl) if key_impl else x

  def fetch(self, array_id: int) -> dict:
    """This host's shards of an array: {index: numpy block} (key data for a
    PRNG key array)."""
    import jax
    import numpy as np
    x = self._get(array_id)
    data = (lambda d: jax.random.key_data(d)) if _is_key(x) else (lambda d: d)
    return {normalize_index(s.index, x.shape): np.asarray(data(s.data))
            for s in x.addressable_shards}

  def delete(self, ids) -> None:
    for i in ids:
      x = self.arrays.pop(i, None)
      if x is not None and not x.is_deleted():
        x.delete()

  def _get(self, array_id: int):
    x = self.arrays.get(array_id)
    if x is None or x.is_deleted():
      raise InputError(f"autopar: array {array_id} on host {self.host_index} was "
                       f"donated to an earlier step or deleted. Fix: pass the "
                       f"state that step returned.")
    return x

  # -- running a step -----------------------------------------------------------------

  def register(self, fn_id: int, payload: bytes) -> None:
    """Keeps a step function: (the step's class, its function, its
    parallelize settings), cloudpickled; ``run`` makes the step from them."""
    from ray import cloudpickle
    self.functions[fn_id] = {"fun": cloudpickle.loads(payload), "by_plan": {}}

  def register_source(self, source_id: int, payload: bytes) -> None:
    """Keeps a DataSource (cloudpickled), whose loader runs here each step."""
    from ray import cloudpickle
    self.sources[source_id] = cloudpickle.loads(payload)

  def load_batches(self, loads, dropped=()) -> None:
    """Loads this host's rows of each data source's batch (``load``);
    first forgets the sources the driver let go."""
    self._drop_sources(dropped)
    for source_id, step, rows, entries in loads:
      self.load(source_id, step, rows, entries)

  def _drop_sources(self, ids) -> None:
    for i in ids:                     # data sources the driver let go
      self.sources.pop(i, None)

  def load(self, source_id: int, step: int, rows, entries) -> None:
    """Loads this host's rows of a DataSource's batch number ``step`` and
    makes its global arrays (``entries``: per leaf, (array id, leaf index,
    shape, dtype, mesh shape, mesh names, spec, device offset)); ``rows``
    is None on a host whose devices hold none of them."""
    import jax
    from jax.sharding import NamedSharding
    from autopar.runtime.data import HostShard, check_loaded
    source = self.sources[source_id]
    leaves = None
    if rows is not None:
      shard = HostShard(host=self.host_index, num_hosts=jax.process_count(),
                        rows=slice(*rows), step=step)
      leaves = check_loaded(source, source.load(shard), shard,
                            f"host {self.host_index}")
    for array_id, k, shape, dtype, mesh_shape, mesh_names, spec, offset in entries:
      sharding = NamedSharding(self._mesh(mesh_shape, mesh_names, offset), spec)

      def rows_of(idx, k=k, shape=shape):
        (a, b), *rest = normalize_index(idx, shape)
        return leaves[k][(slice(a - rows[0], b - rows[0]),) +
                         tuple(slice(lo, hi) for lo, hi in rest)]
      self.arrays[array_id] = _global_array(shape, sharding, dtype, rows_of)

  def run(self, fn_id: int, plan_key: str, plan_json: str | None,
          method_bytes: bytes, args_bytes: bytes, out_ids: list[int],
          small_bytes: int, puts=(), deletes=(), dropped=()) -> dict:
    """Runs the step on the global arrays; keeps its outputs under ``out_ids``.

    The plan (JSON, for ShardParallel and PipeshardParallel; the presets
    plan here) comes with the first call of each signature only; later
    calls name it by ``plan_key``.
    """
    from ray import cloudpickle
    import jax
    import numpy as np
    # One message per step: drop arrays the driver let go, take this call's
    # new input shards, run.
    self.delete(deletes)
    for p in puts:
      self.put(*p)
    self._drop_sources(dropped)
    entry = self.functions[fn_id]
    pf = entry["by_plan"].get(plan_key)
    if pf is None:
      factory, fun, kwargs = entry["fun"]
      method = cloudpickle.loads(method_bytes)
      mesh_shape, mesh_names = method.pop("mesh")
      cls = method.pop("cls")
      if plan_json is not None:
        method["plan"] = Plan.from_json(plan_json)
      pf = factory(fun, method=cls(mesh=self._mesh(mesh_shape, mesh_names), **method),
                   **kwargs)
      entry["by_plan"][plan_key] = pf
    # The argument structure comes once per distinct structure (keyed by its
    # pickle's hash) and is reused, so a TrainState's apply_fn stays the same
    # object from call to call and the compiled step is found again.
    tree_key, tree_bytes, leaves = cloudpickle.loads(args_bytes)
    if tree_bytes is not None:
      self.trees[tree_key] = cloudpickle.loads(tree_bytes)
    args = jax.tree.unflatten(self.trees[tree_key], [
        self._get(a.array_id) if isinstance(a, ArrayRef) else a for a in leaves])
    t0 = time.perf_counter()
    # The whole result: arguments changed in place go back to the driver,
    # which holds the objects to update.
    outs, _ = pf.run_here(*args)
    leaves, tree = partition(outs)
    # Not waited for: the call returns once the step is dispatched, so the
    # driver can send the next step while this one runs (JAX's asynchronous
    # dispatch, across the cluster). ``seconds`` is the dispatch's time.
    seconds = time.perf_counter() - t0
    info = []
    for i, x in zip(out_ids, leaves, strict=True):
      self.arrays[i] = x
      value, impl = None, None
      if _is_key(x):
        impl = str(jax.random.key_impl(x))
      elif (x.is_fully_replicated and x.nbytes <= small_bytes and x.addressable_shards
            and x.is_ready()):
        # A small value already computed comes back with the call; else the
        # driver fetches it when read (an output of a pipeline stage on
        # other hosts has no shards here).
        value = np.asarray(x.addressable_shards[0].data)
      info.append((tuple(x.shape), str(x.dtype), value, bool(jax.typeof(x).weak_type),
                   impl))
    # Donated inputs are gone; drop their ids.
    gone = [i for i, x in self.arrays.items() if x.is_deleted()]
    for i in gone:
      del self.arrays[i]
    return {"tree": pickled(self.tree_pickles, tree, tree), "leaves": info,
            "deleted": gone, "seconds": seconds}

  # -- checkpoints ---------------------------------------------------------------------

  def begin_checkpoint(self, path: str, tree_bytes: bytes) -> bool:
    """On one worker, before ``save_checkpoint``: whether the state is saved
    in the stage format (some array lies on part of the devices: a pipeline
    stage's; orbax refuses an array that one host of several holds whole),
    and if so its directory made (``checkpoint.begin_stage_save``)."""
    import jax
    tree = self._checkpoint_tree(tree_bytes)
    stages = any(len(x.sharding.device_set) != jax.device_count()
                 for x in jax.tree.leaves(tree))
    if stages:
      checkpoint.begin_stage_save(path, tree)
    return stages

  def save_checkpoint(self, path: str, tree_bytes: bytes, stages: bool) -> None:
    """Every worker: writes this host's shards (orbax, or the stage format)."""
    tree = self._checkpoint_tree(tree_bytes)
    if stages:
      checkpoint.write_stage_shards(path, tree)
    else:
      checkpoint.save_local(path, tree)

  def end_checkpoint(self, path: str, tree_bytes: bytes) -> None:
    """On one worker, after every ``save_checkpoint`` of the stage format."""
    checkpoint.end_stage_save(path, self._checkpoint_tree(tree_bytes))

  def _checkpoint_tree(self, tree_bytes: bytes):
    from ray import cloudpickle
    import jax
    return jax.tree.map(lambda a: self._get(a.array_id) if isinstance(a, ArrayRef) else a,
                        cloudpickle.loads(tree_bytes),
                        is_leaf=lambda a: isinstance(a, ArrayRef))

  def restore_checkpoint(self, path: str, target_bytes: bytes,
                         out_ids: list[int]) -> list[bool]:
    """Restores into global arrays (``target``: the tree and, per leaf,
    (shape, dtype, spec, mesh shape, mesh axis names, the mesh's device ids
    or None for the first devices, PRNG key impl or None)); returns whether
    each is weakly typed."""
    from ray import cloudpickle
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    tree, entries = cloudpickle.loads(target_bytes)
    by_id = {d.id: d for d in jax.devices()}
    shardings = []
    for _, _, spec, mesh_shape, names, ids, _ in entries:
      mesh = (self._mesh(mesh_shape, names) if ids is None else
              Mesh(np.array([by_id[i] for i in ids]).reshape(mesh_shape), tuple(names)))
      shardings.append(NamedSharding(mesh, spec))
    if checkpoint.is_stage_checkpoint(path):
      saved = checkpoint.stage_manifest(path)
      leaves = [checkpoint.read_stage_array(path, k, rec, s)
                for k, (rec, s) in enumerate(zip(saved, shardings, strict=True))]
    else:
      leaves = jax.tree.leaves(checkpoint.restore_local(path, jax.tree.unflatten(tree, [
          jax.ShapeDtypeStruct(e[0], e[1], sharding=s)
          for e, s in zip(entries, shardings, strict=True)])))
    weak = []
    for i, x in zip(out_ids, leaves, strict=True):
      self.arrays[i] = x
      weak.append(bool(jax.typeof(x).weak_type))
    return weak


def _global_array(shape, sharding, dtype, block):
  """The global array of ``sharding`` whose shard at each index of this
  host's devices is ``block(index)`` (none on a host that holds no part)."""
  import jax
  if not sharding.addressable_devices:     # (on other hosts' devices only)
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, [],
                                                    dtype=dtype)
  return jax.make_array_from_callback(tuple(shape), sharding, block, dtype=dtype)


def _free_port() -> int:
  s = socket.socket()
  s.bind(("", 0))
  port = s.getsockname()[1]
  s.close()
  return port


def _is_key(x) -> bool:
  import jax
  return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


class ArrayRef:
  """An array argument that is already on the workers (by id)."""

  def __init__(self, array_id: int):
    self.array_id = array_id
