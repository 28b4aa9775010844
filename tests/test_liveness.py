"""The liveness the planners' memory estimates read (autopar/costs/liveness.py)."""

import math

import jax
import jax.numpy as jnp

from autopar.costs.liveness import Fusions, conv_relayouts, liveness_peaks
from autopar.frontend.trace import _inline_marked_calls
from models import ConvNet


def _peak(fn, *avals, gathered=(), released=()):
  jaxpr = jax.make_jaxpr(fn)(*avals).jaxpr
  live = liveness_peaks(jaxpr, k=1, gathered=[jaxpr.invars[i] for i in gathered],
                        released=[jaxpr.outvars[i] for i in released])[0]
  return sum(math.prod(v.aval.shape) * v.aval.dtype.itemsize for v in live)


X = jax.ShapeDtypeStruct((64, 32), jnp.float32)
W = jax.ShapeDtypeStruct((32, 128), jnp.float32)
ONE = 64 * 128 * 4                               # one [64, 128] float32 buffer


def _compiled(fn, *avals):
  """XLA:CPU's temporaries and results for ``fn``: what the peak holds."""
  memory = jax.jit(fn).lower(*avals).compile().memory_analysis()
  return memory.temp_size_in_bytes + memory.output_size_in_bytes


def test_element_wise_work_is_computed_inside_its_reader():
  # +1 and tanh run inside the fusion that feeds the second dot: the first
  # dot's result and the second's, nothing between them.
  def chain(x, w):
    return jnp.tanh(x @ w + 1.0) @ w.T
  assert _peak(chain, X, W) == ONE + 64 * 32 * 4 == _compiled(chain, X, W)
  # A transpose of that chain is a copy (XLA:CPU's layouts are row-major),
  # into which the chain is fused: the dot's result and the copy.
  def transposed(x, w):
    return (jnp.tanh(x @ w + 1.0).T.reshape(-1) * 2.0).sum()
  assert _peak(transposed, X, W) == 2 * ONE == _compiled(transposed, X, W) - 4


def test_gathered_inputs_are_held_where_each_reader_runs():
  """Each reader of a gathered input gathers its own copy (ZeRO-3 under
  evaluate.py's Rules.gathers): held while that reader runs, not from the
  first reader to the last."""
  big = jax.ShapeDtypeStruct((32, 4096), jnp.float32)
  W_BYTES = 32 * 4096 * 4

  def f(x, w):
    h = jnp.tanh(x @ w)                            # [64, 4096]: the peak
    return jnp.einsum("bd,nd->bn", h, w).sum()     # reads w again
  plain = _peak(f, X, big)
  assert plain == 64 * 4096 * 4 + 64 * 32 * 4      # h and the second dot's result
  # The second dot reads w: its copy is held where its other operand, h,
  # is made (XLA runs it as soon as it can, to free the copy), beside h.
  assert _peak(f, X, big, gathered=[1]) == 64 * 4096 * 4 + W_BYTES
  # x is read by the first dot only, before h is made.
  assert _peak(f, X, big, gathered=[0]) == plain

  def g(x, w):
    h = x @ w                                      # the first reader
    e = jnp.sort(h, axis=1)                        # the peak: h and e, no reader of w
    u = jnp.sort(jnp.tanh((e - h)[:, :32]), axis=1)  # [64, 32], made once h and e are gone
    return (u @ w).sum()
  # Held from the first reader to the last, w's copy would be at the peak
  # (h, e); held by each reader alone, the peak is the last dot's.
  plain = _peak(g, X, big)
  assert _peak(g, X, big, gathered=[1]) < plain + W_BYTES


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


def test_a_broadcast_and_a_mask_read_in_one_kernel_hold_nothing():
  # relu's backward selects between h and a broadcast zero, then sums: the
  # comparison, the zero and the select all run inside the reduction.
  def f(x, w):
    h = x @ w
    return jax.lax.select(h > 0, h, jnp.zeros_like(h)).sum()
  assert _peak(f, X, W) == ONE + 4 == _compiled(f, X, W)


def test_a_broadcast_a_kernel_shares_is_made():
  # A small convolutional net: ReLU's zero, broadcast for the global
  # average pool's reduction (a YNNPACK kernel on XLA:CPU) and for the
  # backward pass's select, is made at full size for the kernel, which
  # takes in only what it alone reads.
  x = jnp.ones((16, 8, 8, 3))
  params = ConvNet().init(jax.random.PRNGKey(0), x)

  def grad(p, x):
    return jax.grad(lambda p: (ConvNet().apply(p, x) ** 2).sum())(p)
  jaxpr = _inline_marked_calls(jax.make_jaxpr(grad)(params, x), fn_name="grad").jaxpr
  eqns = jaxpr.eqns
  made = Fusions.of(jaxpr).made_broadcasts()
  assert [(v.aval.shape, eqns[first].primitive.name) for v, first, last in made] == \
      [((16, 8, 8, 32), "reduce_sum")]
  held = sum(math.prod(v.aval.shape) * v.aval.dtype.itemsize
             for v in liveness_peaks(jaxpr, k=1)[0])
  compiled = _compiled(grad, params, x)
  assert abs(held / compiled - 1) < 0.05, (held, compiled)


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


def test_a_residual_stream_is_not_recomputed():
  # Each layer's add reads the stream and the layer's result, both of the
  # add's size: XLA makes it once rather than recompute it in the next
  # layer's add, so each dot's result dies at its layer.
  ws = [jax.ShapeDtypeStruct((128, 128), jnp.float32)] * 6
  x = jax.ShapeDtypeStruct((64, 128), jnp.float32)

  def stream(x, *ws):
    h = x
    for w in ws:
      h = h + jnp.tanh(h @ w)
    return h
  assert _peak(stream, x, *ws) == 2 * 64 * 128 * 4 == _compiled(stream, x, *ws)

  def grad(x, *ws):
    return jax.grad(lambda ws: (stream(x, *ws) ** 2).sum())(ws)
  held, compiled = _peak(grad, x, *ws), _compiled(grad, x, *ws)
  assert abs(held / compiled - 1) < 0.15, (held, compiled)


def test_cpu_rules_are_keyed_by_platform():
  """XLA:CPU runs float reductions as YNNPACK kernels (which take in only
  what nothing else reads); the GPU and TPU backends have no such kernels.
  The rules apply only to plans for CPU devices (devices.platform_of)."""
  from autopar.costs.devices import platform_of
  from autopar.costs.liveness import fusions
  assert [platform_of(k) for k in (None, "CPU", "H100", "NVIDIA A100-SXM4-80GB",
                                   "TPU v5 lite")] == ["cpu", "cpu", "gpu", "gpu", "tpu"]
  jaxpr = jax.make_jaxpr(lambda x: jnp.sum(jnp.exp(x) * 2.0))(jnp.ones((64, 64))).jaxpr
  i = next(k for k, e in enumerate(jaxpr.eqns) if e.primitive.name == "reduce_sum")
  assert fusions(jaxpr, "cpu").kernel_of(i) == i
  assert fusions(jaxpr, "gpu").kernel_of(i) is None
  assert fusions(jaxpr, "gpu").made_broadcasts() == []
