"""Which dimensions of a value hold the batch's rows.

autopar splits the batch into micro-batches and over devices, so it must know
which dimensions of the step's values grow with the batch: a per-example
output is concatenated along them, a random draw along them must produce
exactly its rows of the whole batch's draw, a sharding hint on them is met by
the batch split itself. That is read from the program, never guessed from a
size that happens to match: from a trace at a *symbolic* batch size
(``trace_step_any_batch``), a dimension holds rows when it is ``c * rows``
for a positive integer ``c`` (``c > 1``: rows flattened with other
dimensions, batch-major, e.g. ``x.reshape(-1, d)`` of a ``[rows, seq, d]``
array); or, for a step that can only be traced at concrete sizes, from two
traces at different sizes, where the dimension is ``c * rows`` in both.

A :class:`Rows` says which of the two a program was traced as;
:meth:`Rows.dims` reads one shape with it.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
from jax._src import core as jax_core
from jax.extend.core import Literal

__all__ = ["RowDim", "Rows", "RowOracle", "ROWS_NAME"]

ROWS_NAME = "autopar_rows"    # the symbolic batch dimension (trace.py)


@dataclasses.dataclass(frozen=True)
class RowDim:
  """Dimension ``dim`` of a value is ``factor * rows``: it holds rows
  ``[factor * r0, factor * (r0 + rows))`` of the whole batch's value when
  the program runs on rows ``[r0, r0 + rows)``."""
  dim: int
  factor: int


@dataclasses.dataclass(frozen=True)
class Rows:
  """How to tell a row dimension in a program's shapes.

  ``sizes``: None for a program traced at the symbolic batch size; else the
  two concrete batch sizes ``(a, b)`` of the two traces whose shapes are
  compared (``dims(shape_at_a, shape_at_b)``).
  """
  sizes: tuple[int, int] | None = None

  @classmethod
  def symbolic(cls) -> "Rows":
    return cls(None)

  @classmethod
  def pair(cls, a: int, b: int) -> "Rows":
    assert a != b and a > 0 and b > 0, (a, b)
    return cls((a, b))

  def factor(self, d, other=None) -> int | None:
    """``c`` if the dimension (``d``, and ``other`` in the second trace) is
    ``c * rows`` for an integer ``c >= 1``, else None."""
    if self.sizes is None:
      if not jax_core.is_symbolic_dim(d):
        return None
      try:
        vals = [int(d._evaluate({ROWS_NAME: r})) for r in (1, 2, 3, 7)]
      except Exception:   # noqa: BLE001 - e.g. a dimension defined only for some sizes
        return None
      c = vals[0]
      return c if c >= 1 and vals == [c, 2 * c, 3 * c, 7 * c] else None
    a, b = self.sizes
    if other is None or d == other:
      return None
    if d % a == 0 and other % b == 0 and d // a == other // b:
      return d // a
    return None

  def dims(self, shape: Sequence, other: Sequence | None = None) -> list[RowDim]:
    """The row dimensions of ``shape`` (and ``other``, the same value's shape
    in the second trace), in order."""
    if self.sizes is not None and (other is None or len(other) != len(shape)):
      return []
    out = []
    for k, d in enumerate(shape):
      c = self.factor(d, None if other is None else other[k])
      if c is not None:
        out.append(RowDim(k, c))
    return out

  def varies(self, shape: Sequence, other: Sequence | None = None) -> bool:
    """Whether ``shape`` depends on the batch size at all."""
    if self.sizes is None:
      return any(jax_core.is_symbolic_dim(d) for d in shape)
    return other is not None and tuple(shape) != tuple(other)


class RowOracle:
  """Which dimensions of each value of one program hold the batch's rows.

  For a program traced at a symbolic batch size (:meth:`symbolic`) it reads
  each value's shape; for one traced at a concrete size (:meth:`paired`) it
  compares each value's shape with the same value's in the program traced at
  another size, matched by position (where the two programs differ in
  structure, as a chunked loss's can, only the top level, or nothing, is
  matched; the rest is not known).
  """

  def __init__(self, rows: Rows, other: dict | None = None, sized: set | None = None):
    self.rows = rows
    self.other = other           # variable -> its shape in the second trace
    self.sized = sized or set()  # ids of equations reading a literal that differs

  @classmethod
  def symbolic(cls) -> "RowOracle":
    return cls(Rows.symbolic())

  @classmethod
  def paired(cls, a, b, rows_a: int, rows_b: int) -> "RowOracle":
    """From jaxprs ``a`` (traced at ``rows_a`` rows) and ``b`` (``rows_b``)."""
    from autopar.trace import eqns_by_path
    other: dict = {}
    sized: set = set()

    def match(vs, ws):
      for v, w in zip(vs, ws):
        if hasattr(v, "aval") and not isinstance(v, Literal):
          other[v] = tuple(getattr(w.aval, "shape", ()))
    if len(a.invars) == len(b.invars):
      match(a.invars, b.invars)
    ea, eb = list(eqns_by_path(a)), list(eqns_by_path(b))
    if [(p, e.primitive) for p, e in ea] != [(p, e.primitive) for p, e in eb]:
      ea = list(enumerate(a.eqns))          # the top level alone, if it matches
      eb = list(enumerate(b.eqns))
      if [e.primitive for _, e in ea] != [e.primitive for _, e in eb]:
        ea, eb = [], []
    for (_, e), (_, f) in zip(ea, eb):
      match(e.outvars, f.outvars)
      if any(isinstance(x, Literal) and isinstance(y, Literal) and
             not _same_literal(x, y) for x, y in zip(e.invars, f.invars)):
        sized.add(id(e))
    return cls(Rows.pair(rows_a, rows_b), other, sized)

  def shapes(self, v) -> tuple[tuple, tuple | None] | None:
    """(``v``'s shape, its shape in the second trace or None), or None where
    that is not known."""
    shape = tuple(getattr(v.aval, "shape", ()))
    if self.other is None:
      return shape, None
    if isinstance(v, Literal):
      return shape, shape
    b = self.other.get(v)
    return None if b is None else (shape, b)

  def dims(self, v) -> list[RowDim] | None:
    """The dimensions of ``v`` that hold rows, or None if not known."""
    if isinstance(v, Literal):
      return []
    s = self.shapes(v)
    return None if s is None else self.rows.dims(*s)

  def varies(self, v) -> bool | None:
    """Whether ``v``'s shape depends on the batch size (None: not known)."""
    if isinstance(v, Literal):
      return False
    s = self.shapes(v)
    return None if s is None else self.rows.varies(*s)

  def size_dependent(self, eqn) -> bool:
    """Whether ``eqn`` makes a value from the batch size itself: a
    ``dim_as_value`` of a symbolic dimension, or (traced at two concrete
    sizes) an equation whose literal operand differs between the traces."""
    if eqn.primitive.name == "dim_as_value":
      return True
    return id(eqn) in self.sized


def _same_literal(a, b) -> bool:
  try:
    x, y = np.asarray(a.val), np.asarray(b.val)
    return x.shape == y.shape and x.dtype == y.dtype and bool(np.all(x == y))
  except Exception:  # noqa: BLE001 - an opaque literal (a key): not a size
    return True
