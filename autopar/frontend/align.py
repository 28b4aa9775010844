"""The equations of one step traced at two batch sizes, paired.

A step that cannot be traced at a symbolic batch size is traced at two
concrete ones, and which dimensions hold the batch's rows is read by
comparing each value's shape in one trace with the same value's in the other
(``rows.py``). The two traces are one program, but JAX does not always write
it out with the same equations: where a dimension is 1 an implicit broadcast
needs no ``reduce_sum`` in its transpose, an operand of the right shape
needs no ``broadcast_in_dim``, a ``reshape`` to the same shape is dropped.
At one row per device and micro-batch (the trace the gradient stages run)
the program then has a few equations more or fewer than at another size,
and pairing equations by position pairs nothing after the first difference.

:func:`paired_eqns` pairs them as a diff would: a shortest edit script over
the two sequences of equations (Myers' algorithm on each equation's
primitive, nesting depth and number of results), then keeps a pair only
where the data flows alike: each operand of the one is the paired value of
the other's operand, looking through the unpaired layout equations
(``LAYOUT``) one side writes and the other does not. A pair whose operands
come from elsewhere is dropped, and its results stay unknown.

Before / after, the gradient of ``b + w`` summed into ``b``'s shape (``a``
traced at 1 row, ``b`` at 16)::

    a: s = reduce_sum r            b: s' = reduce_sum r'
                                      t' = reshape s'
                                      u' = reduce_sum t'
       g = autopar_grad s             g' = autopar_grad u'

    pairs: (s, s'), (g, g'): u' is s' through the unpaired reshape and
    reduce_sum, and s' is the pair of s.
"""

from __future__ import annotations

from typing import Sequence

from jax.extend.core import Literal, Var

from autopar import jax_compat as jc
from autopar.frontend.retype import jaxprs_in
from autopar.frontend.trace import eqns_by_path, region_jaxprs

__all__ = ["paired_eqns", "first_difference", "LAYOUT", "MAX_EDITS"]

# Equations that move or relabel a value's elements, which JAX writes at one
# batch size and not another when a dimension is 1; the operand of an
# unpaired one stands for its result when data flows are compared.
LAYOUT = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims",
                    "transpose", "reduce_sum", "reduce_max", "reduce_min",
                    "convert_element_type", "copy", "copy_p"})

# Edits beyond which two traces are taken for different programs (nothing is
# paired): the diff costs time in proportion to the equations times the edits.
MAX_EDITS = 2048


def paired_eqns(a, b) -> tuple[list[tuple], dict]:
  """The equations of jaxprs ``a`` and ``b`` (one step traced at two batch
  sizes) paired, and the variables of ``a`` paired with ``b``'s.

  Returns ``(pairs, partner)``: ``pairs`` lists ``(eqn of a, eqn of b)``, in
  order, nested equations included (``trace.eqns_by_path``); ``partner``
  maps each variable of ``a`` whose counterpart in ``b`` is known (inputs
  and consts matched by position, results of paired equations, inputs of
  their bodies) to it. Where the two programs have the same equations, every
  equation is paired by position, as written; else see the module
  docstring.
  """
  ea, pa, ka = _flat(a)
  eb, pb, kb = _flat(b)
  partner: dict = {}
  for vs, ws in ((a.constvars, b.constvars), (a.invars, b.invars)):
    if len(vs) == len(ws):
      partner.update(zip(vs, ws))
  if pa == pb and ka == kb:
    pairs = list(zip(ea, eb))
    for e, f in pairs:
      _pair_results(e, f, partner)
    return pairs, partner
  common = _common(ka, kb)
  if common is None:
    return [], partner
  producer_a = {v: e for e in ea for v in e.outvars}
  producer_b = {v: e for e in eb for v in e.outvars}
  kept_a: set = set()
  kept_b: set = set()

  def root(v, producer, kept):
    # Through layout equations left unpaired (by the diff, or dropped).
    while True:
      e = producer.get(v)
      if e is None or e.primitive.name not in LAYOUT or id(e) in kept:
        return v
      ins = [x for x in e.invars if isinstance(x, Var)]
      if len(ins) != 1:
        return v
      v = ins[0]

  pairs = []
  for i, j in common:
    e, f = ea[i], eb[j]
    if len(e.invars) != len(f.invars) or len(e.outvars) != len(f.outvars):
      continue
    same = True
    for x, y in zip(e.invars, f.invars):
      if isinstance(x, Literal) or isinstance(y, Literal):
        same = isinstance(x, Literal) and isinstance(y, Literal)
      else:
        rx = root(x, producer_a, kept_a)
        ry = root(y, producer_b, kept_b)
        same = rx in partner and partner[rx] is ry
      if not same:
        break
    if same:
      kept_a.add(id(e))
      kept_b.add(id(f))
      pairs.append((e, f))
      _pair_results(e, f, partner)
  return pairs, partner


def first_difference(a, b) -> str:
  """Where the programs ``a`` and ``b`` (one step traced at two batch sizes)
  first differ in their operations, layout equations aside (``LAYOUT``), as
  the source line of the equation there; "" where they do not (they may
  still differ in their constants)."""
  def ops(jaxpr):
    for e in jaxpr.eqns:
      if e.primitive.name not in LAYOUT:
        yield e
      for sub in jaxprs_in(e):
        yield from ops(sub)
  ea, eb = list(ops(a)), list(ops(b))
  for e, f in zip(ea, eb):
    if e.primitive is not f.primitive:
      return jc.summarize_source(e.source_info)
  if len(ea) != len(eb):
    longer = ea if len(ea) > len(eb) else eb
    return jc.summarize_source(longer[min(len(ea), len(eb))].source_info)
  return ""


def _pair_results(e, f, partner: dict) -> None:
  partner.update((v, w) for v, w in zip(e.outvars, f.outvars) if isinstance(v, Var))
  sa, sb = region_jaxprs(e), region_jaxprs(f)
  if len(sa) == len(sb):
    for x, y in zip(sa, sb):
      for vs, ws in ((x.constvars, y.constvars), (x.invars, y.invars)):
        if len(vs) == len(ws):
          partner.update(zip(vs, ws))


def _flat(jaxpr) -> tuple[list, list, list]:
  """The equations in ``eqns_by_path`` order, their paths, and what a diff
  compares of each: its nesting depth, primitive and number of results."""
  eqns, paths, keys = [], [], []
  for path, e in eqns_by_path(jaxpr):
    eqns.append(e)
    paths.append(path)
    keys.append((path.count("."), e.primitive.name, len(e.outvars)))
  return eqns, paths, keys


def _common(ka: Sequence, kb: Sequence) -> list[tuple[int, int]] | None:
  """Index pairs ``(i, j)``, ``ka[i] == kb[j]``, of a longest common
  subsequence of ``ka`` and ``kb`` (Myers' O((N + M) D) diff after the
  common head and tail); None if more than ``MAX_EDITS`` edits apart."""
  n, m = len(ka), len(kb)
  head = 0
  while head < n and head < m and ka[head] == kb[head]:
    head += 1
  tail = 0
  while tail < n - head and tail < m - head and ka[n - 1 - tail] == kb[m - 1 - tail]:
    tail += 1
  # Keys as small integers: the diff compares them many times.
  ids: dict = {}
  a = [ids.setdefault(k, len(ids)) for k in ka[head:n - tail]]
  b = [ids.setdefault(k, len(ids)) for k in kb[head:m - tail]]
  middle = _myers(a, b, MAX_EDITS)
  if middle is None:
    return None
  return ([(k, k) for k in range(head)] +
          [(head + i, head + j) for i, j in middle] +
          [(n - tail + k, m - tail + k) for k in range(tail)])


def _myers(a: Sequence, b: Sequence, limit: int) -> list[tuple[int, int]] | None:
  """The matched index pairs of a shortest edit script from ``a`` to ``b``
  (E. W. Myers, "An O(ND) difference algorithm and its variations", 1986),
  or None if it has more than ``limit`` edits."""
  n, m = len(a), len(b)
  most = min(n + m, limit)
  off = most + 1
  v = [0] * (2 * most + 3)          # diagonal k -> furthest x reached on it
  history = []                      # v around the diagonals of each round
  for d in range(most + 1):
    history.append(v[off - d - 1:off + d + 2])
    for k in range(-d, d + 1, 2):
      if k == -d or (k != d and v[off + k - 1] < v[off + k + 1]):
        x = v[off + k + 1]          # an element of b inserted
      else:
        x = v[off + k - 1] + 1      # an element of a deleted
      y = x - k
      while x < n and y < m and a[x] == b[y]:
        x += 1
        y += 1
      v[off + k] = x
      if x >= n and y >= m:
        return _backtrack(history, n, m)
  return None


def _backtrack(history: list, n: int, m: int) -> list[tuple[int, int]]:
  pairs = []
  x, y = n, m
  for d in range(len(history) - 1, 0, -1):
    was = history[d]                # index k + d + 1 holds diagonal k
    k = x - y
    if k == -d or (k != d and was[k - 1 + d + 1] < was[k + 1 + d + 1]):
      pk = k + 1
      px = was[pk + d + 1]
      sx, sy = px, px - pk + 1
    else:
      pk = k - 1
      px = was[pk + d + 1]
      sx, sy = px + 1, px - pk
    while x > sx and y > sy:
      x, y = x - 1, y - 1
      pairs.append((x, y))
    x, y = px, px - pk
  while x > 0 and y > 0:
    x, y = x - 1, y - 1
    pairs.append((x, y))
  pairs.reverse()
  return pairs
