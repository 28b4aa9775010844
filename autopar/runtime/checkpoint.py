"""Saving and restoring training state with orbax, in this process.

The public ``autopar.save_checkpoint`` / ``autopar.restore_checkpoint``
(``base.py``) go to the active runtime: the local one calls
:func:`save_local` and :func:`restore_here`; under a Ray cluster every host
worker calls :func:`save_local` / :func:`restore_local` on its shards (each
process writes its own, so state spread over several hosts is saved whole),
or, for a pipeline's state, the three parts of a save in the stage format
(below) and :func:`read_stage_array`.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from autopar.errors import InputError
from autopar.plan import spec_to_json

__all__ = ["save_local", "restore_local", "restore_here", "arrays_only", "save_stages",
           "begin_stage_save", "write_stage_shards", "end_stage_save",
           "is_stage_checkpoint", "check_stage_target", "read_stage_array",
           "stage_manifest", "array_leaves"]


def _checkpointer():
  import orbax.checkpoint as ocp
  return ocp.StandardCheckpointer()


def save_local(path: str, tree: Any) -> None:
  """Saves ``tree`` (this process's part of it) and waits until written."""
  ckpt = _checkpointer()
  ckpt.save(os.path.abspath(path), tree, force=True)
  ckpt.wait_until_finished()


def restore_local(path: str, abstract: Any) -> Any:
  """Restores into ``abstract`` (``ShapeDtypeStruct`` leaves with shardings)."""
  return _checkpointer().restore(os.path.abspath(path), abstract)


def restore_here(path: str, target: Any, shardings: Any = None) -> Any:
  """``restore_checkpoint`` on this process's devices (``base.LocalRuntime``)."""
  leaves, tree = jax.tree.flatten(target)
  if shardings is None:
    shard_leaves = [None] * len(leaves)
  else:
    shard_leaves = jax.tree.leaves(shardings, is_leaf=lambda s: s is None)
  if len(shard_leaves) != len(leaves):
    raise InputError(f"restore_checkpoint: shardings has {len(shard_leaves)} leaves "
                     f"but target has {len(leaves)}. Fix: pass shardings with the "
                     f"structure of target (e.g. plan.input_shardings[0]).")
  if is_stage_checkpoint(path):
    return _restore_stages_here(path, target, leaves, shard_leaves)
  abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
              if hasattr(x, "shape") and hasattr(x, "dtype") else x
              for x, s in zip(leaves, shard_leaves)]
  restored = restore_local(path, arrays_only(jax.tree.unflatten(tree, abstract)))
  return _merge(target, restored)


def _restore_stages_here(path, target, leaves, shard_leaves):
  """``restore_here`` of a stage-format checkpoint (one saved under Ray)."""
  names = [name for name, _ in array_leaves(target)]
  arrays = [(x, s) for x, s in zip(leaves, shard_leaves) if _is_array(x)]
  saved = check_stage_target(path, [(name, x.shape, x.dtype)
                                    for name, (x, _) in zip(names, arrays)])
  default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  restored = iter([read_stage_array(path, k, rec, default if s is None else s)
                   for k, (rec, (_, s)) in enumerate(zip(saved, arrays))])
  return jax.tree.unflatten(jax.tree.structure(target),
                            [next(restored) if _is_array(x) else x for x in leaves])


def _is_array(x) -> bool:
  return hasattr(x, "shape") and hasattr(x, "dtype")


def arrays_only(tree: Any) -> Any:
  """``tree`` with non-array leaves replaced by None (not saved)."""
  return jax.tree.map(lambda x: x if _is_array(x) else None, tree)


def _merge(target: Any, restored: Any) -> Any:
  """Arrays from ``restored``, everything else from ``target``."""
  t_leaves, tree = jax.tree.flatten(target)
  r_leaves = jax.tree.leaves(restored, is_leaf=lambda x: x is None)
  return jax.tree.unflatten(tree, [r if _is_array(t) else t
                                   for t, r in zip(t_leaves, r_leaves, strict=True)])


# -- the stage format: one zarr array per leaf, each host its own shards ----------
#
# orbax refuses, in a program of several processes, an array that one
# process holds whole (a pipeline stage's on one host: "host local"). A state
# with such arrays is written here instead: a directory with one zarr array
# per array leaf (tensorstore, which orbax writes with too), chunked by the
# leaf's shards; every process writes the shards it holds (replica 0 of
# each), so no array is copied anywhere first. STAGE_MANIFEST says, per leaf,
# its shape, dtype and the sharding it was saved with.

STAGE_MANIFEST = "autopar_arrays.json"
_STAGE_FORMAT = 1


def is_stage_checkpoint(path: str) -> bool:
  """Whether ``path`` holds a checkpoint in the stage format."""
  return os.path.isfile(os.path.join(path, STAGE_MANIFEST))


def _pending(path: str) -> str:
  return os.path.abspath(path) + ".autopar-pending"


def array_leaves(tree: Any) -> list[tuple[str, Any]]:
  """(pytree path, array) of ``tree``'s array leaves, in order: the names
  the stage format saves them under."""
  flat, _ = jax.tree_util.tree_flatten_with_path(arrays_only(tree))
  return [(jax.tree_util.keystr(p), x) for p, x in flat]


def _is_key(x) -> bool:
  return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _stored(x) -> tuple[tuple[int, ...], np.dtype]:
  """The shape and dtype ``x`` is stored with (a PRNG key's: its key data)."""
  if _is_key(x):
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
    return tuple(data.shape), np.dtype(data.dtype)
  return tuple(x.shape), np.dtype(x.dtype)


def _zarr(directory: str, shape=None, dtype=None, chunks=None) -> dict:
  spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": directory}}
  if shape is not None:
    spec["dtype"] = dtype.name
    spec["metadata"] = {"shape": list(shape), "chunks": [max(c, 1) for c in chunks]}
  return spec


def _sharding_record(x) -> dict:
  """How ``x`` lies: the devices (ids) of its mesh, the mesh's shape and
  axis names, and the spec; for a sharding that is not a NamedSharding,
  its devices alone."""
  s = x.sharding
  if isinstance(s, NamedSharding):
    mesh = s.mesh
    return {"devices": [int(d.id) for d in np.asarray(mesh.devices).reshape(-1)],
            "mesh_shape": list(np.asarray(mesh.devices).shape),
            "axis_names": list(mesh.axis_names), "spec": spec_to_json(s.spec)}
  return {"devices": sorted(int(d.id) for d in s.device_set)}


def begin_stage_save(path: str, tree: Any) -> None:
  """The first of the three parts of a save in the stage format, on one
  process: an empty directory beside ``path`` and every leaf's zarr
  metadata in it."""
  import tensorstore as ts
  pending = _pending(path)
  shutil.rmtree(pending, ignore_errors=True)
  os.makedirs(pending)
  for k, (_, x) in enumerate(array_leaves(tree)):
    shape, dtype = _stored(x)
    chunks = tuple(x.sharding.shard_shape(tuple(x.shape))) + shape[len(x.shape):]
    ts.open(_zarr(os.path.join(pending, str(k)), shape, dtype, chunks),
            create=True).result()


def write_stage_shards(path: str, tree: Any) -> None:
  """The second part, on every process: writes the shards of ``tree``'s
  arrays this process holds (each shard once over its replicas)."""
  import tensorstore as ts
  pending = _pending(path)
  for k, (_, x) in enumerate(array_leaves(tree)):
    shards = [s for s in x.addressable_shards if s.replica_id == 0]
    if not shards:
      continue
    store = ts.open(_zarr(os.path.join(pending, str(k))), open=True).result()
    for s in shards:
      data = jax.random.key_data(s.data) if _is_key(x) else s.data
      store[tuple(s.index)].write(np.asarray(data)).result()


def end_stage_save(path: str, tree: Any) -> None:
  """The last part, on one process, once every process has written its
  shards: the manifest, and the directory moved to ``path`` (replacing
  what was there)."""
  leaves = []
  for name, x in array_leaves(tree):
    leaves.append({"path": name, "shape": list(x.shape), "dtype": str(x.dtype),
                   "key_impl": str(jax.random.key_impl(x)) if _is_key(x) else None,
                   "sharding": _sharding_record(x)})
  pending = _pending(path)
  with open(os.path.join(pending, STAGE_MANIFEST), "w") as f:
    json.dump({"format": _STAGE_FORMAT, "leaves": leaves}, f, indent=1)
  # The old checkpoint is moved aside before the new one takes its place,
  # so that one of them is whole at every moment.
  final = os.path.abspath(path)
  old = final + ".autopar-old"
  shutil.rmtree(old, ignore_errors=True)
  if os.path.exists(final):
    os.replace(final, old)
  os.replace(pending, final)
  shutil.rmtree(old, ignore_errors=True)


def save_stages(path: str, tree: Any) -> None:
  """A save in the stage format by this process alone."""
  begin_stage_save(path, tree)
  write_stage_shards(path, tree)
  end_stage_save(path, tree)


def _manifest(path: str) -> dict:
  with open(os.path.join(path, STAGE_MANIFEST)) as f:
    return json.load(f)


def stage_manifest(path: str) -> list[dict]:
  """The leaves a stage-format checkpoint holds (see ``end_stage_save``)."""
  return _manifest(path)["leaves"]


def check_stage_target(path: str, entries: list[tuple[str, tuple, Any]]) -> list[dict]:
  """The manifest's leaves, after checking that ``entries`` ((path, shape,
  dtype) of the target's arrays, in order) are what was saved, leaf by leaf
  (path, shape and dtype: leaves of one shape must not trade places)."""
  manifest = _manifest(path)
  if manifest.get("format") != _STAGE_FORMAT:
    raise InputError(f"restore_checkpoint: the checkpoint at {path!r} is of format "
                     f"{manifest.get('format')!r}; this autopar reads {_STAGE_FORMAT}. "
                     f"Fix: restore it with the autopar that saved it.")
  saved = manifest["leaves"]
  if len(saved) != len(entries):
    raise InputError(f"restore_checkpoint: the checkpoint at {path!r} holds "
                     f"{len(saved)} arrays but target has {len(entries)}. Fix: "
                     f"pass a target of the state that was saved.")
  for rec, (name, shape, dtype) in zip(saved, entries):
    if rec["path"] != name:
      raise InputError(f"restore_checkpoint: target{name} is where the checkpoint at "
                       f"{path!r} holds {rec['path'] or 'the state'} (leaves in the same "
                       f"order). Fix: pass a target of the state that was saved.")
    if tuple(rec["shape"]) != tuple(shape) or rec["dtype"] != str(dtype):
      raise InputError(f"restore_checkpoint: target{name} is {str(dtype)}"
                       f"{list(shape)} but the checkpoint holds {rec['dtype']}"
                       f"{rec['shape']} there. Fix: pass a target of the state that "
                       f"was saved.")
  return saved


def read_stage_array(path: str, k: int, record: dict, sharding) -> jax.Array:
  """Leaf ``k`` of a stage-format checkpoint as a global array of
  ``sharding`` (this process reads the blocks of its own devices)."""
  import tensorstore as ts
  store = ts.open(_zarr(os.path.join(os.path.abspath(path), str(k))), open=True).result()
  shape = tuple(record["shape"])
  impl = record["key_impl"]
  if impl is not None:
    data_sharding = sharding
    if isinstance(sharding, NamedSharding):      # (key data: one more axis)
      spec = tuple(sharding.spec) + (None,) * (len(store.shape) - len(sharding.spec))
      data_sharding = NamedSharding(sharding.mesh, PartitionSpec(*spec))
    data = _global_array(store, tuple(store.shape), data_sharding)
    return jax.random.wrap_key_data(data, impl=impl)
  return _global_array(store, shape, sharding)


def _global_array(store, shape, sharding) -> jax.Array:
  """``store`` (a tensorstore of ``shape``) as a global array of ``sharding``."""
  dtype = store.dtype.numpy_dtype
  if not sharding.addressable_devices:     # (on other processes' devices only)
    return jax.make_array_from_single_device_arrays(shape, sharding, [], dtype=dtype)
  return jax.make_array_from_callback(shape, sharding, lambda idx: store[idx].read().result(),
                                      dtype=dtype)
