"""Saving and restoring training state with orbax, in this process.

The public ``autopar.save_checkpoint`` / ``autopar.restore_checkpoint``
(``base.py``) go to the active runtime: the local one calls
:func:`save_local` and :func:`restore_here`; under a Ray cluster every host
worker calls :func:`save_local` / :func:`restore_local` on its shards (each
process writes its own, so state spread over several hosts is saved whole).
"""

from __future__ import annotations

import os
from typing import Any

import jax

from autopar.errors import InputError

__all__ = ["save_local", "restore_local", "restore_here", "arrays_only"]


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
  abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
              if hasattr(x, "shape") and hasattr(x, "dtype") else x
              for x, s in zip(leaves, shard_leaves)]
  restored = restore_local(path, arrays_only(jax.tree.unflatten(tree, abstract)))
  return _merge(target, restored)


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
