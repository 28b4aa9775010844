"""The liveness the planners' memory estimates read (autopar/liveness.py)."""

import math

import jax
import jax.numpy as jnp

from autopar.liveness import liveness_peaks


def _peak(fn, *avals, gathered=()):
  closed = jax.make_jaxpr(fn)(*avals)
  jaxpr = closed.jaxpr
  live = liveness_peaks(jaxpr, 0, k=1,
                        gathered=[jaxpr.invars[i] for i in gathered])[0]
  return sum(math.prod(v.aval.shape) * v.aval.dtype.itemsize for v in live)


X = jax.ShapeDtypeStruct((64, 32), jnp.float32)
W = jax.ShapeDtypeStruct((32, 128), jnp.float32)
ONE = 64 * 128 * 4                               # one [64, 128] float32 buffer


def test_an_element_wise_chain_and_a_transpose_hold_one_buffer():
  # The dot makes a buffer; +1, tanh and *2 write into it as their operand
  # dies; the transpose reads it another way.
  assert _peak(lambda x, w: (jnp.tanh(x @ w + 1.0).T * 2.0).sum(), X, W) == ONE + 4


def test_an_operand_read_later_keeps_its_buffer():
  def f(x, w):
    h = x @ w
    return (jnp.tanh(h) + h).sum()
  assert _peak(f, X, W) == 2 * ONE


def test_gathered_inputs_are_held_from_first_to_last_reader():
  def f(x, w):
    h = jnp.tanh(x @ w)
    return (h @ w.T).sum()
  plain = _peak(f, X, W)
  assert _peak(f, X, W, gathered=[1]) == plain + 32 * 128 * 4
  assert _peak(f, X, W, gathered=[0]) == plain     # read by the first equation only


def test_a_filter_gradient_convolution_works_on_relaid_copies():
  x = jax.ShapeDtypeStruct((8, 16, 16, 4), jnp.float32)
  k = jax.ShapeDtypeStruct((3, 3, 4, 8), jnp.float32)

  def conv(x, k):
    return jax.lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))
  out = 8 * 16 * 16 * 8 * 4
  # The forward convolution is in XLA's order: no copy.
  assert _peak(lambda x, k: conv(x, k).sum(), x, k) == out + 4
  # Its filter gradient reads the input and the output's cotangent with
  # batch and feature swapped, and writes the kernel's: all three copied.
  def filter_grad(x, k):
    return jax.grad(lambda k: (conv(x, k) ** 2).sum())(k)
  closed = jax.make_jaxpr(filter_grad)(x, k)
  convs = [e for e in closed.jaxpr.eqns if e.primitive.name == "conv_general_dilated"]
  from autopar.liveness import conv_relayouts
  assert conv_relayouts(convs[0]) == []
  assert conv_relayouts(convs[-1]) == [*convs[-1].invars, *convs[-1].outvars]
