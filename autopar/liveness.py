"""Which values of a program are in memory together: the peaks of its
liveness, for the planners' memory estimates.

A value holds a buffer from the equation that makes it to its last reader
(the program's outputs to the end). Two rules of XLA's buffer assignment
are followed, so that one buffer is not counted twice:

* a reshape, squeeze, expand_dims or transpose reads its operand's buffer
  another way (a bitcast, or a layout XLA picks so that it is one): the
  result shares the operand's buffer, which lives until the last reader
  of either;
* an element-wise operation writes its result into an operand's buffer
  when that operand is read for the last time there and is as large
  (``HloDataflowAnalysis::CanShareOperandBufferWithUser``): a chain such
  as ``tanh(x * w + b)`` holds one buffer, not three.

An optimization barrier's results are its operands' buffers. A broadcast
read only by element-wise operations holds no buffer: XLA fuses it into
each of them. Nor does a comparison's boolean result read by one
element-wise operation (a ReLU's mask, read by the backward pass's
select): XLA computes it inside that reader, so the compared values are
held until there instead, four times the mask's bytes in float32. A
convolution whose operands or result are not in the order XLA:CPU's
convolutions take (``b01f_01io->b01f``: batch first and feature last, the
kernel's input then output feature last; a filter gradient is the common
case) works on copies laid out in that order, held while it runs. (The
GPU backend picks its own layouts for cuDNN; this rule is not checked
there.) A scan, while, cond or checkpoint holds, while it runs, what its
body holds at the body's own peak (the largest branch's for a cond),
less the body's results, which are the equation's outputs (a scan writes
each trip's slice into its stacked output): remat's backward loop
recomputes a layer there.

The program's inputs are not counted (the planners count the state and the
batch on their own), except those named in ``gathered``: a copy made for
the pass (ZeRO-3's gathered parameters), held from its first reader to its
last. The program's outputs are held to its end, except those named in
``released``: handed on where they are made (a gradient reduce-scattered
as soon as it is made, in a step of one micro-batch). Values named in
``folded`` are never held whole: the gradient stages add a scan's stacked
gradient into the partial sums, or reduce it, one trip's slice at a time
(``gradstack.py``), and count the sums and reduced gradients on their own.
"""

from __future__ import annotations

import heapq
import math
from typing import Iterable

from jax.extend.core import Literal, Var

from autopar.cost_model import itemsize
from autopar.strategies.elementwise import is_elementwise
from autopar.trace import region_jaxprs

__all__ = ["liveness_peaks"]

# The result is the operand's buffer read another way.
VIEWS = frozenset({"reshape", "squeeze", "expand_dims", "transpose"})


def liveness_peaks(jaxpr, k: int,
                   gathered: Iterable[Var] = (),
                   released: Iterable[Var] = (),
                   folded: Iterable[Var] = ()) -> list[list[Var]]:
  """The ``k`` program points where the most (replicated) bytes are held.

  Each is the list of the values whose buffers are held there, one value
  per buffer (the one that made it), and the values a convolution there
  copies (once more each).
  """
  eqns = jaxpr.eqns
  end = len(eqns)
  last_use: dict[Var, int] = {}
  first_use: dict[Var, int] = {}
  fused: set[Var] = set()            # broadcasts only element-wise readers read
  unfused: set[Var] = set(v for v in jaxpr.outvars if type(v) is not Literal)
  for i, eqn in enumerate(eqns):
    if eqn.primitive.name == "broadcast_in_dim":
      fused.add(eqn.outvars[0])
    elementwise = is_elementwise(eqn)
    for v in eqn.invars:
      if type(v) is not Literal:
        last_use[v] = i
        first_use.setdefault(v, i)
        if not elementwise:
          unfused.add(v)
  fused -= unfused
  released = {v for v in released if type(v) is not Literal}
  # A comparison's boolean result with one element-wise reader (a ReLU's
  # mask, read by the backward pass's select) is computed inside that
  # reader: XLA fuses it there, and holds the compared values until then.
  readers: dict[Var, set[int]] = {}
  for i, eqn in enumerate(eqns):
    for v in eqn.invars:
      if type(v) is not Literal:
        readers.setdefault(v, set()).add(i)
  recomputed: dict[Var, list[Var]] = {}  # value -> what its reader reads instead
  for i in range(len(eqns) - 1, -1, -1):  # last first: chains of masks
    eqn = eqns[i]
    if len(eqn.outvars) != 1 or not fusible(eqn):
      continue
    o = eqn.outvars[0]
    rs = readers.get(o, ())
    if o.aval.dtype != bool or o in unfused or len(rs) != 1 or \
        not fusible(eqns[next(iter(rs))]):
      continue
    fused.add(o)
    recomputed[o] = [v for v in eqn.invars if type(v) is not Literal]
    for v in recomputed[o]:
      last_use[v] = max(last_use[v], last_use[o])
  folded = set(folded)
  for v in jaxpr.outvars:
    if type(v) is not Literal and v not in released:
      last_use[v] = end

  aval_bytes: dict = {}              # aval -> bytes (a step has few distinct avals)
  def nbytes(v):
    b = aval_bytes.get(v.aval)
    if b is None:
      b = aval_bytes[v.aval] = math.prod(v.aval.shape) * itemsize(v.aval.dtype)
    return b

  copies: dict[int, list[Var]] = {}  # point -> values held only there
  for i, eqn in enumerate(eqns):
    if eqn.primitive.name == "conv_general_dilated":
      copied = [v for v in conv_relayouts(eqn)
                if type(v) is not Literal and v in last_use]
      if copied:
        copies[i] = copied
    # A loop's or branch's body holds its own values while it runs; its
    # results are the equation's (a scan's slices of its stacked outputs),
    # counted here already.
    bodies = region_jaxprs(eqn)
    if eqn.primitive.name == "while":
      bodies = bodies[1:]               # its cond's values are few and brief
    inner = [_body_held(sub) for sub in bodies]
    if inner:
      copies.setdefault(i, []).extend(max(inner, key=_held_bytes))

  # Buffers by the value that made them: their first and last point.
  owner: dict[Var, Var] = {}         # value -> the value whose buffer it is in
  inputs = set(jaxpr.invars) | fused  # and views of them: not counted
  start: dict[Var, int] = {}
  stop: dict[Var, int] = {}
  for v in gathered:
    if v in first_use:
      owner[v] = v
      start[v], stop[v] = first_use[v], last_use[v]
  for i, eqn in enumerate(eqns):
    name = eqn.primitive.name
    taken: set[Var] = set()
    for j, o in enumerate(eqn.outvars):
      if o in released:
        last_use[o] = max(last_use.get(o, i), i)
      if o not in last_use or o in fused or o in folded:
        continue                      # never read, fused into its readers, or folded
      buf = None
      same = eqn.invars[0] if name in VIEWS else \
          eqn.invars[j] if name == "optimization_barrier" else None
      if same is not None and type(same) is not Literal:
        if same in inputs and same not in owner:
          inputs.add(o)
          continue
        buf = owner.get(same)
      elif is_elementwise(eqn):
        for v in _read(eqn.invars, recomputed):
          b = owner.get(v)
          if b is not None and b not in taken and stop[b] == i and \
              nbytes(b) == nbytes(o):
            buf = b
            break
      if buf is None:
        owner[o] = o
        start[o], stop[o] = i, last_use[o]
      else:
        owner[o] = buf
        taken.add(buf)
        stop[buf] = max(stop[buf], last_use[o])

  # The bytes held at each point: add at the start, drop after the stop.
  delta = [0] * (end + 2)
  for b in start:
    delta[start[b]] += nbytes(b)
    delta[stop[b] + 1] -= nbytes(b)
  for i, vs in copies.items():
    delta[i] += sum(nbytes(v) for v in vs)
    delta[i + 1] -= sum(nbytes(v) for v in vs)
  sizes, size = [], 0
  for i in range(max(end, 1)):
    size += delta[i]
    sizes.append(size)
  peaks = heapq.nlargest(k, range(len(sizes)), key=sizes.__getitem__)
  return [[b for b in start if start[b] <= t <= stop[b]] + copies.get(t, [])
          for t in peaks]


def _body_held(jaxpr) -> list[Var]:
  """What a control-flow body holds at its peak, less its results."""
  results = {v for v in jaxpr.outvars if type(v) is not Literal}
  return [v for v in liveness_peaks(jaxpr, k=1, released=jaxpr.outvars)[0]
          if v not in results]


def _held_bytes(values) -> int:
  return sum(math.prod(v.aval.shape) * itemsize(v.aval.dtype) for v in values)


def fusible(eqn) -> bool:
  """An element-wise operation XLA may fuse (not a barrier or a marker)."""
  return is_elementwise(eqn) and eqn.primitive.name not in (
      "optimization_barrier", "autopar_value")


def _read(invars, recomputed) -> list[Var]:
  """The buffers an equation reads: a recomputed operand's own operands."""
  out, todo = [], [v for v in invars if type(v) is not Literal]
  while todo:
    v = todo.pop()
    if v in recomputed:
      todo.extend(recomputed[v])
    else:
      out.append(v)
  return out


def conv_relayouts(eqn) -> list:
  """The operands and result of a ``conv_general_dilated`` that XLA copies
  into its convolutions' order: batch first and feature last for the
  input and result, spatial dimensions then input and output feature for
  the kernel."""
  lhs, rhs, out = eqn.params["dimension_numbers"]
  n = len(lhs)
  spatial = tuple(range(1, n - 1))
  want_lhs = (0, n - 1, *spatial)
  want_rhs = (n - 1, n - 2, *range(n - 2))
  copied = []
  if tuple(lhs) != want_lhs:
    copied.append(eqn.invars[0])
  if tuple(rhs) != want_rhs:
    copied.append(eqn.invars[1])
  if tuple(out) != want_lhs:
    copied.append(eqn.outvars[0])
  return copied
