"""Saving and restoring training state with orbax.

``save_checkpoint(path, state)`` writes every array of ``state`` (each
process writes its own shards, so it works for state spread over several
hosts); ``restore_checkpoint(path, target, shardings)`` reads it back into
arrays with the given shardings. Under a Ray cluster (``autopar.init(
cluster="ray")``) both run on the host workers and the state stays there.

Example::

    autopar.save_checkpoint("/ckpt/step_100", state)
    state = autopar.restore_checkpoint("/ckpt/step_100", state,
                                       exe.plan.input_shardings[0])
"""

from __future__ import annotations

import os
from typing import Any

import jax

from autopar.errors import InputError

__all__ = ["save_checkpoint", "restore_checkpoint"]


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


def save_checkpoint(path: str, state: Any) -> None:
  """Saves the arrays of ``state`` under the directory ``path`` (replaced if
  it exists). Non-array leaves (e.g. a TrainState's ``apply_fn``) are not
  saved: they come from the ``target`` on restore."""
  from autopar import cluster
  c = cluster.current()
  if c is not None:
    c.save_checkpoint(path, state)
    return
  save_local(path, _arrays_only(state))


def restore_checkpoint(path: str, target: Any, shardings: Any = None) -> Any:
  """Restores the state saved at ``path``.

  Args:
    path: the directory given to :func:`save_checkpoint`.
    target: a pytree of the same structure: arrays, ``jax.ShapeDtypeStruct``s
      or a state from ``jax.eval_shape``; gives shapes, dtypes and the
      non-array leaves.
    shardings: a pytree of ``NamedSharding`` or ``PartitionSpec`` (with the
      cluster's mesh) like ``target``, e.g. ``plan.input_shardings[0]``;
      None restores every array replicated on the default device (local
      mode only).
  """
  from autopar import cluster
  if not os.path.isdir(path):
    raise InputError(f"restore_checkpoint: no checkpoint at {path!r}. Fix: pass "
                     f"the directory given to autopar.save_checkpoint.")
  c = cluster.current()
  if c is not None:
    return c.restore_checkpoint(path, target, shardings)
  leaves, tree = jax.tree.flatten(target)
  if shardings is None:
    shard_leaves = [None] * len(leaves)
  else:
    shard_leaves = jax.tree.leaves(shardings, is_leaf=lambda s: s is None)
  if len(shard_leaves) != len(leaves):
    raise InputError(f"restore_checkpoint: shardings has {len(shard_leaves)} leaves "
                     f"but target has {len(leaves)}. Fix: pass shardings with the "
                     f"structure of target (e.g. plan.input_shardings[0]).")
  abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
              if hasattr(x, "shape") and hasattr(x, "dtype") else x
              for x, s in zip(leaves, shard_leaves)]
  restored = restore_local(path, _arrays_only(jax.tree.unflatten(tree, abstract)))
  return _merge(target, restored)


def _is_array(x) -> bool:
  return hasattr(x, "shape") and hasattr(x, "dtype")


def _arrays_only(tree: Any) -> Any:
  """``tree`` with non-array leaves replaced by None (not saved)."""
  return jax.tree.map(lambda x: x if _is_array(x) else None, tree)


def _merge(target: Any, restored: Any) -> Any:
  """Arrays from ``restored``, everything else from ``target``."""
  t_leaves, tree = jax.tree.flatten(target)
  r_leaves = jax.tree.leaves(restored, is_leaf=lambda x: x is None)
  return jax.tree.unflatten(tree, [r if _is_array(t) else t
                                   for t, r in zip(t_leaves, r_leaves, strict=True)])
