"""Batches each host loads itself: :class:`DataSource`.

A step is usually called with its batch as NumPy or JAX arrays. On a Ray
cluster those pass through the driver: it holds the whole global batch and
sends each host its shards, every step. A ``DataSource`` passed in the
batch's place instead runs a loader on every host, each returning only the
rows its own devices hold, so the driver never holds the batch and the
bytes it sends per step do not grow with the batch size::

    def load(shard: autopar.HostShard):
      # this host's rows of batch number shard.step
      rows = np.arange(shard.rows.start, shard.rows.stop)
      return {"x": x_file[shard.step * B + rows], "y": ...}

    data = autopar.DataSource(load, like={"x": jax.ShapeDtypeStruct((B, 784), np.float32),
                                          "y": jax.ShapeDtypeStruct((B,), np.int32)})
    for _ in range(steps):
      state, loss = train_step(state, data)

``load`` is sent to every host once (cloudpickled: a callable object may
open a file or make an iterator there, lazily on its first call) and called
once per step on each host that holds part of the batch; every host loads
before any starts the step, so a loader that fails on one host fails the
call on all, with the state untouched, and the next call loads the same
batch number again. Which rows a host loads depends on the plan
(a batch split over hosts: each its own rows; a replicated one: all of
them), so ``load`` is told them (:class:`HostShard`). Run in this process
(``cluster="local"``), the one host loads every row.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable

import jax
import numpy as np

from autopar.errors import InputError

__all__ = ["DataSource", "HostShard", "SourceLeaf", "has_sources", "as_shapes",
           "expand", "materialize", "check_loaded"]


@dataclasses.dataclass(frozen=True)
class HostShard:
  """What one host loads for one step.

  Attributes:
    host: this host's index (``jax.process_index()`` on the host).
    num_hosts: how many hosts run the step.
    rows: the rows of the global batch this host returns, in order
      (``rows.start`` to ``rows.stop``, step 1).
    step: how many batches this source loaded before this one (0, 1, ...;
      a call that failed to load does not count).
  """
  host: int
  num_hosts: int
  rows: slice
  step: int

  @property
  def size(self) -> int:
    """The number of rows to return."""
    return self.rows.stop - self.rows.start


class DataSource:
  """A batch each host loads itself (see the module docstring).

  Args:
    load: ``load(shard: HostShard)`` returns this host's rows of the batch: a
      pytree like ``like``, each leaf of leading size ``shard.size`` and the
      rest of its shape and dtype as in ``like``.
    like: the global batch's shapes and dtypes: a pytree of
      ``jax.ShapeDtypeStruct``s (or arrays), every leaf batched along its
      first axis, all of one batch size.
  """

  def __init__(self, load: Callable[[HostShard], Any], like: Any):
    if not callable(load):
      raise InputError(f"DataSource: load must be a callable taking an "
                       f"autopar.HostShard; got {type(load).__name__}.")
    flat, self.treedef = jax.tree_util.tree_flatten_with_path(like)
    if not flat:
      raise InputError("DataSource: like has no leaves. Fix: give the batch's "
                       "shapes, e.g. {'x': jax.ShapeDtypeStruct((64, 784), np.float32)}.")
    self.paths = tuple(jax.tree_util.keystr(p) for p, _ in flat)
    shapes = []
    for path, x in zip(self.paths, (x for _, x in flat)):
      if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise InputError(f"DataSource: like{path} is a {type(x).__name__}, not a "
                         f"shape. Fix: give jax.ShapeDtypeStruct(shape, dtype) leaves.")
      if len(x.shape) == 0:
        raise InputError(f"DataSource: like{path} is a scalar; every leaf of a batch "
                         f"has the batch on its first axis. Fix: pass scalars as "
                         f"another argument.")
      dtype = jax.dtypes.canonicalize_dtype(x.dtype)
      shapes.append(jax.ShapeDtypeStruct(tuple(int(d) for d in x.shape), dtype))
    sizes = {s.shape[0] for s in shapes}
    if len(sizes) != 1:
      raise InputError(f"DataSource: like's leaves have batch sizes {sorted(sizes)}; "
                       f"a batch has one. Fix: give every leaf the same first axis.")
    self.load = load
    self.shapes = tuple(shapes)
    self.batch_size = sizes.pop()
    self._steps = 0
    self._lock = threading.Lock()

  @property
  def like(self) -> Any:
    """The global batch's shapes (``jax.ShapeDtypeStruct``s)."""
    return jax.tree.unflatten(self.treedef, list(self.shapes))

  @property
  def step(self) -> int:
    """The number of the batch the next call loads: how many were loaded."""
    return self._steps

  def loaded(self, step: int) -> None:
    """Batch ``step`` was loaded (by every host): the next call loads the
    next one. A call that failed to load takes the same batch again."""
    with self._lock:
      self._steps = max(self._steps, step + 1)

  def __getstate__(self):             # (sent to the hosts; a lock does not pickle)
    state = dict(self.__dict__)
    del state["_lock"]
    return state

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._lock = threading.Lock()

  def __repr__(self):
    return (f"DataSource({getattr(self.load, '__name__', type(self.load).__name__)}, "
            f"batch {self.batch_size}, {len(self.shapes)} leaves)")


@dataclasses.dataclass(frozen=True)
class SourceLeaf:
  """A leaf of a source's batch in a call's arguments (the Ray runtime):
  shaped like the array the hosts will load."""
  source: DataSource
  index: int
  shape: tuple
  dtype: Any
  weak_type: bool = False


def has_sources(args) -> bool:
  return any(isinstance(a, DataSource) for a in args)


def as_shapes(args):
  """``args`` with each DataSource as its batch's shapes (for planning)."""
  if not has_sources(args):
    return args
  return tuple(a.like if isinstance(a, DataSource) else a for a in args)


def expand(args) -> tuple:
  """``args`` with each DataSource as a pytree of :class:`SourceLeaf`."""
  return tuple(
      jax.tree.unflatten(a.treedef, [SourceLeaf(a, k, s.shape, s.dtype)
                                     for k, s in enumerate(a.shapes)])
      if isinstance(a, DataSource) else a for a in args)


def materialize(args, step_name: str) -> tuple:
  """``args`` with each DataSource loaded whole, by this process as the
  only host (the local runtime)."""
  out = []
  for i, a in enumerate(args):
    if isinstance(a, DataSource):
      shard = HostShard(host=0, num_hosts=1, rows=slice(0, a.batch_size), step=a.step)
      loaded = check_loaded(a, a.load(shard), shard, f"{step_name}: argument {i}")
      a.loaded(shard.step)
      a = jax.tree.unflatten(a.treedef, loaded)
    out.append(a)
  return tuple(out)


def check_loaded(source: DataSource, loaded, shard: HostShard, where: str) -> list:
  """The leaves ``source.load(shard)`` returned, as NumPy arrays of the
  shapes and dtypes asked for, or an InputError saying which is not."""
  leaves, treedef = jax.tree.flatten(loaded)
  if treedef != source.treedef:
    raise InputError(f"{where}: the DataSource's load returned a {treedef} for "
                     f"step {shard.step} on host {shard.host}; like is a "
                     f"{source.treedef}. Fix: return the same structure as like.")
  out = []
  for path, x, want in zip(source.paths, leaves, source.shapes, strict=True):
    x = np.asarray(x)
    shape = (shard.size,) + want.shape[1:]
    if x.shape != shape:
      raise InputError(
          f"{where}: the DataSource's load returned batch{path} of shape {x.shape} "
          f"on host {shard.host} for rows {shard.rows.start}:{shard.rows.stop}; "
          f"expected {shape} (this host's {shard.size} rows of the global "
          f"{want.shape}). Fix: return the rows shard.rows names.")
    if jax.dtypes.canonicalize_dtype(x.dtype) != want.dtype:
      raise InputError(f"{where}: the DataSource's load returned batch{path} as "
                       f"{x.dtype}; like says {want.dtype}. Fix: return {want.dtype} "
                       f"(autopar does not change a batch's dtype).")
    out.append(x.astype(want.dtype, copy=False))
  return out
