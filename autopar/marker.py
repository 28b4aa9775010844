"""The grad marker: where a training step stops computing gradients.

``autopar.grad`` and ``autopar.value_and_grad`` are ``jax.grad`` and
``jax.value_and_grad`` with one addition: the gradients pass through
``grad_marker_p``, an identity primitive. autopar's splitter cuts the traced
step at that equation into ``compute_grad`` (everything that produces the
gradients, run once per micro-batch) and ``apply_grad`` (everything that
consumes them, run once per step).

Outside autopar the marker is invisible: it lowers to nothing, and it has
JVP, transpose and batching rules, so a marked function still works under
plain ``jax.jit``, ``jax.vmap``, ``jax.grad`` and nesting.

Before / after, for ``grads = autopar.grad(loss)(w)``::

    { lambda ; w:f32[4] x:f32[8,4]. let      { lambda ; w:f32[4] x:f32[8,4]. let
        ... backward pass ...                  ... backward pass ...
        g:f32[4] = ...                   ->    g:f32[4] = ...
      in (g,) }                                gm:f32[4] = autopar_grad g
                                             in (gm,) }
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from autopar.remat import maybe_roll

__all__ = ["grad", "value_and_grad", "grad_marker_p", "mark_gradients"]


# -- primitive ---------------------------------------------------------------

grad_marker_p = Primitive("autopar_grad")
grad_marker_p.multiple_results = True


def _identity_impl(*xs, names=()):
  del names
  return xs


def _abstract_eval(*avals, names=()):
  # Identity: the avals (including any varying-manual-axes info inside
  # shard_map) pass through unchanged. `names` are the gradients' pytree
  # paths, kept so that plans can name every gradient.
  del names
  return avals


grad_marker_p.def_impl(_identity_impl)
grad_marker_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(
    grad_marker_p, mlir.lower_fun(_identity_impl, multiple_results=True))


def _jvp(primals, tangents, *, names):
  # The primal values stay marked; tangents pass through unmarked, so that
  # differentiating a marked function does not multiply the markers.
  return grad_marker_p.bind(*primals, names=names), list(tangents)


def _transpose(cts, *args, names):
  # The marker is linear (the identity): its transpose is the identity too.
  del names
  return [ct if ad.is_undefined_primal(x) else None
          for ct, x in zip(cts, args, strict=True)]


def _batch(args, dims, *, names):
  return grad_marker_p.bind(*args, names=names), dims


ad.primitive_jvps[grad_marker_p] = _jvp
ad.primitive_transposes[grad_marker_p] = _transpose
batching.primitive_batchers[grad_marker_p] = _batch


# -- API ---------------------------------------------------------------------

def mark_gradients(grads: Any) -> Any:
  """Passes a pytree of gradients through the grad marker (identity)."""
  with_path, treedef = jax.tree_util.tree_flatten_with_path(grads)
  if not with_path:
    return grads
  names = tuple("grad" + jax.tree_util.keystr(kp) for kp, _ in with_path)
  marked = grad_marker_p.bind(*(x for _, x in with_path), names=names)
  return jax.tree_util.tree_unflatten(treedef, marked)


def grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False,
         holomorphic: bool = False, allow_int: bool = False,
         reduce_axes: Sequence[Any] = ()) -> Callable:
  """``jax.grad`` that marks its gradients for autopar's splitter.

  Same signature and results as ``jax.grad``. Inside a step decorated with
  ``@autopar.parallelize``, the returned gradients are where the step is cut
  into ``accumulate_grad`` (run per micro-batch) and ``apply_grad`` (run once
  per step). Elsewhere it behaves exactly like ``jax.grad``.

  Example::

      grads = autopar.grad(loss_fn)(state.params)
  """
  del reduce_axes  # accepted for signature compatibility with older jax
  grad_fn = jax.grad(maybe_roll(fun), argnums=argnums, has_aux=has_aux,
                     holomorphic=holomorphic, allow_int=allow_int)

  def marked(*args, **kwargs):
    out = grad_fn(*args, **kwargs)
    if has_aux:
      g, aux = out
      return mark_gradients(g), aux
    return mark_gradients(out)

  return marked


def value_and_grad(fun: Callable, argnums: int | Sequence[int] = 0,
                   has_aux: bool = False, holomorphic: bool = False,
                   allow_int: bool = False,
                   reduce_axes: Sequence[Any] = ()) -> Callable:
  """``jax.value_and_grad`` that marks its gradients for autopar's splitter.

  Same signature and results as ``jax.value_and_grad``; only the gradients
  are marked (the value and any ``aux`` are ordinary outputs of the gradient
  computation, combined over micro-batches as described in ``docs/``).

  Example::

      loss, grads = autopar.value_and_grad(loss_fn)(state.params)
  """
  del reduce_axes
  vg_fn = jax.value_and_grad(maybe_roll(fun), argnums=argnums, has_aux=has_aux,
                             holomorphic=holomorphic, allow_int=allow_int)

  def marked(*args, **kwargs):
    value, g = vg_fn(*args, **kwargs)
    return value, mark_gradients(g)

  return marked
