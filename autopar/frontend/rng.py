"""Random draws inside a step, as on one device.

A step run on one device draws, say, a dropout mask of shape
``[batch, seq, d]`` from one key. autopar runs the gradient computation on
each device's rows of each micro-batch, where the same program draws a mask
of shape ``[rows, seq, d]``: with the same key, every device and every
micro-batch would get the same mask, which is neither the one-device result
nor independent (issue: all rows of a 16-row batch on 8 devices x 2
micro-batches got one mask row).

With JAX's default ``jax_threefry_partitionable``, the value of a threefry
draw at an element depends only on the key and the element's position in the
draw's global shape: ``threefry2x32(key, index)`` with ``index`` the
element's row-major position. So a device that holds rows ``[r0, r0 + m)``
of the batch can draw exactly those rows of the whole batch's draw: the
same hash over the positions those rows have in the global shape. This
module does that for every draw whose shape holds the batch's rows (see
``rows.py``), ``random_bits`` (``uniform``, ``normal``, ``bernoulli``, ...)
and ``random_split`` (per-example keys) alike::

    before (rows 0..m of every device)        after (device d, micro-batch i)
    bits = random_bits[shape=(m, d)] key      r0 = (d * n + i) * m
                                              hi, lo = positions of rows r0..r0+m
                                                       in shape (B, d)
                                              bits = threefry2x32(key, hi, lo)

The positions are computed in 64 bits by :data:`iota_rows_p`, a primitive
beside JAX's own ``iota_2x32_shape``. A draw whose rows cannot be
reproduced (another PRNG implementation, partitionable threefry turned off,
a shape whose rows autopar cannot relate to the batch) still gets draws
independent across devices and micro-batches (its key is folded with the
first row's index), and autopar warns once for it, naming the equation and
why.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import jax
import jax.extend.random as jex_random
import numpy as np
from jax import lax
from jax.extend.core import Primitive

from autopar import jax_compat as jc
from autopar.jax_compat import hlo, ir, mlir
from autopar.frontend.trace import DRAW_PRIMITIVES
from autopar.frontend.rows import RowDim

__all__ = ["RowDraw", "DRAW_PRIMITIVES", "find_draws", "cannot_cut", "draw"]

# (DRAW_PRIMITIVES, named in trace.py: the primitives whose `shape` param
# says how many values they draw.)


@dataclasses.dataclass(frozen=True)
class RowDraw:
  """A draw whose shape holds the batch's rows.

  ``rows``: where (a :class:`~autopar.frontend.rows.RowDim`), or None when they are
  there but cannot be reproduced; ``why``: the reason, then.
  """
  rows: RowDim | None
  why: str = ""


def find_draws(eqns, oracle) -> dict[str, RowDraw]:
  """The draws that hold rows, by equation path.

  ``eqns``: ``(path, equation)`` of the gradient computation
  (``trace.eqns_by_path``); ``oracle``: a ``rows.RowOracle`` for its values.
  """
  out = {}
  for path, eqn in eqns:
    if eqn.primitive.name not in DRAW_PRIMITIVES:
      continue
    shapes = oracle.shapes(eqn.outvars[0])
    if shapes is None:
      out[path] = RowDraw(None, "autopar cannot tell which of its dimensions hold "
                          "the batch's rows (the step's program differs from batch "
                          "size to batch size)")
      continue
    # The draw's own shape follows its keys' (a draw per key).
    k = len(eqn.invars[0].aval.shape)
    shape, other = shapes[0][k:], None if shapes[1] is None else shapes[1][k:]
    if not oracle.rows.varies(shape, other):
      continue                 # drawn alike on every device: as on one device
    dims = oracle.rows.dims(shape, other)
    if len(dims) == 1:
      out[path] = RowDraw(dims[0])
    else:
      why = ("its shape holds the batch's rows in more than one dimension"
             if dims else "its shape depends on the batch size, but not as "
             "a whole number of rows in one dimension")
      out[path] = RowDraw(None, why)
  return out


# -- where the rows are in the global draw -------------------------------------

iota_rows_p = Primitive("autopar_iota_rows")
iota_rows_p.multiple_results = True


def _iota_rows_abstract(first_row, *, shape, strides, dim, factor):
  del first_row, strides, dim, factor
  return (jc.ShapedArray(shape, np.dtype("uint32")),) * 2


def _iota_rows_lowering(ctx, first_row, *, shape, strides, dim, factor):
  """64-bit row-major positions ``Σ_j (iota_j + [j = dim]·factor·first_row)
  · strides_j``, as (high, low) 32-bit words (as ``iota_2x32_shape``)."""
  aval_out, _ = ctx.avals_out
  u64 = jc.ShapedArray(shape, np.dtype("uint64"))
  u64_scalar = ir.RankedTensorType.get([], mlir.dtype_to_ir_type(np.dtype("uint64")))

  def const(x):
    c = mlir.ir_constant(np.array(x, np.dtype("uint64")))
    return mlir.broadcast_in_dim(ctx, c, u64, broadcast_dimensions=[])

  offset = hlo.convert(u64_scalar, first_row)
  offset = hlo.multiply(offset, mlir.ir_constant(np.array(factor, np.uint64)))
  offset = mlir.broadcast_in_dim(ctx, offset, u64, broadcast_dimensions=[])
  counts = None
  for d, stride in enumerate(strides):
    term = mlir.iota(ctx, u64, dimension=d)
    if d == dim:
      term = hlo.add(term, offset)
    term = hlo.multiply(term, const(stride))
    counts = term if counts is None else hlo.add(counts, term)
  result = mlir.aval_to_ir_type(ctx.module_context, aval_out)
  hi = hlo.convert(result, hlo.shift_right_logical(counts, const(32)))
  lo = hlo.convert(result, counts)
  return hi, lo


iota_rows_p.def_abstract_eval(_iota_rows_abstract)
mlir.register_lowering(iota_rows_p, _iota_rows_lowering)


def _positions(first_row, local_shape, global_shape, dim, factor):
  strides = tuple(int(math.prod(global_shape[d + 1:])) for d in range(len(global_shape)))
  return iota_rows_p.bind(lax.convert_element_type(first_row, np.int32),
                          shape=tuple(local_shape), strides=strides, dim=dim,
                          factor=factor)


# -- drawing ----------------------------------------------------------------------

# The draws already warned about, by call site (process-wide: warn once).
_warned: set = set()


def _reproducible(eqn) -> str:
  """Why the draws of ``eqn`` cannot be reproduced by rows ("" if they can)."""
  key_aval = eqn.invars[0].aval
  impl = jc.key_impl_of(key_aval.dtype)
  if impl is not jex_random.threefry_prng_impl:
    name = getattr(impl, "name", None) or str(key_aval.dtype)
    return (f"its key's PRNG implementation is {name!r}, whose values depend "
            f"on the whole draw's shape (only threefry draws can be cut into rows)")
  if not eqn.ctx.threefry_partitionable:     # the setting it was traced under
    return ("jax_threefry_partitionable is off, so a threefry draw's values "
            "depend on the whole draw's shape")
  return ""


def cannot_cut(eqn, found: RowDraw) -> str:
  """Why draw ``eqn`` cannot give each device its rows of the whole
  batch's draw ("" if it can): each then draws its own (:func:`draw`)."""
  return found.why or _reproducible(eqn)


def draw(eqn, path: str, found: RowDraw, key, first_row, total_rows: int):
  """Evaluates draw equation ``eqn`` on ``key`` for the rows
  ``[first_row, first_row + rows)`` of a batch of ``total_rows`` rows.

  ``first_row``: a traced int32 scalar (device and micro-batch dependent).
  Returns the equation's outputs (a list).
  """
  key_aval = eqn.invars[0].aval
  why = cannot_cut(eqn, found)
  if why:
    where = f"{eqn.primitive.name}[shape={tuple(eqn.params['shape'])}] (equation {path})"
    if where not in _warned:
      _warned.add(where)
      warnings.warn(
          f"autopar: the random draw {where} cannot give each device and "
          f"micro-batch its rows of the whole batch's draw: {why}. Each gets "
          f"draws of its own instead (its key folded with its first row), so "
          f"results differ from one device.", stacklevel=2)
    folded = jax.random.fold_in(key, first_row)
    return [eqn.primitive.bind(folded, **eqn.params)]

  rows = found.rows
  shape = tuple(eqn.params["shape"])
  global_shape = list(shape)
  global_shape[rows.dim] = rows.factor * total_rows
  impl = jax.random.key_impl(key)

  def one(k):
    """The draw for one key (a draw on a key array maps over its keys)."""
    data = jax.random.key_data(k)
    hi, lo = _positions(first_row, shape, global_shape, rows.dim, rows.factor)
    bits1, bits2 = jex_random.threefry2x32_p.bind(data[0], data[1], hi, lo)
    if eqn.primitive.name == "random_split":
      return jax.random.wrap_key_data(_stack(bits1, bits2), impl=impl)
    width = eqn.params["bit_width"]
    dtype = np.dtype(f"uint{width}")
    if width == 64:
      hi64 = lax.convert_element_type(bits1, dtype)
      lo64 = lax.convert_element_type(bits2, dtype)
      return lax.shift_left(hi64, np.array(32, dtype)) | lo64
    if width == 32:
      return bits1 ^ bits2
    return lax.convert_element_type(bits1 ^ bits2, dtype)

  fn = one
  for _ in range(len(key_aval.shape)):
    fn = jax.vmap(fn)
  return [fn(key)]


def _stack(a, b):
  return lax.concatenate([lax.expand_dims(a, (a.ndim,)), lax.expand_dims(b, (b.ndim,))],
                         a.ndim)
