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

import sys
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from autopar.jax_compat import ad, batching, mlir

from autopar.errors import MarkerError
from autopar.frontend.capture import captured, capturing
from autopar.frontend.remat import maybe_roll

__all__ = ["grad", "value_and_grad", "filter_grad", "filter_value_and_grad",
           "grad_marker_p", "value_marker_p", "mark_gradients"]


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


# The value of autopar.value_and_grad (the loss): an identity, so that the
# splitter knows which value is the mean over the batch's rows that the
# gradient's averaging assumes (see combine.py).
value_marker_p = Primitive("autopar_value")
value_marker_p.def_impl(lambda x: x)
value_marker_p.def_abstract_eval(lambda aval: aval)
mlir.register_lowering(value_marker_p, mlir.lower_fun(lambda x: x, multiple_results=False))
ad.deflinear2(value_marker_p, lambda ct, _: [ct])
batching.defvectorized(value_marker_p)


def _mark_value(value, has_aux: bool):
  """The loss (``value``, or its first element with ``has_aux``) marked."""
  if has_aux:
    loss, aux = value
    return value_marker_p.bind(loss), aux
  return value_marker_p.bind(value)


# -- API ---------------------------------------------------------------------

def mark_gradients(grads: Any) -> Any:
  """Passes a pytree of gradients through the grad marker (identity)."""
  with_path, treedef = jax.tree_util.tree_flatten_with_path(grads)
  if not with_path:
    return grads
  names = tuple("grad" + jax.tree_util.keystr(kp) for kp, _ in with_path)
  marked = grad_marker_p.bind(*(x for _, x in with_path), names=names)
  return jax.tree_util.tree_unflatten(treedef, marked)


def grad(fun: Callable, argnums: Any = 0, has_aux: bool = False,
         holomorphic: bool = False, allow_int: bool = False,
         reduce_axes: Sequence[Any] = (), *, wrt: Any = None) -> Callable:
  """``jax.grad`` that marks its gradients for autopar's splitter (Alpa's
  ``alpa.grad``).

  Same signature and results as ``jax.grad`` (for a Flax NNX module, as
  ``nnx.grad``; see :func:`value_and_grad`). Inside a step decorated with
  ``@autopar.parallelize``, the returned gradients are where the step is cut
  into ``accumulate_grad`` (run per micro-batch) and ``apply_grad`` (run once
  per step), and averaged over micro-batches; an ``aux`` output is combined
  over them too. Elsewhere it behaves exactly like ``jax.grad``.

  Example::

      grads = autopar.grad(loss_fn)(state.params)
  """
  del reduce_axes  # accepted for signature compatibility with older jax
  vg = value_and_grad(fun, argnums=argnums, has_aux=has_aux, holomorphic=holomorphic,
                      allow_int=allow_int, wrt=wrt)

  def marked(*args, **kwargs):
    value, g = vg(*args, **kwargs)
    return (g, value[1]) if has_aux else g

  return marked


def value_and_grad(fun: Callable, argnums: Any = 0, has_aux: bool = False,
                   holomorphic: bool = False, allow_int: bool = False,
                   reduce_axes: Sequence[Any] = (), *, wrt: Any = None) -> Callable:
  """``jax.value_and_grad`` that marks its gradients for autopar's splitter.

  Same signature and results as ``jax.value_and_grad``; only the gradients
  are marked (the value and any ``aux`` are ordinary outputs of the gradient
  computation, combined over micro-batches as described in ``docs/``).

  Given a Flax NNX module (or another NNX graph node) to differentiate, it is
  ``nnx.value_and_grad``: gradients for the module's ``nnx.Param`` variables
  (``wrt``: another NNX filter, or ``argnums=nnx.DiffState(...)``), as an
  ``nnx.State``, and the module's other changes (an RNG counter) kept.

  Example::

      loss, grads = autopar.value_and_grad(loss_fn)(state.params)
      loss, grads = autopar.value_and_grad(loss_fn)(model)     # an nnx.Module
  """
  del reduce_axes
  rolled = _differentiated(fun)
  vg_fn = None

  def marked(*args, **kwargs):
    nonlocal vg_fn
    nnx = _nnx_for(args, argnums)
    if nnx is not None:
      value, g = _nnx_value_and_grad(nnx, rolled, argnums, has_aux, holomorphic,
                                     allow_int, wrt)(*args, **kwargs)
    else:
      if vg_fn is None:
        vg_fn = jax.value_and_grad(rolled, argnums=argnums, has_aux=has_aux,
                                   holomorphic=holomorphic, allow_int=allow_int)
      value, g = vg_fn(*args, **kwargs)
    return _mark_value(value, has_aux), mark_gradients(g)

  return marked


def _differentiated(fun: Callable) -> Callable:
  """``fun`` as autopar differentiates it: with its repeated layers rolled
  under ``remat="layers"`` (``remat.py``), or, while autopar traces the step,
  as one call (``frontend/capture.py``)."""
  rolled, capture = maybe_roll(fun), captured(fun)

  def call(*args, **kwargs):
    return (capture if capturing() else rolled)(*args, **kwargs)
  return call


def _nnx_for(args, argnums):
  """flax.nnx if an argument to differentiate is an NNX graph node, else None."""
  nnx = sys.modules.get("flax.nnx")
  if nnx is None:
    return None
  nums = getattr(argnums, "argnum", argnums)
  nums = (nums,) if isinstance(nums, int) else tuple(getattr(a, "argnum", a) for a in nums)
  if any(n < len(args) and nnx.graphlib.is_graph_node(args[n]) for n in nums):
    return nnx
  return None


def _nnx_value_and_grad(nnx, fun, argnums, has_aux, holomorphic, allow_int, wrt):
  if wrt is not None:
    if not isinstance(argnums, int):
      raise MarkerError("autopar.value_and_grad: wrt= goes with one argnum; for "
                        "several, pass argnums=(nnx.DiffState(i, filter), ...).")
    argnums = nnx.DiffState(argnums, wrt)
  return nnx.value_and_grad(fun, argnums=argnums, has_aux=has_aux,
                            holomorphic=holomorphic, allow_int=allow_int)


# -- Equinox's filtered gradients ------------------------------------------------

def _is_inexact_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray)) and jnp.issubdtype(x.dtype, jnp.inexact)


def _filtered(tree, keep):
  """(``tree`` with the leaves ``keep`` selects, None elsewhere; the rest)."""
  return (jax.tree_util.tree_map(lambda x: x if keep(x) else None, tree),
          jax.tree_util.tree_map(lambda x: None if keep(x) else x, tree))


def _combined(a, b):
  """The leaves of ``a``, and those of ``b`` where ``a`` has None."""
  return jax.tree_util.tree_map(lambda x, y: y if x is None else x, a, b,
                                is_leaf=lambda x: x is None)


def filter_value_and_grad(fun: Callable, *, has_aux: bool = False) -> Callable:
  """``equinox.filter_value_and_grad`` that marks its gradients for autopar.

  Differentiates ``fun`` with respect to the floating-point array leaves of
  its first argument (an Equinox module, say); its other leaves (integer
  arrays, functions, Python numbers) are held fixed and get None in the
  gradient, as under Equinox. The other arguments are not differentiated.

  Example::

      loss, grads = autopar.filter_value_and_grad(loss_fn)(model, x, y)
  """
  rolled = _differentiated(fun)

  def marked(x, *args, **kwargs):
    diff, fixed = _filtered(x, _is_inexact_array)
    value, g = jax.value_and_grad(
        lambda d: rolled(_combined(d, fixed), *args, **kwargs), has_aux=has_aux)(diff)
    return _mark_value(value, has_aux), mark_gradients(g)

  return marked


def filter_grad(fun: Callable, *, has_aux: bool = False) -> Callable:
  """``equinox.filter_grad`` that marks its gradients for autopar (see
  :func:`filter_value_and_grad`); with ``has_aux``, returns ``(grads, aux)``."""
  vg = filter_value_and_grad(fun, has_aux=has_aux)

  def marked(*args, **kwargs):
    value, g = vg(*args, **kwargs)
    return (g, value[1]) if has_aux else g

  return marked
