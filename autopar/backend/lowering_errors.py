"""JAX's errors for ops it cannot lower where autopar put them, said as
autopar errors with the fix.

Two kinds of op lower differently inside autopar's stages than under a
plain ``jax.jit``, because a gradient stage splits the batch by hand
(``shard_map``, manual over the batch axes, the other mesh axes left to
XLA):

* a host callback (``jax.pure_callback``, ``io_callback``,
  ``jax.debug.print`` / ``jax.debug.callback``): JAX lowers one only where
  every mesh axis is manual or none is;
* a ``custom_partitioning`` op (cuDNN's fused attention is one): its
  partitioner can fail in a pipeline stage (seen on CPU; under
  ``DataParallel`` and ``ShardParallel`` it ran).

JAX says so with a ``NotImplementedError``, a ``ValueError`` about the
context mesh, or an XLA ``INTERNAL`` error from the partitioner callback;
:func:`explained` turns those into an :class:`~autopar.errors.InputError`
naming the op, where it is, and what to change. Other errors pass as they are.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

from autopar.errors import AutoparError, InputError
from autopar.frontend.retype import HOST_CALLBACKS, primitive_names

__all__ = ["explained"]

# What JAX's lowering says for a host callback inside a partly manual computation.
_CALLBACK_MESSAGES = ("callbacks are only supported in spmd computations",
                      "context mesh cannot be empty")


@contextlib.contextmanager
def explained(jaxpr, *, where: str, batch_axes: Sequence[str],
              mesh_axes: Sequence[str], pipeline: bool = False):
  """Runs the body (lowering or compiling ``jaxpr``'s stages), raising an
  :class:`InputError` with the fix for the failures this module describes.

  ``where``: the stage, for the message; ``batch_axes``: the mesh axes the
  batch is split over there (manual); ``mesh_axes``: all of its mesh's axes;
  ``pipeline``: a pipeline stage (whose batch axes autopar chooses). In
  a pipeline stage the callback named may sit in another stage: the step's
  primitives are read as a whole.
  """
  try:
    yield
  except AutoparError:
    raise
  except Exception as e:   # noqa: BLE001 - re-raised as is unless recognised
    message = str(e)
    others = [a for a in mesh_axes if a not in batch_axes]
    # (Only where autopar split the batch over some axes and not others: a
    # callback inside the user's own partly manual shard_map is theirs.)
    if others and any(m in message for m in _CALLBACK_MESSAGES):
      callbacks = sorted(primitive_names(jaxpr) & set(HOST_CALLBACKS))
      if callbacks:
        raise InputError(
            f"{where}: the step calls back to the host ({', '.join(callbacks)}: "
            f"jax.pure_callback, io_callback, jax.debug.print or jax.debug.callback) "
            f"where its batch is split over the mesh axes {tuple(batch_axes)} and "
            f"not over {tuple(others)}; JAX lowers a host callback only in a "
            f"computation split by hand over every mesh axis or none. Fix: "
            + ("compute the callback's value outside the step and pass it in, or use "
               "DataParallel (no pipeline stages)." if pipeline else
               f"split the batch over all of the mesh's axes {tuple(mesh_axes)} "
               f"(DataParallel's default batch_axes; for ShardParallel, "
               f"AutoShardingOption(force_batch_dim_to_mesh_dim={tuple(mesh_axes)})), "
               f"or compute the callback's value outside the step and pass it in.")
        ) from e
    if (pipeline and "custom_partitioner" in message and
        "custom_partitioning" in primitive_names(jaxpr)):
      raise InputError(
          f"{where}: JAX could not partition a custom_partitioning op of the step "
          f"(jax.nn.dot_product_attention(implementation='cudnn') is one) in this "
          f"stage, on mesh axes {tuple(mesh_axes)} with the batch split over "
          f"{tuple(batch_axes)} (JAX's error is above this one). Fix: use "
          f"ShardParallel or DataParallel (one mesh, no pipeline stages), or a "
          f"version of the op without custom_partitioning (implementation='xla' "
          f"for attention)."
      ) from e
    raise
