"""The loss function as one call in the step.

The function that ``autopar.value_and_grad`` differentiates must be found
in the traced step: ``split.py`` inlines its forward pass to derive the
loss's gradient as the whole batch's (``loss.py``), and
``PipeshardParallel`` cuts that forward pass into stages, each
differentiated on its own (``stages.py``). So a step that autopar traces,
under any method (:func:`capture_mode`, in ``trace.py``), calls the loss
function through :func:`captured`: it is traced to a jaxpr ``F`` and bound
as one primitive, ``autopar_forward``. JAX's autodiff then turns
its derivative into one more, ``autopar_backward``, through the rules below
(the JVP is the linear ``autopar_forward_lin``, whose transpose is the
backward call)::

    loss, g = value_and_grad(f)(w)         { lambda ; w x. let
                                               l = autopar_forward[jaxpr=F] w x
                                 ->            g = autopar_backward[jaxpr=F] w x 1.0
                                             in (l, g) }

Both primitives have an implementation (``F`` evaluated, and its VJP), so a
captured step is still an ordinary JAX program.

:func:`mark_pipeline_boundary` (Alpa's name) marks where the user wants a
stage boundary (``layers="manual"``): an equation with no operands and no
results, which only a captured forward pass keeps.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Primitive, jaxpr_as_fun
from autopar import jax_compat as jc
from autopar.jax_compat import ad, batching, mlir

from autopar.frontend.pytrees import leaf_mask

__all__ = ["forward_p", "forward_lin_p", "backward_p", "boundary_p",
           "mark_pipeline_boundary", "capturing", "capture_mode", "captured"]


# -- the primitives -------------------------------------------------------------

def _differentiable(aval) -> bool:
  return jnp.issubdtype(aval.dtype, jnp.inexact)


def _function(jaxpr, diff, primals, outd):
  """``F`` as a function of its differentiated inputs, returning its
  differentiated outputs (``diff`` / ``outd``: masks)."""
  def f(*d):
    it = iter(d)
    full = [next(it) if m else p for m, p in zip(diff, primals, strict=True)]
    outs = jaxpr_as_fun(jaxpr)(*full)
    return [o for o, m in zip(outs, outd, strict=True) if m]
  return f, [p for p, m in zip(primals, diff, strict=True) if m]


forward_p = Primitive("autopar_forward")
forward_p.multiple_results = True


def _forward_impl(*args, jaxpr, name):
  del name
  return jaxpr_as_fun(jaxpr)(*args)


forward_p.def_impl(_forward_impl)
forward_p.def_abstract_eval(lambda *a, jaxpr, name: [v.aval for v in jaxpr.jaxpr.outvars])
mlir.register_lowering(forward_p, mlir.lower_fun(_forward_impl, multiple_results=True))


def _forward_jvp(primals, tangents, *, jaxpr, name):
  outs = forward_p.bind(*primals, jaxpr=jaxpr, name=name)
  diff = tuple(type(t) is not ad.Zero for t in tangents)
  outd = tuple(_differentiable(v.aval) for v in jaxpr.jaxpr.outvars)
  if not any(diff) or not any(outd):
    return outs, [_zero_tangent(o) for o in outs]
  ts = [t for t in tangents if type(t) is not ad.Zero]
  tout = iter(forward_lin_p.bind(*primals, *ts, jaxpr=jaxpr, name=name, diff=diff,
                                 outd=outd))
  return outs, [next(tout) if d else _zero_tangent(o)
                for d, o in zip(outd, outs, strict=True)]


def _zero_tangent(x):
  """The symbolic zero tangent of ``x`` (float0 for an integer)."""
  return ad.Zero(jax.typeof(x).to_tangent_aval())


ad.primitive_jvps[forward_p] = _forward_jvp


def _forward_batch(args, dims, *, jaxpr, name):
  f = functools.partial(_forward_impl, jaxpr=jaxpr, name=name)
  return jax.vmap(f, in_axes=dims)(*args), [0] * len(jaxpr.jaxpr.outvars)


batching.primitive_batchers[forward_p] = _forward_batch


# The JVP of F: linear in its tangents (after the primals).
forward_lin_p = Primitive("autopar_forward_lin")
forward_lin_p.multiple_results = True


def _lin_impl(*args, jaxpr, name, diff, outd):
  del name
  primals, tangents = args[:len(diff)], args[len(diff):]
  f, dp = _function(jaxpr, diff, primals, outd)
  return jax.jvp(f, dp, list(tangents))[1]


forward_lin_p.def_impl(_lin_impl)
forward_lin_p.def_abstract_eval(
    lambda *a, jaxpr, name, diff, outd: [v.aval for v, m in zip(jaxpr.jaxpr.outvars, outd)
                                         if m])
mlir.register_lowering(forward_lin_p, mlir.lower_fun(_lin_impl, multiple_results=True))


def _lin_transpose(cts, *args, jaxpr, name, diff, outd):
  primals = args[:len(diff)]
  if any(ad.is_undefined_primal(p) for p in primals):
    raise NotImplementedError("autopar: the loss function's primal inputs must be "
                              "known when it is transposed")
  cmask = tuple(type(c) is not ad.Zero for c in cts)
  if not any(cmask):
    return [None] * len(args)
  grads = backward_p.bind(*primals, *(c for c in cts if type(c) is not ad.Zero),
                          jaxpr=jaxpr, name=name, diff=diff, outd=outd, cmask=cmask)
  return [None] * len(primals) + list(grads)


ad.primitive_transposes[forward_lin_p] = _lin_transpose


# The VJP of F: the cotangents of its differentiated inputs.
backward_p = Primitive("autopar_backward")
backward_p.multiple_results = True


def _backward_impl(*args, jaxpr, name, diff, outd, cmask):
  del name
  primals, cts = args[:len(diff)], iter(args[len(diff):])
  f, dp = _function(jaxpr, diff, primals, outd)
  outs, vjp = jax.vjp(f, *dp)
  return vjp([next(cts) if m else jnp.zeros_like(o)
              for o, m in zip(outs, cmask, strict=True)])


backward_p.def_impl(_backward_impl)
backward_p.def_abstract_eval(
    lambda *a, jaxpr, name, diff, outd, cmask: [
        v.aval for v, m in zip(jaxpr.jaxpr.invars, diff) if m])
mlir.register_lowering(backward_p, mlir.lower_fun(_backward_impl, multiple_results=True))


def _vmapped(impl):
  def rule(args, dims, **params):
    out = jax.vmap(functools.partial(impl, **params), in_axes=dims)(*args)
    return out, [0] * len(out)
  return rule


batching.primitive_batchers[forward_lin_p] = _vmapped(_lin_impl)
batching.primitive_batchers[backward_p] = _vmapped(_backward_impl)


# -- the boundary marker ---------------------------------------------------------

boundary_p = Primitive("autopar_pipeline_boundary")
boundary_p.multiple_results = True
boundary_p.def_impl(lambda: [])
boundary_p.def_abstract_eval(lambda: [])
mlir.register_lowering(boundary_p, lambda ctx: [])
ad.primitive_jvps[boundary_p] = lambda primals, tangents: ([], [])
batching.primitive_batchers[boundary_p] = lambda args, dims: ([], [])


def mark_pipeline_boundary() -> None:
  """Marks a pipeline stage boundary in the forward pass (Alpa's name).

  With ``PipeshardParallel(layers="manual")`` the forward pass of the
  function given to :func:`autopar.value_and_grad` is cut into layers at
  these calls, and stages are made of consecutive layers. Call it at the
  function's top level, between layers (not inside ``lax.scan``, a loop
  body or a ``cond`` branch). Anywhere else, and outside autopar, it does
  nothing.

  Example::

      def loss_fn(params, x):
        x = block(params["block_0"], x)
        autopar.mark_pipeline_boundary()
        x = block(params["block_1"], x)
        return jnp.mean(x ** 2)
  """
  boundary_p.bind()


# -- capturing -------------------------------------------------------------------

_CAPTURE: contextvars.ContextVar = contextvars.ContextVar("autopar_capture",
                                                          default=False)


def capturing() -> bool:
  """Whether autopar is tracing a step (see :func:`captured`)."""
  return _CAPTURE.get()


@contextlib.contextmanager
def capture_mode(on: bool = True):
  """While autopar traces a step: the loss function is one call."""
  token = _CAPTURE.set(on)
  try:
    yield
  finally:
    _CAPTURE.reset(token)


def _variable_owners(tree, num_leaves: int) -> list:
  """Per leaf of ``tree``, the Flax NNX variable it is the value of (None if
  it is no variable's value)."""
  nnx = sys.modules.get("flax.nnx")
  variable = getattr(nnx, "Variable", None) if nnx is not None else None
  if variable is None:
    return [None] * num_leaves
  owners = []
  for piece in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, variable)):
    if isinstance(piece, variable):
      owners.extend([piece] * len(jax.tree_util.tree_leaves(piece)))
    else:
      owners.append(None)
  return owners if len(owners) == num_leaves else [None] * num_leaves


def captured(fun: Callable) -> Callable:
  """``fun`` bound as one ``autopar_forward`` call (see the module docstring).

  Array leaves of the arguments (and arrays ``fun`` closes over) are its
  operands; other leaves are static. Values of Flax NNX variables that
  ``fun`` changes (an RNG stream's counter) are results of the call too, and
  are written back into the caller's variables, as if ``fun`` had run.
  """
  name = getattr(fun, "__name__", "loss_fn")

  def call(*args, **kwargs):
    tree_in = (args, kwargs)
    flat, tree = jax.tree_util.tree_flatten(tree_in)
    is_array = leaf_mask(tree_in)
    arrays = [x for a, x in zip(is_array, flat) if a]
    record: dict[str, Any] = {}

    def flat_fun(*xs):
      it = iter(xs)
      a, k = jax.tree_util.tree_unflatten(
          tree, [next(it) if m else x for m, x in zip(is_array, flat)])
      out = fun(*a, **k)
      out_leaves, out_tree = jax.tree_util.tree_flatten(out)
      after = jax.tree_util.tree_leaves((a, k))
      after = [x for m, x in zip(is_array, after) if m] if len(after) == len(flat) \
          else list(xs)
      changed = [j for j, (x0, x1) in enumerate(zip(xs, after)) if x1 is not x0]
      traced = [isinstance(o, jc.Tracer) for o in out_leaves]
      record.update(out_tree=out_tree, traced=traced, changed=changed,
                    constants=[None if t else o for t, o in zip(traced, out_leaves)])
      return [o for o, t in zip(out_leaves, traced) if t] + [after[j] for j in changed]

    closed = jax.make_jaxpr(flat_fun)(*arrays)
    # Constants (arrays the function closes over, the step's own values among
    # them) become operands: F reads only its inputs.
    jaxpr = jc.convert_constvars_jaxpr(closed.jaxpr)
    outs = forward_p.bind(*closed.consts, *arrays, jaxpr=ClosedJaxpr(jaxpr, ()), name=name)
    num_out = sum(record["traced"])
    results, updates = outs[:num_out], outs[num_out:]
    if record["changed"]:
      owners = [o for o, m in zip(_variable_owners(tree_in, len(flat)), is_array) if m]
      for j, value in zip(record["changed"], updates, strict=True):
        if owners[j] is None:
          raise NotImplementedError(
              f"autopar: {name} changed argument leaf {j} in place, which is not a "
              f"Flax NNX variable; autopar cannot hand the change back.")
        owners[j].set_value(value)
    it = iter(results)
    leaves = [next(it) if t else c for t, c in zip(record["traced"], record["constants"])]
    return jax.tree_util.tree_unflatten(record["out_tree"], leaves)

  return call
