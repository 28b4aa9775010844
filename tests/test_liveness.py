"""The liveness the planners' memory estimates read (autopar/liveness.py)."""

import math

import jax
import jax.numpy as jnp

from autopar.liveness import conv_relayouts, liveness_peaks


def _peak(fn, *avals, gathered=(), released=()):
  jaxpr = jax.make_jaxpr(fn)(*avals).jaxpr
  live = liveness_peaks(jaxpr, k=1, gathered=[jaxpr.invars[i] for i in gathered],
                        released=[jaxpr.outvars[i] for i in released])[0]
  return sum(math.prod(v.aval.shape) * v.aval.dtype.itemsize for v in live)


X = jax.ShapeDtypeStruct((64, 32), jnp.float32)
W = jax.ShapeDtypeStruct((32, 128), jnp.float32)
ONE = 64 * 128 * 4                               # one [64, 128] float32 buffer


def test_an_element_wise_chain_and_a_transpose_hold_one_buffer():
  # The dot makes a buffer; +1, tanh and *2 write into it as their operand
  # dies; the transpose and the reshape read it another way.
  assert _peak(lambda x, w: (jnp.tanh(x @ w + 1.0).T.reshape(-1) * 2.0).sum(),
               X, W) == ONE + 4
  # A view of an input is the input's buffer: not counted.
  assert _peak(lambda x, w: (x.T.reshape(-1) * 2.0).sum(), X, W) == 64 * 32 * 4 + 4


def test_an_operand_read_later_or_of_another_size_keeps_its_buffer():
  def f(x, w):
    h = x @ w
    return (jnp.tanh(h) + h).sum()
  assert _peak(f, X, W) == 2 * ONE
  # float32 -> bfloat16 cannot take the float32 buffer.
  assert _peak(lambda x, w: (x @ w).astype(jnp.bfloat16).sum(), X, W) == ONE + ONE // 2


def test_gathered_inputs_are_held_from_first_to_last_reader():
  big = jax.ShapeDtypeStruct((32, 4096), jnp.float32)

  def f(x, w):
    h = jnp.tanh(x @ w)                            # [64, 4096]: the peak
    return (h @ w.T).sum()
  plain = _peak(f, X, big)
  assert plain == 64 * 4096 * 4 + 64 * 32 * 4      # h and the second dot's result
  # w is read by both dots: its gathered copy is held across the peak.
  assert _peak(f, X, big, gathered=[1]) == plain + 32 * 4096 * 4
  # x is read by the first dot only, before h is made.
  assert _peak(f, X, big, gathered=[0]) == plain


def test_released_outputs_end_where_they_are_made():
  def f(x, w):
    return x @ w, jnp.tanh(x) @ w                  # two [64, 128] outputs
  assert _peak(f, X, W) == 2 * ONE + 64 * 32 * 4
  # The first handed on as it is made: the two are never held together.
  assert _peak(f, X, W, released=[0]) == ONE + 64 * 32 * 4
  # An output that is a literal (an unused input's zero gradient) is ignored.
  jaxpr = jax.make_jaxpr(jax.grad(lambda p, x: (p["w"] * x).sum()))(
      {"w": jnp.ones(3), "b": jnp.float32(0)}, jnp.ones(3)).jaxpr
  assert liveness_peaks(jaxpr, k=1, released=jaxpr.outvars)


def test_a_filter_gradient_convolution_works_on_relaid_copies():
  x = jax.ShapeDtypeStruct((8, 16, 16, 4), jnp.float32)
  k = jax.ShapeDtypeStruct((3, 3, 4, 8), jnp.float32)

  def conv(x, k):
    return jax.lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))
  out = 8 * 16 * 16 * 8 * 4
  # The forward convolution is in XLA:CPU's order: no copy.
  assert _peak(lambda x, k: conv(x, k).sum(), x, k) == out + 4
  # Its filter gradient reads the input and the output's cotangent with
  # batch and feature swapped, and writes the kernel's: all three copied,
  # and held while it runs.
  def filter_grad(x, dy):
    return jax.vjp(lambda k: conv(x, k), jnp.zeros(k.shape, k.dtype))[1](dy)[0]
  closed = jax.make_jaxpr(filter_grad)(x, jax.ShapeDtypeStruct((8, 16, 16, 8),
                                                               jnp.float32))
  convs = [e for e in closed.jaxpr.eqns if e.primitive.name == "conv_general_dilated"]
  assert conv_relayouts(convs[-1]) == [*convs[-1].invars, *convs[-1].outvars]
  live = liveness_peaks(closed.jaxpr, k=1)[0]
  held = sum(math.prod(v.aval.shape) * 4 for v in live)
  kernel = 3 * 3 * 4 * 8 * 4
  assert held == 8 * 16 * 16 * 4 * 4 + out + 2 * kernel


def test_a_broadcast_read_only_element_wise_is_fused():
  # relu's backward selects between the cotangent and a broadcast zero:
  # XLA fuses the broadcast into the select.
  def f(x, w):
    h = x @ w
    return jax.lax.select(h > 0, h, jnp.zeros_like(h)).sum()
  assert _peak(f, X, W) == ONE + 4                   # h (the mask is fused too), the sum
  # A broadcast a dot reads is made.
  def g(x, w):
    b = jnp.broadcast_to(w[:1], (64, 128))
    return (jnp.tanh(x @ w) @ b.T).sum()
  assert _peak(g, X, W) >= ONE + 64 * 128 * 4


def test_a_mask_read_later_holds_the_compared_values():
  # A ReLU's mask, read by the backward pass: XLA computes the comparison
  # inside its one reader, so it holds h (float32) there, not a boolean mask.
  def f(x, w):
    h = x @ w
    mask = h > 0
    z = ((h * 2.0) @ w.T) @ w
    return jax.lax.select(mask, z, jnp.zeros_like(z))
  held = _peak(f, X, W)
  assert held == 2 * ONE + 64 * 32 * 4               # h, z and the [64, 32] between
  memory = jax.jit(f).lower(X, W).compile().memory_analysis()
  assert held == memory.temp_size_in_bytes + memory.output_size_in_bytes


def test_a_loop_body_holds_its_own_values_while_it_runs():
  # Each trip makes a [64, 128] value the body reads and drops: held while
  # the scan runs, beside the scan's result; the body's result (the new
  # carry) is the scan's own output, counted once.
  def f(x, w):
    def body(c, _):
      h = jnp.tanh(c @ w)                            # [64, 128], the body's own
      return c + (h @ w.T), None
    return jax.lax.scan(body, x, None, length=3)[0].sum()
  held = _peak(f, X, W)
  # The scan's result ([64, 32]); in the body, h ([64, 128]) and h @ w.T ([64, 32]).
  assert held == 64 * 32 * 4 + ONE + 64 * 32 * 4
  memory = jax.jit(f).lower(X, W).compile().memory_analysis()   # 49176 + 4
  assert abs(held - memory.temp_size_in_bytes) <= 32
