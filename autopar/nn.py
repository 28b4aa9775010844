"""Memory helpers for model code: scanned layers and a chunked loss.

* :func:`scan_layers` runs a stack of identical layers as one ``lax.scan`` over
  stacked weights, with ``jax.checkpoint`` on the body: XLA compiles one loop
  body, and during the backward pass only one layer's activations are live
  (plus the ``[batch, ..., d]`` carry saved at each layer boundary).
* :func:`chunked_cross_entropy` is the mean token cross-entropy of
  ``hidden @ unembedding`` that never builds the ``[tokens, vocab]`` logits:
  they are made chunk by chunk in the forward pass and again in the backward
  pass (a custom VJP).

Both are ordinary JAX functions; autopar's planner plans through the scans
they make (the body once, costed for every iteration).

Example::

    y = autopar.nn.scan_layers(block, stacked_params, x)
    loss = autopar.nn.chunked_cross_entropy(y, params["head"], labels, chunk_size=1024)
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from autopar import jax_compat as jc
from autopar.errors import InputError

__all__ = ["scan_layers", "chunked_cross_entropy"]


# -- scanned layers ------------------------------------------------------------

def scan_layers(layer_fn: Callable[[Any, Any], Any], stacked_params: Any, x: Any,
                remat: bool | Callable = True) -> Any:
  """``x`` through ``layer_fn`` once per layer, as one ``lax.scan``.

  Args:
    layer_fn: ``layer_fn(layer_params, x) -> x``; the output has the same
      shapes and dtypes as ``x`` (any pytree).
    stacked_params: the layers' parameters, every leaf stacked on a leading
      axis of length ``num_layers`` (``jax.tree.map(lambda *p: jnp.stack(p),
      *per_layer)`` makes it from a list).
    x: the input of the first layer.
    remat: True recomputes each layer's activations in the backward pass
      (``jax.checkpoint`` on the body, saving nothing inside it); a
      ``jax.checkpoint_policies`` policy saves what it names; False stores
      everything, as a Python loop would.

  Returns:
    The last layer's output.
  """
  leaves = jax.tree_util.tree_leaves_with_path(stacked_params)
  if not leaves:
    raise InputError("scan_layers: stacked_params has no arrays; pass the layers' "
                     "parameters stacked on a leading layer axis.")
  lengths = {}
  for path, leaf in leaves:
    shape = jnp.shape(leaf)
    if not shape:
      raise InputError(f"scan_layers: stacked_params{jax.tree_util.keystr(path)} is a "
                       f"scalar; every leaf needs a leading layer axis. Fix: stack the "
                       f"per-layer parameters with jnp.stack.")
    lengths.setdefault(shape[0], jax.tree_util.keystr(path))
  if len(lengths) > 1:
    detail = ", ".join(f"stacked_params{p} has {n}" for n, p in lengths.items())
    raise InputError(f"scan_layers: the leaves of stacked_params disagree on the "
                     f"number of layers ({detail} on axis 0). Fix: stack every "
                     f"parameter of every layer on axis 0.")

  def body(carry, layer_params):
    out = layer_fn(layer_params, carry)
    if (jax.tree.structure(out) != jax.tree.structure(carry) or
        any(jnp.shape(a) != jnp.shape(b) or jnp.result_type(a) != jnp.result_type(b)
            for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(carry)))):
      raise InputError(
          f"scan_layers: layer_fn must return what it takes (same pytree, shapes "
          f"and dtypes); it took {jax.tree.map(jax.typeof, carry)} and returned "
          f"{jax.tree.map(jax.typeof, out)}.")
    return out, None

  if remat is True:
    body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
  elif callable(remat):
    body = jax.checkpoint(body, policy=remat)
  elif remat is not False:
    raise InputError(f"scan_layers: remat={remat!r}; expected True, False or a "
                     f"jax.checkpoint_policies policy.")
  out, _ = lax.scan(body, x, stacked_params)
  return out


# -- chunked cross-entropy -----------------------------------------------------

def chunked_cross_entropy(hidden: jax.Array, unembedding: jax.Array,
                          labels: jax.Array, chunk_size: int = 1024,
                          mask: jax.Array | None = None,
                          return_logprobs: bool = False):
  """Mean token cross-entropy of ``hidden @ unembedding`` against ``labels``.

  Equals ``optax.softmax_cross_entropy_with_integer_labels(hidden @
  unembedding, labels)`` averaged over the tokens (weighted by ``mask``), with
  the same gradients, but holds at most ``[chunk_size, vocab]`` logits at a
  time: the forward pass keeps only each token's log-sum-exp, and the
  backward pass makes each chunk's logits again. Logits are computed and
  reduced in float32 whatever the input dtype.

  Args:
    hidden: ``[..., d]`` final hidden states.
    unembedding: ``[d, vocab]``.
    labels: ``[...]`` integer token ids, the shape of ``hidden`` without ``d``.
    chunk_size: tokens per chunk. The token count need not divide by it: the
      last chunk is padded, and padded tokens count for nothing.
    mask: optional ``[...]`` weights (bool or float); the loss is
      ``sum(mask * nll) / sum(mask)`` (0 if the mask is all zero).
    return_logprobs: also return the log-probability of each label, shaped
      like ``labels`` (differentiable too).

  Returns:
    The loss, a float32 scalar; or ``(loss, logprobs)``.
  """
  hidden, unembedding, labels = (jnp.asarray(hidden), jnp.asarray(unembedding),
                                 jnp.asarray(labels))
  if hidden.ndim < 1 or unembedding.ndim != 2 or unembedding.shape[0] != hidden.shape[-1]:
    raise InputError(
        f"chunked_cross_entropy: hidden {hidden.shape} and unembedding "
        f"{unembedding.shape} do not match; expected hidden [..., d] and "
        f"unembedding [d, vocab] with the same d.")
  if labels.shape != hidden.shape[:-1]:
    raise InputError(
        f"chunked_cross_entropy: labels {labels.shape} should have the shape of "
        f"hidden {hidden.shape} without its last axis, {hidden.shape[:-1]}.")
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise InputError(f"chunked_cross_entropy: labels have dtype {labels.dtype}; "
                     f"expected integer token ids.")
  if mask is not None and jnp.shape(mask) != labels.shape:
    raise InputError(f"chunked_cross_entropy: mask {jnp.shape(mask)} should have "
                     f"the shape of labels {labels.shape}.")
  if not isinstance(chunk_size, int) or chunk_size < 1:
    raise InputError(f"chunked_cross_entropy: chunk_size={chunk_size!r}; expected "
                     f"a positive int.")

  tokens = math.prod(labels.shape)
  # At a symbolic batch size (autopar traces steps once for every size) the
  # token count is not known: chunks of chunk_size, the last one padded.
  symbolic = jc.is_symbolic_dim(tokens)
  chunk = chunk_size if symbolic else min(chunk_size, max(tokens, 1))
  num_chunks = -(-tokens // chunk)
  pad = num_chunks * chunk - tokens
  h = hidden.reshape(tokens, hidden.shape[-1])
  y = labels.reshape(tokens).astype(jnp.int32)
  if symbolic or pad:
    h = jnp.pad(h, ((0, pad), (0, 0)))
    y = jnp.pad(y, (0, pad))
  logprobs = _label_logprobs(h.reshape(num_chunks, chunk, -1), unembedding,
                             y.reshape(num_chunks, chunk)).reshape(-1)[:tokens]

  if mask is None:
    loss = -jnp.mean(logprobs)
  else:
    w = jnp.asarray(mask).reshape(tokens).astype(jnp.float32)
    total = jnp.sum(w)
    loss = -jnp.sum(w * logprobs) / jnp.where(total == 0, 1.0, total)
  if return_logprobs:
    return loss, logprobs.reshape(labels.shape)
  return loss


def _chunk_logits(h, w):
  return jnp.dot(h, w, preferred_element_type=jnp.float32)


@jax.custom_vjp
def _label_logprobs(h, w, y):
  """log softmax(h @ w)[y] for chunks ``h`` [n, c, d], ``y`` [n, c] -> [n, c]."""
  return _label_logprobs_fwd(h, w, y)[0]


def _label_logprobs_fwd(h, w, y):
  def chunk(hy):
    hc, yc = hy
    logits = _chunk_logits(hc, w)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, yc[:, None], axis=-1)[:, 0]
    return picked - lse, lse
  lp, lse = lax.map(chunk, (h, y))
  return lp, (h, w, y, lse)


def _label_logprobs_bwd(res, ct):
  h, w, y, lse = res

  def chunk(dw, args):
    hc, yc, lc, cc = args
    logits = _chunk_logits(hc, w)
    # d logprob[y] / d logits = onehot(y) - softmax(logits)
    g = -jnp.exp(logits - lc[:, None]) * cc[:, None]
    g = g.at[jnp.arange(yc.shape[0]), yc].add(cc)
    dh = jnp.dot(g, w.T.astype(jnp.float32)).astype(h.dtype)
    dw = dw + jnp.dot(hc.T.astype(jnp.float32), g)
    return dw, dh

  dw, dh = lax.scan(chunk, jnp.zeros(w.shape, jnp.float32), (h, y, lse, ct))
  return dh, dw.astype(w.dtype), None


_label_logprobs.defvjp(_label_logprobs_fwd, _label_logprobs_bwd)
