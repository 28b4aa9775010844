"""How each output is combined over micro-batches and devices: as the program
computes it.

On one device a step computes its outputs from the whole batch. autopar runs
the part before the grad marker on each device's rows of each micro-batch,
so an output computed there comes out once per micro-batch and device, and
must be combined into the whole batch's value. Which combination is right is
a fact of the program, not of the output's dtype: a sum over the rows is
summed, a mean (a sum divided by the number of rows) is the sum divided by
the whole batch's rows, a metric ``total + sum(correct)`` is the old total
plus the whole batch's sum, a count ``count + values.size`` is the whole
batch's.

:func:`derive` reads that from the program. Walking back from an output
through values that hold no rows, it stops at *reductions over the rows*: a
``reduce_sum`` / ``reduce_max`` / ``reduce_min`` over a dimension that holds
rows (``rows.py``) or a ``dot_general`` that contracts one. Those values are
accumulated over micro-batches and reduced over devices like the gradients
(summed, maxed or mined), and everything the output computes from them runs once
per step in ``apply_grad``, on the whole batch's shapes (so ``x.shape[0]``
there is the whole batch's). An output whose value needs the rows in another
way (one row, a sort over the rows, a second pass over the rows after a
first reduction) cannot be derived: the caller gets an error that names it,
unless ``output_reductions=`` says how to combine it.

Before / after, for ``return loss, total + jnp.sum(correct)``::

    compute: s = reduce_sum[axes=(0,)] correct       compute: -> (grads, s)
             t = add total s                 ->      apply:   t = add total s
             -> (grads, loss, t)                      (s summed over micro-
                                                       batches and devices)
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

from jax.extend.core import Literal, Var

from autopar.frontend.rows import RowDim

__all__ = ["Derivation", "derive", "reduction_of", "REDUCTIONS"]

# How values are combined over micro-batches and devices.
REDUCTIONS = ("sum", "mean", "max", "min")

_REDUCE = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min",
           "reduce_or": "max", "reduce_and": "min"}     # (jnp.any, jnp.all)


@dataclasses.dataclass(frozen=True)
class Derivation:
  """What :func:`derive` found.

  Attributes:
    reduced: the reductions over the rows the derived outputs are computed
      from, with how each is combined (one of :data:`REDUCTIONS`), in
      program order.
    derived: the outputs (by position) computed from ``reduced`` and values
      that do not depend on the batch.
    failures: the other outputs (by position), with why they cannot be.
  """
  reduced: tuple[tuple[Var, str], ...]
  derived: frozenset[int]
  failures: Mapping[int, str]


def derive(jaxpr, outputs: Sequence[int], on_batch: set,
           row_dims: Callable[[Var], list[RowDim] | None]) -> Derivation:
  """Derives ``jaxpr``'s outputs at positions ``outputs`` (those that depend
  on the batch and hold no rows) from reductions over the rows.

  ``on_batch``: the variables that depend on the batch's values;
  ``row_dims(v)``: the dimensions of ``v`` that hold rows, or None where
  that is not known.
  """
  producer = {}
  for eqn in jaxpr.eqns:
    for v in eqn.outvars:
      producer[v] = eqn
  reduced: dict[Var, str] = {}
  derived, failures = set(), {}
  for pos in outputs:
    found, why = _walk(jaxpr.outvars[pos], producer, on_batch, row_dims)
    if why:
      failures[pos] = why
    else:
      derived.add(pos)
      reduced.update(found)
  # A reduction whose operand depends on another one is a second pass over
  # the rows (a variance after a mean): each micro-batch would see its own
  # first pass.
  second = _second_passes(jaxpr, reduced, producer)
  if second:
    for pos in list(derived):
      found, _ = _walk(jaxpr.outvars[pos], producer, on_batch, row_dims)
      if set(found) & second:
        derived.discard(pos)
        failures[pos] = ("it reduces the rows a second time after a first reduction "
                         "over them (as a variance after a mean): each micro-batch "
                         "would see its own first reduction")
    reduced = {v: op for v, op in reduced.items() if any(
        v in _walk(jaxpr.outvars[p], producer, on_batch, row_dims)[0]
        for p in derived)}
  order = {v: i for i, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars}
  return Derivation(tuple(sorted(reduced.items(), key=lambda kv: order[kv[0]])),
                    frozenset(derived), failures)


def _walk(out, producer, on_batch, row_dims) -> tuple[dict, str]:
  """(the reductions ``out`` is computed from, why it cannot be: "" if it can)."""
  found: dict[Var, str] = {}
  stack, seen = [out], set()
  while stack:
    v = stack.pop()
    if isinstance(v, Literal) or v in seen or v not in on_batch:
      continue
    seen.add(v)
    dims = row_dims(v)
    if dims is None:
      return found, ("autopar cannot tell which of its values hold the batch's rows "
                     "(the step could not be traced at a symbolic batch size, and "
                     "its program differs from size to size)")
    if dims:
      return found, "it reads values that hold the batch's rows other than through " \
          "a sum, max or min over the rows"
    eqn = producer.get(v)
    if eqn is None:
      return found, "it is an input that depends on the batch"
    op = reduction_of(eqn, row_dims)
    if op is not None:
      found[v] = op
      continue
    rowed = [a for a in eqn.invars if isinstance(a, Var) and a in on_batch and row_dims(a)]
    if rowed:
      return found, (f"it takes the rows to a value without them by "
                     f"'{eqn.primitive.name}', which autopar cannot combine over "
                     f"micro-batches (only sums, maxes and mins over the rows)")
    stack.extend(eqn.invars)
  return found, ""


def reduction_of(eqn, row_dims) -> str | None:
  """How ``eqn`` reduces the rows of its operand, if it is a reduction over
  them: "sum", "max" or "min"."""
  name = eqn.primitive.name
  if name in _REDUCE:
    x = eqn.invars[0]
    dims = row_dims(x) if isinstance(x, Var) else []
    axes = set(eqn.params["axes"])
    if dims and all(d.dim in axes for d in dims):
      return _REDUCE[name]
    return None
  if name == "dot_general":
    (lc, rc), _ = eqn.params["dimension_numbers"]
    contracted = []
    for x, c in zip(eqn.invars, (lc, rc)):
      dims = row_dims(x) if isinstance(x, Var) else []
      if dims:
        if not all(d.dim in c for d in dims):
          return None
        contracted.append(True)
    return "sum" if contracted else None
  return None


def _second_passes(jaxpr, reduced: Mapping, producer) -> set:
  """The reductions whose operands depend on another reduction."""
  after = set()
  out = set()
  for eqn in jaxpr.eqns:
    reads = [a for a in eqn.invars if isinstance(a, Var)]
    if any(a in after for a in reads):
      for v in eqn.outvars:
        if v in reduced:
          out.add(v)
      after.update(eqn.outvars)
    for v in eqn.outvars:
      if v in reduced:
        after.add(v)
  return out
