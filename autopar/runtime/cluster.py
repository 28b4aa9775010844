"""Running the step on a Ray cluster: one actor per host, ``jax.distributed``
between them.

``autopar.init(cluster="ray", ...)`` starts (or joins) Ray, places one
:class:`~autopar.runtime.host_worker.HostWorker` actor per host (a placement group,
one bundle per host), and joins them into one JAX runtime with
``jax.distributed.initialize`` (gloo collectives on CPU). The driver only
plans, dispatches and collects:

* ``@parallelize`` plans on the driver (against the abstract global mesh,
  see :func:`global_mesh`), ships the function once, the plan once per input
  signature, and then per call only what is new: each host gets its own
  shards of numpy inputs (:func:`host_shards`), never the whole array.
* Every worker compiles the same executables and runs the same micro-batch
  loop on its shards (JAX's multi-controller model).
* Outputs stay on the workers; the driver gets :class:`RemoteArray` handles,
  which the next call passes back by id. ``np.asarray(x)`` /
  ``jax.device_get(x)`` fetch one (each host sends its shards); small
  replicated outputs (a loss) come back with the call.

Liveness is checked apart from how long a step takes. While a call is under
way the driver pings every host that has not answered yet, every few seconds,
on a thread of the worker's own (a Ray concurrency group), so a host that is
busy compiling or running a long step still answers. A host that dies, or
does not answer a ping within ``timeout`` seconds, makes the call raise
:class:`ClusterError` naming it; the cluster is then unusable until
``autopar.shutdown()`` and ``autopar.init(...)``. A step of living hosts is
waited for as long as it takes, unless ``init(step_timeout=...)`` sets a limit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
import os
import sys
import threading
import time
import weakref
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, PartitionSpec

from autopar.plan import spec_from_json
from autopar.runtime import base as runtime
from autopar.runtime import checkpoint, data
from autopar.errors import AutoparError, InputError, MeshError
from autopar.runtime.host_errors import ClusterError, raised_on_host
from autopar.runtime.hosts import connect_ray, host_layout
from autopar.runtime.host_worker import ArrayRef, HostWorker, pickled
from autopar.frontend.pytrees import leaf_mask
from autopar.runtime.shards import block, host_shards
from autopar.frontend.trace import split_updates

__all__ = ["init", "shutdown", "global_mesh", "current", "RemoteArray",
           "ClusterError", "RayCluster"]

_CURRENT: "RayCluster | None" = None
_LOCK = threading.Lock()
SMALL_BYTES = 1024     # replicated outputs up to this size come back with the call
LIVENESS = "liveness"  # the workers' concurrency group that answers pings


# -- public -----------------------------------------------------------------------

def init(cluster: str = "local", *, address: str | None = None,
         num_hosts: int | None = None, num_devices_per_host: int | None = None,
         num_devices: int | None = None, timeout: float = 30.0,
         step_timeout: float | None = None) -> None:
  """Chooses where parallelized steps run.

  Args:
    cluster: ``"local"`` (this process's devices; the default) or ``"ray"``.
    address: a Ray cluster to join (``"auto"`` or ``"host:port"``); None
      starts a local Ray instance, as on one machine.
    num_hosts: host workers to start (default: the cluster's alive nodes,
      or ``num_devices`` over the devices per host).
    num_devices_per_host: on machines without accelerators, simulated CPU
      devices per worker (default: ``num_devices`` over the hosts, or 1);
      with GPUs, GPUs per worker (default: the GPUs of a node).
    num_devices: the devices in all, e.g. the size of the mesh to come
      (``global_mesh((2, 4), ...)``: 8); the two above follow from it where
      not given (``autopar.runtime.hosts`` says how: on one CPU node, one
      host with that many devices).
    timeout: seconds a host may go without answering a liveness check before
      it is taken for dead (ClusterError naming it). A host that answers is
      waited for however long its step, or its first compile, takes.
    step_timeout: seconds one call (a step, a checkpoint) may take before
      ClusterError, even with every host alive; None (default): no limit.

  Example: ``autopar.init("ray", address="auto", num_devices=8)`` on a
  cluster started with ``ray start --head``, then
  ``autopar.global_mesh((2, 4), ("data", "model"))``.
  """
  global _CURRENT
  if cluster not in ("local", "ray"):
    raise InputError(f"autopar.init: cluster={cluster!r}; expected 'local' or 'ray'.")
  # The arguments first, whether or not a cluster is running.
  for name, value in (("num_hosts", num_hosts), ("num_devices", num_devices),
                      ("num_devices_per_host", num_devices_per_host)):
    if cluster == "ray" and value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or value < 1):
      raise InputError(f"autopar.init: {name}={value!r}; expected a positive int.")
  for name, value in (("timeout", timeout), ("step_timeout", step_timeout)):
    if cluster == "local" or (value is None and name == "step_timeout"):
      continue
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
      raise InputError(f"autopar.init: {name}={value!r}; expected a positive number "
                       f"of seconds{' or None' if name == 'step_timeout' else ''}.")
  with _LOCK:
    if _CURRENT is not None:
      raise ClusterError("autopar.init: a Ray cluster is already running. Fix: "
                         "call autopar.shutdown() first.")
    if cluster == "local":
      return
    c = RayCluster(address, num_hosts, num_devices_per_host, timeout, step_timeout,
                   num_devices)
    try:
      c.start()
    except BaseException:
      c.stop()
      raise
    _CURRENT = c
    runtime.activate(c)


def shutdown() -> None:
  """Ends the host workers, and the Ray instance if ``init`` started it."""
  global _CURRENT
  with _LOCK:
    c, _CURRENT = _CURRENT, None
  if c is not None:
    runtime.deactivate(c)
    c.stop()


def current() -> "RayCluster | None":
  """The running Ray cluster, or None (steps run in this process)."""
  return _CURRENT


def global_mesh(shape: Sequence[int], axis_names: Sequence[str]):
  """A mesh over every device of every host.

  Locally a ``jax.sharding.Mesh``; under a Ray cluster an ``AbstractMesh``
  (the driver has no devices of the cluster), which the workers turn into the
  real mesh (devices in ``jax.devices()`` order, so the first axis spans
  hosts).
  """
  shape, axis_names = tuple(shape), tuple(axis_names)
  if len(shape) != len(axis_names):
    raise MeshError(f"global_mesh: shape {shape} and axis_names {axis_names} differ "
                    f"in length.")
  c = current()
  total = c.num_devices if c is not None else jax.device_count()
  if math.prod(shape) != total:
    n = math.prod(shape)
    if c is None:
      raise MeshError(f"global_mesh: shape {shape} has {n} devices but this process has "
                      f"{total}. Fix: use a shape whose product is {total}.")
    # The cluster's size was chosen at init: say how to choose another.
    raise MeshError(
        f"global_mesh: shape {shape} has {n} devices but the Ray cluster has "
        f"{total} ({c.num_hosts} host(s) x {total // c.num_hosts} device(s)). Fix: "
        f"use a shape whose product is {total}, or start the cluster with {n} "
        f"devices: autopar.shutdown(), then autopar.init('ray', ..., num_devices={n}) "
        f"(num_hosts= or num_devices_per_host= choose how they split over hosts).")
  if c is not None:
    return AbstractMesh(shape, axis_names)
  return jax.make_mesh(shape, axis_names)


# -- handles ---------------------------------------------------------------------------

class RemoteArray:
  """An array that lives on the host workers (one global array, sharded).

  ``np.asarray(x)``, ``jax.device_get(x)``, ``float(x)`` bring it to the
  driver. Passing it to a parallelized step sends only its id.
  """

  def __init__(self, cluster: "RayCluster", array_id: int, shape, dtype, value=None,
               weak_type: bool = False, key_impl: str | None = None):
    self._cluster = cluster
    self.array_id = array_id
    self.shape = tuple(shape)
    # A PRNG key array (key_impl names its implementation) has a key dtype.
    self.key_impl = key_impl
    self.dtype = _key_dtype(key_impl) if key_impl else np.dtype(dtype)
    # As the workers' array has it: the driver plans the program the workers
    # trace (a weakly typed step counter traces to other equations).
    self.weak_type = bool(weak_type)
    self._value = value
    self.deleted = False
    weakref.finalize(self, cluster._forget, array_id)

  ndim = property(lambda self: len(self.shape))
  size = property(lambda self: int(math.prod(self.shape)))

  def __array__(self, dtype=None, copy=None):
    if self.key_impl:
      raise TypeError(f"{self!r} holds PRNG keys, which are no NumPy array. Fix: "
                      f"x.fetch() gives them as a JAX key array on this process.")
    if self._value is None:
      self._value = self._cluster.fetch(self)
    return self._value if dtype is None else self._value.astype(dtype)

  def fetch(self):
    """The array on this process: a NumPy array, or a JAX PRNG key array."""
    if self.key_impl:
      return jax.random.wrap_key_data(self._cluster.fetch(self), impl=self.key_impl)
    return np.asarray(self)

  def __float__(self):
    return float(np.asarray(self))

  def __int__(self):
    return int(np.asarray(self))

  def item(self):
    return np.asarray(self).item()

  def __repr__(self):
    return (f"RemoteArray(shape={self.shape}, dtype={self.dtype}, id={self.array_id}"
            f"{', deleted' if self.deleted else ''})")


def _key_dtype(impl: str):
  """The dtype of PRNG keys of implementation ``impl`` (e.g. "threefry2x32")."""
  return jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype


def _is_key(x) -> bool:
  return jax.dtypes.issubdtype(getattr(x, "dtype", None) or np.float32,
                               jax.dtypes.prng_key)


# -- the cluster -------------------------------------------------------------------------

class RayCluster(runtime.Runtime):
  """The Ray runtime: the host workers and how to reach them (made by
  :func:`init`; see ``base.py`` for the interface)."""

  def __init__(self, address, num_hosts, num_devices_per_host, timeout,
               step_timeout=None, num_devices=None):
    self.address = address
    self.num_hosts = num_hosts
    self.num_devices_per_host = num_devices_per_host
    self.wanted_devices = num_devices      # init's num_devices (None: not given)
    self.timeout = timeout
    self.step_timeout = step_timeout
    self.workers: list = []
    self.hosts: list[str] = []
    self.started_ray = False
    self.placement_group = None
    self.broken: str | None = None
    self._ids = itertools.count(1)
    self._functions: dict[Any, int] = {}        # step function -> fn id
    self._sent_plans: set = set()
    self._sent_trees: set = set()
    self._trees: dict[bytes, Any] = {}
    self._pickles: dict = {}          # see host_worker.pickled
    self._forgotten: list[int] = []
    # A step whose method has no mesh -> the same step on the cluster's mesh.
    self._variants = weakref.WeakKeyDictionary()
    # A data source -> its id on the workers; ids of sources let go, which
    # the workers drop with the next call.
    self._sources = weakref.WeakKeyDictionary()
    self._dropped_sources: list[int] = []
    self.bytes_sent = 0                          # numpy bytes shipped to workers
    # Bytes the last call sent each host: its arguments' message and the
    # NumPy shards (what grows with a batch that passes through the driver).
    self.last_call_bytes = 0

  # -- lifecycle ------------------------------------------------------------------

  def start(self) -> None:
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    if not ray.is_initialized():
      connect_ray(self.address, self.num_hosts)
      self.started_ray = True
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    layout = host_layout([n["Resources"].get("GPU", 0) for n in nodes],
                         num_hosts=self.num_hosts, num_devices=self.wanted_devices,
                         num_devices_per_host=self.num_devices_per_host)
    self.num_hosts, per_host, gpus = (layout.num_hosts, layout.devices_per_host,
                                      layout.gpus)
    platform = None if gpus else "cpu"
    bundle = {"CPU": 1, **({"GPU": per_host} if gpus else {})}
    strategy = "STRICT_SPREAD" if self.num_hosts <= len(nodes) and len(nodes) > 1 \
        else "PACK"
    self.placement_group = placement_group([bundle] * self.num_hosts, strategy=strategy)
    place_seconds = max(self.timeout, 60)
    if not _ray_wait(self.placement_group.ready(), place_seconds):
      raise ClusterError(
          f"autopar.init: Ray could not place {self.num_hosts} host worker(s) with "
          f"{bundle} each within {place_seconds:.0f} s (cluster resources: "
          f"{ray.cluster_resources()}). Fix: ask for fewer hosts or add nodes.")
    # Workers import autopar and the modules the step's code comes from:
    # give them the driver's import path (on a multi-machine cluster, use a
    # Ray runtime_env working_dir or install the code on every node).
    # (the directory holding the autopar package: this file is autopar/runtime/cluster.py)
    paths = [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))]
    paths += [p for p in sys.path if p and os.path.isdir(p)]
    env = {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}
    if platform == "cpu":
      env.update(JAX_PLATFORMS="cpu",
                 XLA_FLAGS=f"--xla_force_host_platform_device_count={per_host}")
      if self.num_hosts > len(nodes):
        # Several simulated hosts share a machine: one compute thread each,
        # instead of each taking every core.
        env["XLA_FLAGS"] += " --xla_cpu_multi_thread_eigen=false"
    # Pings run on a thread of their own, beside a long step.
    actor = ray.remote(concurrency_groups={LIVENESS: 1})(HostWorker)
    self.workers = [
        actor.options(num_cpus=1, num_gpus=(per_host if gpus else 0), max_restarts=0,
                      runtime_env={"env_vars": env},
                      scheduling_strategy=PlacementGroupSchedulingStrategy(
                          self.placement_group, placement_group_bundle_index=i)
                      ).remote(i, per_host, platform)
        for i in range(self.num_hosts)]
    addresses = self._call([w.address.remote() for w in self.workers], "start",
                           limit=max(self.timeout, 120), ping=False)
    self.hosts = [ip for ip, _ in addresses]
    coordinator = f"{addresses[0][0]}:{addresses[0][1]}"
    infos = self._call([w.initialize.remote(coordinator, self.num_hosts)
                        for w in self.workers], "jax.distributed.initialize",
                       limit=max(self.timeout, 180), ping=False)
    self.num_devices = infos[0]["devices"]
    self.platform = infos[0]["platform"]
    self.device_hosts = infos[0]["device_processes"]
    self.device_ids = infos[0]["device_ids"]
    self.pids = [i["pid"] for i in infos]

  def stop(self) -> None:
    import ray
    for w in self.workers:
      try:
        ray.kill(w)
      except Exception:   # noqa: BLE001 - already dead
        pass
    self.workers = []
    if self.placement_group is not None:
      try:
        ray.util.remove_placement_group(self.placement_group)
      except Exception:   # noqa: BLE001
        pass
    if self.started_ray and ray.is_initialized():
      ray.shutdown()

  # -- calls ------------------------------------------------------------------------

  def _call(self, refs: list, what: str, limit: float | None = None,
            ping: bool = True) -> list:
    """Results of one call per worker (``refs[i]`` is worker ``i``'s).

    Waits while every host that has not answered is alive: each is pinged
    every few seconds, and one that dies or leaves a ping unanswered for
    ``self.timeout`` seconds raises. ``limit``: seconds the whole call may
    take (default ``step_timeout``: none). ``ping=False``: no pings (workers
    still starting), so ``limit`` alone bounds the wait.
    """
    import ray
    if self.broken:
      raise ClusterError(f"autopar: the Ray cluster is unusable ({self.broken}). "
                         f"Fix: autopar.shutdown() then autopar.init(...).")
    limit = self.step_timeout if limit is None else limit
    index = {r: i for i, r in enumerate(refs)}
    results: dict[int, Any] = {}
    start = time.monotonic()
    interval = min(5.0, self.timeout / 4)
    pings: dict = {}                    # outstanding ping -> worker
    sent: dict[int, float] = {}         # worker -> when its outstanding ping went out
    answered: dict[int, float] = {}     # worker -> when it last answered one
    pending = list(refs)
    while pending:
      now = time.monotonic()
      if limit is not None and now - start > limit:
        silent = [index[r] for r in pending]
        self._fail(f"host(s) {', '.join(self._host(i) for i in silent)} did not "
                   f"finish {what} within {limit:.0f} s")
      waiting = {index[r] for r in pending}
      if ping:
        for i in sorted(waiting - set(sent)):
          if now - answered.get(i, -math.inf) >= interval:
            pings[self.workers[i].ping.options(concurrency_group=LIVENESS).remote()] = i
            sent[i] = now
        dead = [i for i, t in sent.items() if i in waiting and now - t > self.timeout]
        if dead:
          self._fail(f"host(s) {', '.join(self._host(i) for i in dead)} did not "
                     f"answer a liveness check within {self.timeout:.0f} s during "
                     f"{what}")
      wait = interval if limit is None else min(interval, max(0.0, start + limit - now))
      ready, _ = ray.wait(pending + list(pings), num_returns=1, timeout=wait)
      for r in ready:
        if r in pings:
          i = pings.pop(r)
          del sent[i]
          try:
            ray.get(r)
          except ray.exceptions.RayActorError as e:
            self._fail(f"host {self._host(i)} died during {what}: {_first_line(e)}")
          answered[i] = time.monotonic()
          continue
        pending.remove(r)
        i = index[r]
        try:
          results[i] = ray.get(r)
        except ray.exceptions.RayActorError as e:
          self._fail(f"host {self._host(i)} died during {what}: "
                     f"{_first_line(e)}")
        except ray.exceptions.RayTaskError as e:
          cause = e.cause if getattr(e, "cause", None) is not None else e
          # A host whose peer died fails in its collectives: if another host
          # died, that is the error to report.
          self._raise_if_a_host_died(pending, index, what)
          if isinstance(cause, AutoparError):
            raise cause
          # An exception in the step's own code: the cluster stays usable. (A
          # host left waiting in a collective is alive, so it is waited for:
          # step_timeout bounds such a wait.)
          raise raised_on_host(f"autopar: host {self._host(i)} raised in {what}: "
                               f"{type(cause).__name__}: {cause}\n--- the host's "
                               f"traceback ---\n{e}", cause) from cause
    return [results[i] for i in range(len(refs))]

  def _raise_if_a_host_died(self, pending, index, what, wait: float = 5.0):
    import ray
    deadline = time.monotonic() + wait
    pending = list(pending)
    while pending and time.monotonic() < deadline:
      ready, pending = ray.wait(pending, num_returns=1,
                                timeout=max(0.0, deadline - time.monotonic()))
      for r in ready:
        try:
          ray.get(r)
        except ray.exceptions.RayActorError as e:
          self._fail(f"host {self._host(index[r])} died during {what}: "
                     f"{_first_line(e)}")
        except Exception:   # noqa: BLE001 - another task error: reported by the caller
          pass

  def _host(self, i: int) -> str:
    ip = self.hosts[i] if i < len(self.hosts) else "?"
    return f"{i} ({ip})"

  def _fail(self, message: str):
    self.broken = message
    raise ClusterError(f"autopar: {message}. The cluster is unusable now. Fix: "
                       f"autopar.shutdown(), autopar.init(...), and restore the "
                       f"last checkpoint (autopar.restore_checkpoint).")

  def _forget(self, array_id: int) -> None:
    self._forgotten.append(array_id)

  def _drop_source(self, source_id: int) -> None:
    self._dropped_sources.append(source_id)

  # -- arrays -------------------------------------------------------------------------

  def _puts(self, array, spec: PartitionSpec, mesh_shape, mesh_names,
            offset: int = 0) -> tuple[int, list]:
    """A new array id, and per host the ``put`` arguments of its shards on
    the mesh of ``mesh_shape`` over the global devices from ``offset`` on.

    A PRNG key array travels as its key data (trailing dimensions unsplit)
    and is wrapped again on the workers."""
    array_id = next(self._ids)
    impl = None
    if _is_key(array):
      impl = str(jax.random.key_impl(array))
      array = np.asarray(jax.random.key_data(array))
    array = np.asarray(array)
    shape = tuple(array.shape)
    spec = PartitionSpec(*list(spec)[:len(shape)])   # (a scalar may carry P(None))
    mesh_shape, mesh_names = tuple(mesh_shape), tuple(mesh_names)
    shards = host_shards(shape, spec, mesh_shape, mesh_names,
                         self.device_hosts[offset:offset + math.prod(mesh_shape)])
    per_host = []
    for h in range(len(self.workers)):
      blocks = {idx: block(array, idx) for idx in shards.get(h, ())}
      self.bytes_sent += sum(b.nbytes for b in blocks.values())
      per_host.append((array_id, shape, array.dtype, mesh_shape, mesh_names, spec,
                       blocks, impl, offset))
    return array_id, per_host

  def _loads(self, loads: dict, mesh_names) -> tuple[list[list], list]:
    """What each host loads for this call, and (source, batch number) per
    source. A host's list has per data source (its id, the batch number, the
    span of rows the host's devices hold of any of its leaves or None, and
    per leaf (array id, leaf index, shape, dtype, mesh shape, mesh names,
    spec, device offset)). A source's loader goes to the workers the first
    time."""
    from ray import cloudpickle
    per_host: list[list] = [[] for _ in self.workers]
    steps = []
    for source, leaves in loads.items():
      source_id = self._sources.get(source)
      if source_id is None:
        try:
          payload = cloudpickle.dumps(source)
        except Exception as e:   # noqa: BLE001 - whatever the loader holds that cannot be
          raise InputError(      # pickled (an open file, a lock)
              f"autopar: the DataSource's load ({type(source.load).__name__}) cannot "
              f"be sent to the hosts: {type(e).__name__}: {e}. Fix: open files and "
              f"make iterators inside load, on its first call on each host.") from e
        source_id = next(self._ids)
        self._call([w.register_source.remote(source_id, payload) for w in self.workers],
                   "register the data source")
        self._sources[source] = source_id
        weakref.finalize(source, self._drop_source, source_id)
      step = source.step
      steps.append((source, step))
      rows: dict[int, tuple[int, int]] = {}
      entries = []
      for array_id, leaf, mesh_shape, spec, offset in leaves:
        spec = PartitionSpec(*list(spec)[:len(leaf.shape)])
        held = host_shards(leaf.shape, spec, mesh_shape, mesh_names,
                           self.device_hosts[offset:offset + math.prod(mesh_shape)])
        for h, indices in held.items():
          lo = min(i[0][0] for i in indices)
          hi = max(i[0][1] for i in indices)
          a, b = rows.get(h, (lo, hi))
          rows[h] = (min(a, lo), max(b, hi))
        entries.append((array_id, leaf.index, leaf.shape, leaf.dtype, mesh_shape,
                        tuple(mesh_names), spec, offset))
      for h in range(len(self.workers)):
        per_host[h].append((source_id, step, rows.get(h), entries))
    return per_host, steps

  def fetch(self, x: RemoteArray) -> np.ndarray:
    if x.deleted:
      raise InputError(f"autopar: {x!r} was donated to a later step. Fix: use the "
                       f"state that step returned.")
    parts = self._call([w.fetch.remote(x.array_id) for w in self.workers], "fetch")
    out = None
    for shards in parts:
      for idx, part in shards.items():
        if out is None:        # (a key array's data has trailing dimensions)
          out = np.empty(x.shape + part.shape[len(x.shape):], part.dtype)
        out[tuple(slice(a, b) for a, b in idx)] = part
    return out

  # -- running a step ----------------------------------------------------------------

  def abstractify(self, args):
    return abstractify(args)

  def call(self, pf, args: Sequence[Any]):
    """Runs ``pf`` (a ParallelizedFunction) on the workers; a method given
    a concrete mesh of this process's devices still runs here."""
    if isinstance(pf.method.mesh, jax.sharding.Mesh):
      return runtime.LOCAL.call(pf, args)
    return self.run(pf, args)

  def run(self, pf, args: Sequence[Any]):
    """Runs ``pf`` (a ParallelizedFunction) on the workers."""
    from ray import cloudpickle
    pf = _with_global_mesh(pf, self)
    # A DataSource's leaves stand in for arrays the hosts load themselves.
    args = data.expand(args) if data.has_sources(args) else args
    pf.check_donation(args)
    # Planned (and traced) once per signature on the driver; every later call
    # finds both in pf's caches.
    sig = pf.signature(abstractify(list(args)))
    plan, num_outs = sig.plan, sig.num_outputs
    mesh = pf.method.mesh
    # Keyed by the function itself (held here), not its id(): a new closure
    # can reuse a freed one's id.
    fn_id = self._functions.get(pf.fun)
    if fn_id is None:
      fn_id = self._functions[pf.fun] = next(self._ids)
      kwargs = dict(donate_argnums=pf.donate_argnums, batch_argnums=pf.batch_argnums,
                    static_argnums=pf.static_argnums,
                    output_reductions=pf.output_reductions)
      # The step's class travels by reference: workers make the same kind of step.
      payload = cloudpickle.dumps((type(pf), pf.fun, kwargs))
      self._call([w.register.remote(fn_id, payload) for w in self.workers], "register")
    # The method with the costs this signature resolved (the workers plan
    # the presets with it, as the driver did).
    shipped = sig.method or pf.method
    method = {f.name: getattr(shipped, f.name) for f in dataclasses.fields(shipped)
              if f.name not in ("mesh", "plan")}
    method.update(cls=type(shipped), mesh=(tuple(mesh.axis_sizes),
                                           tuple(mesh.axis_names)))
    method_bytes = pickled(self._pickles, ("method", id(shipped)), method,
                           owner=shipped)
    # The plan goes to the workers, which run it without solving (the presets
    # plan without an ILP and are planned there again).
    plan_json = plan.to_json(indent=None) if type(pf.method).__name__ in (
        "ShardParallel", "PipeshardParallel") else None
    plan_key = hashlib.sha256((plan_json or "").encode() + method_bytes).hexdigest()
    # (per function: the workers keep each function's plans apart)
    first = (fn_id, plan_key) not in self._sent_plans

    # Array leaves: already remote (by id) or sent now, each host its shards.
    leaves, tree = jax.tree.flatten(list(args))
    # Which leaves are arguments of the program (in plan.inputs order) and
    # which are static (sent as Python values): static arguments, and the
    # leaves of the others that are not arrays (pytrees.partition).
    static = set(sig.static_argnums)
    arg_of = [i for i, child in enumerate(tree.children()) for _ in range(child.num_leaves)]
    traced = [t and arg_of[k] not in static for k, t in
              enumerate(leaf_mask(list(args), arrays=(RemoteArray, data.SourceLeaf)))]
    # Each input on its mesh: the whole mesh, or a pipeline stage's submesh.
    specs = iter(plan.placements())
    temporary = []
    shipped = []
    puts: list[list] = [[] for _ in self.workers]    # sent with the call
    loads: dict[data.DataSource, list] = {}          # a source -> its leaves
    for x, is_traced in zip(leaves, traced, strict=True):
      if not is_traced:
        shipped.append(x)          # static: Python values go as they are
      elif isinstance(x, data.SourceLeaf):
        offset, shape, spec = next(specs)
        array_id = next(self._ids)
        loads.setdefault(x.source, []).append((array_id, x, tuple(shape), spec, offset))
        temporary.append(array_id)
        shipped.append(ArrayRef(array_id))
      elif isinstance(x, RemoteArray):
        next(specs)
        if x.deleted:
          raise InputError(f"autopar: {x!r} was donated to an earlier step. Fix: "
                           f"pass the state that step returned.")
        shipped.append(ArrayRef(x.array_id))
      elif not isinstance(x, (np.ndarray, np.generic, jax.Array)):
        next(specs)                # a traced Python number: the workers see the same
        shipped.append(x)
      else:
        offset, shape, spec = next(specs)
        array_id, per_host = self._puts(x, spec, shape, mesh.axis_names, offset)
        for h, p in enumerate(per_host):
          puts[h].append(p)
        temporary.append(array_id)
        shipped.append(ArrayRef(array_id))
    loading, steps = self._loads(loads, mesh.axis_names)
    tree_bytes = pickled(self._pickles, tree, tree)
    tree_key = hashlib.sha256(tree_bytes).hexdigest()
    new_tree = tree_key not in self._sent_trees
    args_bytes = cloudpickle.dumps((tree_key, tree_bytes if new_tree else None, shipped))
    forgotten, self._forgotten = self._forgotten, []
    dropped, self._dropped_sources = self._dropped_sources, []
    out_ids = [next(self._ids) for _ in range(num_outs)]
    self.last_call_bytes = max(
        len(args_bytes) + len(cloudpickle.dumps(loading[h])) +
        sum(b.nbytes for p in puts[h] for b in p[6].values())
        for h in range(len(self.workers)))
    try:
      if loads:
        # Every host loads its rows before any starts the step: a loader
        # that fails on one host fails the call on all, the state untouched.
        self._call([w.load_batches.remote(loading[h], dropped)
                    for h, w in enumerate(self.workers)], "loading the batch")
        dropped = []
        for source, step in steps:
          source.loaded(step)
      results = self._call([
          w.run.remote(fn_id, plan_key, plan_json if first else None, method_bytes,
                       args_bytes, out_ids, SMALL_BYTES, puts[h], forgotten, dropped)
          for h, w in enumerate(self.workers)], "the step")
    except BaseException:
      # The arrays sent or loaded for this call, and those let go before
      # it, are dropped with the next call (an unknown id is ignored).
      self._forgotten = forgotten + temporary + self._forgotten
      self._dropped_sources = dropped + self._dropped_sources
      raise
    self._sent_plans.add((fn_id, plan_key))
    self._sent_trees.add(tree_key)
    self.last_step_seconds = [r["seconds"] for r in results]
    # (An array on other hosts' devices only, such as a pipeline stage's, is
    # deleted on the hosts that hold it.)
    deleted = set().union(*(r["deleted"] for r in results))
    for x in leaves:
      if isinstance(x, RemoteArray) and x.array_id in deleted:
        x.deleted = True
    # Inputs sent for this call only (the batch), and arrays donated (gone on
    # the hosts that held them), are dropped on every host next time.
    self._forgotten.extend(set(temporary) | deleted)
    # The same structure is the same object, so the next call's signature
    # (which includes a TrainState's apply_fn) is found in the caches.
    out_bytes = results[0]["tree"]
    outputs = self._trees.get(out_bytes)
    if outputs is None:
      outputs = self._trees[out_bytes] = cloudpickle.loads(out_bytes)
    # A small replicated output comes from whichever host holds it, and so
    # does its weak type (a pipeline stage's output has no shards elsewhere).
    values = [next((r["leaves"][k][2] for r in results if r["leaves"][k][2] is not None),
                   None) for k in range(num_outs)]
    weak = [any(r["leaves"][k][3] for r in results) for k in range(num_outs)]
    outs = [RemoteArray(self, i, shape, dtype, value, w, impl)
            for i, (shape, dtype, _, _, impl), value, w in zip(
                out_ids, results[0]["leaves"], values, weak, strict=True)]
    # Arguments the step changed in place (Flax NNX) take their new values here.
    return split_updates(sig.traced, outputs.merge(outs), args)

  # -- checkpoints ----------------------------------------------------------------------

  def save_checkpoint(self, path: str, state) -> None:
    from ray import cloudpickle
    def ref(x):
      if isinstance(x, RemoteArray):
        return ArrayRef(x.array_id)
      raise InputError(f"save_checkpoint: under the Ray cluster the state must be "
                       f"what a parallelized step returned (RemoteArray leaves); got "
                       f"a {type(x).__name__}. Fix: save the state a step returned.")
    tree = jax.tree.map(ref, state, is_leaf=lambda a: isinstance(a, RemoteArray))
    payload, path = cloudpickle.dumps(tree), os.path.abspath(path)
    first = self.workers[0]
    stages = self._call([first.begin_checkpoint.remote(path, payload)], "save_checkpoint")[0]
    self._call([w.save_checkpoint.remote(path, payload, stages) for w in self.workers],
               "save_checkpoint")
    if stages:
      self._call([first.end_checkpoint.remote(path, payload)], "save_checkpoint")

  def restore_checkpoint(self, path: str, target, shardings):
    from ray import cloudpickle
    t_leaves, tree = jax.tree.flatten(target)
    stages = checkpoint.is_stage_checkpoint(path)
    if shardings is None and not stages:
      raise InputError("restore_checkpoint: under the Ray cluster give shardings "
                       "(e.g. plan.input_shardings[0]).")
    s_leaves = ([None] * len(t_leaves) if shardings is None else
                jax.tree.leaves(shardings, is_leaf=lambda s: isinstance(s, PartitionSpec)))
    if len(s_leaves) != len(t_leaves):
      raise InputError(f"restore_checkpoint: shardings has {len(s_leaves)} leaves but "
                       f"target has {len(t_leaves)}.")
    meshes = {(tuple(s.mesh.axis_sizes), tuple(s.mesh.axis_names))
              for s in s_leaves if hasattr(s, "mesh")}
    whole = {m for m in meshes if math.prod(m[0]) == self.num_devices}
    if len(whole) > 1 or (shardings is not None and not meshes):
      raise InputError("restore_checkpoint: shardings must be NamedShardings on the "
                       "cluster's mesh (plan.input_shardings[0]).")
    if stages:
      entries = self._stage_entries(path, target, s_leaves, next(iter(whole), None))
    else:
      entries = self._whole_mesh_entries(t_leaves, s_leaves, meshes)
    out_ids = [next(self._ids) for _ in entries]
    payload = cloudpickle.dumps((tree, entries))
    weak = self._call([w.restore_checkpoint.remote(os.path.abspath(path), payload, out_ids)
                       for w in self.workers], "restore_checkpoint")[0]
    return jax.tree.unflatten(tree, [
        RemoteArray(self, i, shape, dtype, weak_type=w, key_impl=impl)
        for i, (shape, dtype, *_, impl), w in zip(out_ids, entries, weak, strict=True)])

  def _whole_mesh_entries(self, t_leaves, s_leaves, meshes) -> list[tuple]:
    """The leaves of an orbax checkpoint: on one mesh of every device
    (orbax reads each process's part of an array that every process holds
    part of)."""
    sizes = {math.prod(shape) for shape, _ in meshes}
    if len(meshes) > 1 or sizes != {self.num_devices}:
      raise InputError(
          f"restore_checkpoint: this checkpoint (orbax's, of a state on the whole "
          f"mesh) is restored under the Ray cluster onto one mesh of the cluster's "
          f"{self.num_devices} devices; got meshes "
          f"{', '.join(str(dict(zip(n, s))) for s, n in sorted(meshes))}. Fix: "
          f"restore onto the whole mesh, e.g. jax.tree.map(lambda _: "
          f"NamedSharding(mesh, P()), target); the next step moves each array where "
          f"its plan puts it.")
    (mesh_shape, mesh_names), = meshes
    return [(tuple(x.shape), np.dtype(x.dtype),
             s if isinstance(s, PartitionSpec) else s.spec, mesh_shape, mesh_names, None,
             None)
            for x, s in zip(t_leaves, s_leaves)]

  def _stage_entries(self, path, target, s_leaves, whole) -> list[tuple]:
    """The leaves of a stage-format checkpoint (a pipeline's state): each
    onto the whole mesh where its sharding lies there; onto the devices it
    was saved on where its sharding lies on a submesh of the saved one's
    shape (a pipeline plan's input_shardings: its stages' submeshes, which
    say their shape but not where they lie) or where none is given."""
    leaves = checkpoint.array_leaves(target)
    saved = checkpoint.check_stage_target(path, [(n, x.shape, x.dtype) for n, x in leaves])
    entries = []
    for (name, x), s, rec in zip(leaves, s_leaves, saved, strict=True):
      at, impl = rec["sharding"], rec["key_impl"]
      dtype = str(x.dtype) if impl else np.dtype(x.dtype)
      spec = s if isinstance(s, PartitionSpec) else getattr(s, "spec", None)
      mesh = (None if s is None else whole if isinstance(s, PartitionSpec) else
              (tuple(s.mesh.axis_sizes), tuple(s.mesh.axis_names)))
      if mesh is not None and math.prod(mesh[0]) == self.num_devices:
        entries.append((tuple(x.shape), dtype, spec, *mesh, None, impl))
        continue
      fix = ("Fix: restore onto the whole mesh (NamedSharding(mesh, P()) per leaf); "
             "the next step moves each array onto its stage.")
      if "mesh_shape" not in at:
        raise InputError(f"restore_checkpoint: target{name} was saved on devices "
                         f"{at['devices']} without a mesh, so it cannot go back onto "
                         f"them. {fix}")
      missing = sorted(set(at["devices"]) - set(self.device_ids))
      if missing:
        raise InputError(f"restore_checkpoint: target{name} was saved on devices "
                         f"{at['devices']}; this cluster has no device {missing}. {fix}")
      saved_mesh = (tuple(at["mesh_shape"]), tuple(at["axis_names"]))
      if mesh is not None and mesh != saved_mesh:
        raise InputError(
            f"restore_checkpoint: target{name}'s sharding lies on a submesh "
            f"{dict(zip(mesh[1], mesh[0]))} but it was saved on "
            f"{dict(zip(saved_mesh[1], saved_mesh[0]))} (devices {at['devices']}); "
            f"under the Ray cluster a submesh is restored onto the devices it was "
            f"saved on. Fix: give its saved submesh's shape, or restore onto the "
            f"whole mesh (NamedSharding(mesh, P())); the next step moves each array "
            f"onto its stage.")
      entries.append((tuple(x.shape), dtype,
                      spec_from_json(at["spec"]) if spec is None else spec,
                      *saved_mesh, list(at["devices"]), impl))
    return entries

def abstractify(args):
  """``args`` with RemoteArray leaves as ``jax.ShapeDtypeStruct``s."""
  handles = (RemoteArray, data.SourceLeaf)
  return jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type)
      if isinstance(a, handles) else a, data.as_shapes(args),
      is_leaf=lambda a: isinstance(a, handles))


def _with_global_mesh(pf, c: RayCluster):
  """``pf``, or for a method without a mesh, ``pf`` on a 1-D "data" mesh
  over every device of the cluster."""
  mesh = pf.method.mesh
  if isinstance(mesh, AbstractMesh):
    return pf
  cached = c._variants.get(pf)
  if cached is not None:
    return cached
  mesh = AbstractMesh((c.num_devices,), ("data",))
  if math.prod(mesh.axis_sizes) != c.num_devices:
    raise MeshError(f"autopar: the method's mesh has {math.prod(mesh.axis_sizes)} "
                    f"devices but the Ray cluster has {c.num_devices}. Fix: use "
                    f"autopar.global_mesh(shape, names) with {c.num_devices} devices.")
  variant = c._variants[pf] = pf.with_method(dataclasses.replace(pf.method, mesh=mesh))
  return variant


def _ray_wait(ref, timeout) -> bool:
  import ray
  ready, _ = ray.wait([ref], timeout=timeout)
  return bool(ready)


def _first_line(e) -> str:
  text = str(e).strip().splitlines()
  return text[0] if text else type(e).__name__
