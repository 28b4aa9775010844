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

Each device and micro-batch computes on its own rows, so a program whose
values read one row together with another's (batch statistics, a scan over
the rows, rows paired with rows) gives other numbers when the batch is
split: :func:`row_mixing` finds where.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax.numpy as jnp
import numpy as np
from jax.extend.core import Jaxpr, Literal, Var

from autopar import jax_compat as jc
from autopar.frontend.retype import jaxprs_in
from autopar.frontend.trace import ROWS_NAME

__all__ = ["RowDim", "Rows", "RowOracle", "ROWS_NAME", "row_mixing", "mixing_of", "where",
           "depends"]



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
      if not jc.is_symbolic_dim(d):
        return None
      try:
        vals = [jc.evaluate_dim(d, {ROWS_NAME: r}) for r in (1, 2, 3, 7)]
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
      return any(jc.is_symbolic_dim(d) for d in shape)
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
    """From jaxprs ``a`` (traced at ``rows_a`` rows) and ``b`` (``rows_b``),
    their values paired as ``align.paired_eqns`` pairs them."""
    from autopar.frontend.align import paired_eqns
    pairs, partner = paired_eqns(a, b)
    other: dict = {}
    sized: set = set()
    for v in [*a.invars, *(v for e, _ in pairs for v in e.outvars)]:
      w = partner.get(v)
      if w is not None and hasattr(v, "aval") and not isinstance(v, Literal):
        other[v] = tuple(getattr(w.aval, "shape", ()))
    for e, f in pairs:
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


# -- rows that must stay apart -----------------------------------------------------

_CUMULATIVE = ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
# Operands that only say where to read or write (index arithmetic with a
# row's position or the batch's size is exact there).
_INDEX_OPERANDS = {"gather": slice(1, 2), "scatter": slice(1, 2),
                   "scatter-add": slice(1, 2), "scatter_add": slice(1, 2),
                   "scatter_mul": slice(1, 2), "scatter_min": slice(1, 2),
                   "scatter_max": slice(1, 2), "dynamic_slice": slice(1, None),
                   "dynamic_update_slice": slice(2, None)}


@dataclasses.dataclass
class _Deps:
  """What a program's values depend on: the batch's ``values``; its size
  alone (``sized``: ``x.shape[0]``, a ``[rows, ...]`` array of ones); a
  row's position in the batch other than as an index (``positions``: a
  ``jnp.arange`` over the rows used as a value)."""
  values: set
  sized: set
  positions: set


def _value_operands(eqn) -> list:
  index = _INDEX_OPERANDS.get(eqn.primitive.name)
  ins = list(eqn.invars)
  if index is not None:
    del ins[index]
  return [a for a in ins if isinstance(a, Var)]


def _dependences(jaxpr, deps: _Deps, oracle: RowOracle) -> _Deps:
  values, sized, positions = set(deps.values), set(deps.sized), set(deps.positions)
  for e in jaxpr.eqns:
    ins = [a for a in e.invars if isinstance(a, Var)]
    if e.primitive.name == "cond" and not any(
        isinstance(e.invars[0], Var) and e.invars[0] in group
        for group in (values, sized, positions)):
      # Output by output, through the branches: a switch that picks a
      # layer's weights or its mask (remat.py's rolled layers) makes weights
      # that do not depend on the batch.
      _cond_dependences(e, _Deps(values, sized, positions), oracle)
      continue
    if e.primitive.name == "optimization_barrier":
      # An identity per operand: each output depends on its own operand.
      for a, o in zip(e.invars, e.outvars, strict=True):
        for group in (values, sized, positions):
          if isinstance(a, Var) and a in group:
            group.add(o)
      continue
    if any(a in values for a in ins):
      values.update(e.outvars)
    elif (oracle.size_dependent(e) or any(a in sized for a in ins) or
          any(oracle.varies(v) for v in e.outvars)):
      sized.update(e.outvars)
    if e.primitive.name == "iota":
      dims = oracle.dims(e.outvars[0]) or []
      if any(d.dim == e.params["dimension"] for d in dims):
        positions.update(e.outvars)
    elif any(a in positions for a in _value_operands(e)):
      positions.update(e.outvars)
  return _Deps(values, sized, positions)


def _cond_dependences(eqn, deps: _Deps, oracle: RowOracle) -> None:
  """Adds to ``deps`` (in place) what each output of the ``cond`` ``eqn``
  depends on: what its value depends on in any branch."""
  for branch in eqn.params["branches"]:
    inner = _dependences(branch.jaxpr, _body_deps(eqn, branch.jaxpr, deps, oracle), oracle)
    for v, w in zip(eqn.outvars, branch.jaxpr.outvars, strict=True):
      if isinstance(w, Var):
        for group, found in ((deps.values, inner.values), (deps.sized, inner.sized),
                             (deps.positions, inner.positions)):
          if w in found:
            group.add(v)
  deps.sized.update(v for v in eqn.outvars if v not in deps.values and oracle.varies(v))


def row_mixing(jaxpr: Jaxpr, targets: Sequence, *, batch: set, oracle: RowOracle) -> str:
  """"" if the rows stay apart on the way to ``targets`` (the loss's
  reductions over the rows, or the loss); else what mixes them and where.
  ``batch``: the program's batch inputs.

  Each group computes on its own rows, so a value of one row must not read
  another group's rows: autopar refuses a per-row value computed from a
  value summarised over the rows (batch statistics: ``x - x.mean(0)``;
  ``nll / mask.sum()``), an operation along the rows (a cumulative sum, a
  sort, a reversal, a scan with a carry over them: a time-major ``[time,
  batch, ...]`` argument taken as the batch), rows paired with rows
  (``q @ k.T`` over the batch: in-batch negatives), and per-row values
  computed with the batch's size (``x / x.shape[0]``) or with a row's
  position in it (``jnp.arange(x.shape[0])`` as a weight or an RNG fold-in),
  which each group would take as its own. Index arithmetic with either
  (``lp[jnp.arange(B), labels]``) reads the group's own rows, as on one
  device: exact, and accepted.
  """
  return mixing_of(jaxpr, {0: targets}, batch=batch, oracle=oracle).get(0, "")


def mixing_of(jaxpr: Jaxpr, targets: dict, *, batch: set, oracle: RowOracle) -> dict:
  """:func:`row_mixing` for several groups of targets at once (key ->
  values): key -> what mixes rows on the way to them, for the keys where
  something does."""
  producer = {v: e for e in jaxpr.eqns for v in e.outvars}
  order = {id(e): i for i, e in enumerate(jaxpr.eqns)}
  deps = _dependences(jaxpr, _Deps(set(batch), set(), set()), oracle)
  found: dict[int, str] = {}
  out = {}
  for key, values in targets.items():
    needed, stack, front = set(), [v for v in values if isinstance(v, Var)], set()
    while stack:
      v = stack.pop()
      if v in needed:
        continue
      needed.add(v)
      e = producer.get(v)
      if e is not None and id(e) not in front:
        front.add(id(e))
        stack.extend(a for a in e.invars if isinstance(a, Var))
    for i in sorted(order[f] for f in front):
      eqn = jaxpr.eqns[i]
      if id(eqn) not in found:
        found[id(eqn)] = _mixes(eqn, deps, oracle)
      if found[id(eqn)]:
        out[key] = found[id(eqn)]
        break
  return out


def _mixes(eqn, deps: _Deps, oracle: RowOracle) -> str:
  """What ``eqn`` does that mixes rows ("" if nothing), with where; its
  bodies too."""
  name = eqn.primitive.name
  outs = [v for v in eqn.outvars if oracle.varies(v)]
  inexact = [v for v in outs if jnp.issubdtype(v.aval.dtype, jnp.inexact)]
  if outs:
    for a in eqn.invars:
      if isinstance(a, Var) and a in deps.values and oracle.varies(a) is False:
        return (f"'{name}' ({where(eqn)}) computes per-row values of shape "
                f"{tuple(outs[0].aval.shape)} from a value of shape "
                f"{tuple(a.aval.shape)} that summarises the batch's rows (batch "
                f"statistics, or a sum over the rows read back by each row). Fix: keep "
                f"the statistics as state (a BatchNorm's running averages) or compute "
                f"them outside the step; to normalise by a count, sum first and "
                f"divide after (jnp.sum(nll * mask) / jnp.sum(mask))")
  if inexact and (oracle.size_dependent(eqn) or any(
      isinstance(a, Var) and a in deps.sized and oracle.varies(a) is False
      for a in _value_operands(eqn))):
    return (f"'{name}' ({where(eqn)}) computes per-row values with the batch's size, "
            f"which each device and micro-batch would take as its own rows' "
            f"count. Fix: divide after summing (jnp.sum(x) / x.shape[0], or "
            f"jnp.mean(x))")
  if any(jnp.issubdtype(v.aval.dtype, jnp.inexact) for v in eqn.outvars) and any(
      a in deps.positions for a in _value_operands(eqn)):
    return (f"'{name}' ({where(eqn)}) computes values from the rows' positions in the "
            f"batch (a jnp.arange over the rows used as a value, or to fold a random "
            f"key), which restart at 0 on every device and micro-batch. Fix: pass "
            f"the positions (or per-example keys) in the batch, so each row carries "
            f"its own")
  axes: tuple = ()
  if name in _CUMULATIVE:
    axes = (eqn.params["axis"],)
  elif name == "sort":
    axes = (eqn.params["dimension"],)
  elif name == "rev":
    axes = tuple(eqn.params["dimensions"])
  elif name == "scan" and jc.scan_counts(eqn.params)[1]:
    # (Without a carry, as lax.map, each trip is on its own.)
    start = sum(jc.scan_counts(eqn.params))
    for a in eqn.invars[start:]:
      if isinstance(a, Var) and any(d.dim == 0 for d in oracle.dims(a) or ()):
        return (f"a scan ({where(eqn)}) runs over dimension 0 of a value of shape "
                f"{tuple(a.aval.shape)}, which autopar takes for the batch's rows: "
                f"each step of the scan reads the one before (is the batch "
                f"time-major, [time, batch, ...]?). Fix: lay the batch out "
                f"batch-major ([batch, time, ...]) and scan over its axis 1, or name "
                f"the batch argument with batch_argnums=")
  if axes:
    a = eqn.invars[0]
    dims = oracle.dims(a) if isinstance(a, Var) else []
    if dims and any(d.dim in axes for d in dims):
      return (f"'{name}' ({where(eqn)}) runs along the dimension of a value of "
              f"shape {tuple(a.aval.shape)} that holds the batch's rows. Fix: if "
              f"that dimension is not the batch's, lay the batch out with its rows "
              f"first or name the batch argument with batch_argnums=")
  for v in eqn.outvars:
    dims = oracle.dims(v) or []
    if len(dims) > 1 and not any(len(oracle.dims(a) or []) > 1 for a in eqn.invars
                                 if isinstance(a, Var)):
      return (f"'{name}' ({where(eqn)}) pairs rows with rows (a value of shape "
              f"{tuple(v.aval.shape)} holds the batch's rows in two dimensions, "
              f"as in-batch negatives do). Fix: pair each micro-batch's rows with "
              f"its own (then say so: it is another loss), or let ShardParallel plan "
              f"it with num_micro_batches=1: it keeps such a batch whole")
  for sub in jaxprs_in(eqn):
    inner = _dependences(sub, _body_deps(eqn, sub, deps, oracle), oracle)
    for e in sub.eqns:
      found = _mixes(e, inner, oracle)
      if found:
        return found
  return ""


def _body_deps(eqn, sub: Jaxpr, deps: _Deps, oracle: RowOracle) -> _Deps:
  """What the inputs of ``sub`` (a body of ``eqn``) depend on."""
  ins = list(eqn.invars)
  name = eqn.primitive.name
  if name == "cond":
    ins = ins[1:]
  elif name == "while":
    body = eqn.params["body_jaxpr"].jaxpr
    if sub is body:
      ins = ins[eqn.params["cond_nconsts"]:]
    else:
      ins = ins[:eqn.params["cond_nconsts"]] + ins[eqn.params["cond_nconsts"] +
                                                   eqn.params["body_nconsts"]:]
  pick = lambda group: {w for w, a in zip(sub.invars, ins)
                        if isinstance(a, Var) and a in group}
  return _Deps(pick(deps.values), pick(deps.sized) | {w for w in sub.invars
                                                       if oracle.varies(w)},
               pick(deps.positions))


def where(eqn) -> str:
  """The user's source line of ``eqn`` (for messages)."""
  return jc.summarize_source(eqn.source_info)


def depends(jaxpr, sources: set, extra=None) -> set:
  """Variables computed from ``sources`` (``sources`` included); with
  ``extra(eqn)``, also the results of equations for which it holds."""
  dep = set(sources)
  for eqn in jaxpr.eqns:
    if any(isinstance(v, Var) and v in dep for v in eqn.invars) or (
        extra is not None and extra(eqn)):
      dep.update(eqn.outvars)
  return dep
