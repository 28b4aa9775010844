"""Which values of a program are in memory together: the peaks of its
liveness, for the planners' memory estimates.

A value XLA makes holds a buffer from the equation that makes it to its
last reader (the program's outputs to the end). What XLA makes, and where
its buffers are shared, follows XLA's fusion and buffer assignment:

* fusion (``Fusions``): a cheap element-wise producer, a broadcast or an
  iota is computed again inside each reader a loop fusion can take it
  into (an element-wise operation, a reduction, a broadcast, a view, a
  slice), an expensive one (``EXPENSIVE``: tanh, exp, division ...) only
  into a sole reader, and one that reads two operands of its size only if
  every reader takes it in; a reader that recomputes a value reads its
  operands instead. So GELU's backward holds ``x`` and ``tanh(...)``, not five
  intermediates, and a ReLU's mask read by the backward pass holds the
  compared values until there. What a dot, a convolution, a gather, a
  collective or a loop reads is made. XLA:CPU runs float reductions as
  YNNPACK kernels, which take in only what no other equation reads; a
  broadcast that such a kernel shares with other readers (ReLU's zero
  before a global average pool, a LayerNorm's scale) is made for it;
* a reshape, squeeze, expand_dims or transpose of a made value reads its
  operand's buffer another way (a bitcast, or a layout XLA picks so that
  it is one): the result shares the operand's buffer, which lives until
  the last reader of either; of a recomputed value it is a copy;
* an element-wise operation writes its result into an operand's buffer
  when that operand is read for the last time there and is as large
  (``HloDataflowAnalysis::CanShareOperandBufferWithUser``), and so do a
  scatter and a dynamic update into their first operand's;
* an operand of a convolution or dot not in the order XLA:CPU takes
  (``conv_relayouts``, ``dot_relayouts``: a filter gradient's operands;
  attention's query, key and value, whose heads sit between batch and
  sequence; a [d, heads, head_dim] kernel in the backward pass) is copied
  where it is made (an input's where it is first read), and the copy,
  one per order, is held until its last reader; a convolution's result
  in another order is written to a copy while it runs. (The GPU backend
  picks its own layouts for cuDNN and cuBLAS; these rules are not checked
  there.)

An optimization barrier's results are its operands' buffers. A scan,
while, cond or checkpoint holds, while it runs, what its body holds at
the body's own peak (the largest branch's for a cond), less the body's
results, which are the equation's outputs (a scan writes each trip's
slice into its stacked output): remat's backward loop recomputes a layer
there.

Finding the buffers (:func:`liveness`) is the costly part and does not
depend on the sizes; :meth:`Liveness.peaks` sizes them (a solution's own
peak: each value's bytes per device under its spec).

The program's inputs are not counted (the planners count the state and the
batch on their own), except those named in ``gathered``: a copy made for
each equation that reads it (ZeRO-3's gathered parameters), held while it
runs. The program's outputs are held to its end, except those named in
``released``: handed on where they are made (a gradient reduce-scattered
as soon as it is made, in a step of one micro-batch). Values named in
``folded`` are never held whole: the gradient stages add a scan's stacked
gradient into the partial sums, or reduce it, one trip's slice at a time
(``gradstack.py``), and count the sums and reduced gradients on their own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import math
import threading
from typing import Any, Callable, Hashable, Iterable

import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal, Var

from autopar.costs.cost_model import itemsize
from autopar.costs.strategies.elementwise import is_elementwise
from autopar.frontend.trace import region_jaxprs

__all__ = ["liveness_peaks", "liveness", "Liveness", "Held", "fusions", "fusions_shared",
           "Fusions", "relayouts", "conv_relayouts", "dot_relayouts"]

# The result is the operand's buffer read another way.
VIEWS = frozenset({"reshape", "squeeze", "expand_dims", "transpose"})

# The result is written into the first operand's buffer where that is read
# for the last time there (XLA's in-place scatters and dynamic updates).
IN_PLACE = frozenset({"scatter", "scatter-add", "scatter_add", "scatter-mul",
                      "scatter_mul", "scatter-min", "scatter_min", "scatter-max",
                      "scatter_max", "dynamic_update_slice"})


def liveness_peaks(jaxpr, k: int,
                   gathered: Iterable[Var] = (),
                   released: Iterable[Var] = (),
                   folded: Iterable[Var] = (),
                   size: Callable[[Var], float] | None = None,
                   platform: str = "cpu") -> list:
  """The ``k`` program points where the most bytes are held.

  Each is the list of the values whose buffers are held there, one value
  per buffer (the one that made it), and the values standing for the
  copies and broadcasts XLA makes there (each counted once more). A
  value's bytes are ``size(value)`` (default: the whole array's), so a
  plan's own peak is found with the bytes per device of its specs.
  ``platform``: whose rules apply ("cpu", "gpu", "tpu"): XLA:CPU's
  YNNPACK reductions and operand copies for its convolutions and dots
  only on "cpu" (``devices.platform_of``). A plan's copies of its values
  are :func:`liveness`'s ``operand_copies`` and ``twice``.
  """
  return liveness(jaxpr, gathered=gathered, released=released, folded=folded,
                  platform=platform).peaks(k, size)


@dataclasses.dataclass(frozen=True)
class Held:
  """A copy a plan makes, held in :meth:`Liveness.peaks`' results: equal
  to another where it is the same buffer (``key``: the same value in the
  same spec), ``nbytes`` its bytes under the plan, ``item`` what the
  planner named it by (``liveness``'s ``operand_copies`` and ``twice``)."""
  key: Hashable
  item: Any = dataclasses.field(compare=False)
  nbytes: float = dataclasses.field(compare=False)


@dataclasses.dataclass(frozen=True)
class Liveness:
  """Where a program's buffers are held, whatever their sizes
  (:func:`liveness`): :meth:`peaks` finds, for given sizes, the points
  where the most bytes are held. Finding the buffers is the costly part
  (fusion, buffer sharing); a planner that sizes the same program's values
  once per solution keeps this and calls :meth:`peaks`.

  Its values are the program's ``Var``s, or what :meth:`mapped` made of
  them (the sharding ILP keeps its own peak's as data: ``ilp_memory.py``).

  Attributes:
    end: the number of program points (equations).
    buffers: (value, first point, last point, whether a control-flow body
      gives it as a result) per buffer, in the order they are made.
    extras: (point, values held only there, the bodies of the region
      equation there) in point order; each body is a :class:`Liveness`
      whose values held at its own peak, less its results, are held at
      the point while it runs (the largest body's, for a cond).
    reads: (first point, point, key, item) per copy a plan may make of an
      operand for the equation at the point (``liveness``'s
      ``operand_copies``), held from the first point on.
    twice: (point, key, item, whether it is an output's) per second
      buffer a plan may make of a value made at the point (``twice``).
  """
  end: int
  buffers: tuple[tuple[Any, int, int, bool], ...]
  extras: tuple[tuple[int, tuple[tuple[Any, bool], ...], tuple["Liveness", ...]], ...]
  reads: tuple[tuple[int, int, Hashable, Any], ...] = ()
  twice: tuple[tuple[int, Hashable, Any, bool], ...] = ()

  def peaks(self, k: int, size: Callable[[Any], float] | None = None,
            where: bool = False, made: Callable[[Hashable, Any], Any] | None = None
            ) -> list:
    """The values held at the ``k`` points where ``size`` (default: a
    ``Var``'s whole bytes) adds up to the most; see :func:`liveness_peaks`.
    ``where``: each peak as ``(point, values)``. ``made(key, item)``: what
    a plan makes of a copy in :attr:`reads` or :attr:`twice`, as ``(the
    key of its buffer, bytes)``, or None where it makes none: reads of one
    buffer are one copy, held from the first to the last, and the outputs'
    second buffers are made where the last of them is (XLA combines the
    independent all-reduces of the gradients into one); each is a
    :class:`Held` in the result."""
    out = [(t, [v for v, _ in held]) for t, held in self._peaks(k, size, made)]
    return out if where else [held for _, held in out]

  def held(self, size: Callable[[Any], float] | None = None, made=None) -> list:
    """What a control-flow body holds at its peak, less its results."""
    return [v for v, result in self._peaks(1, size, made)[0][1] if not result]

  def _plan_copies(self, made) -> list[tuple[Held, int, int]]:
    """The copies ``made`` says a plan makes: (copy, first, last point)."""
    spans: dict = {}
    for first, i, key, item in self.reads:
      m = made(key, item)
      if m is not None:
        span = spans.setdefault(m[0], [Held(m[0], item, m[1]), first, i])
        span[1], span[2] = min(span[1], first), max(span[2], i)
    out = [tuple(span) for span in spans.values()]
    seconds = [(Held(m[0], item, m[1]), i, output) for i, key, item, output in self.twice
               if (m := made(key, item)) is not None and m[1]]
    last = max((i for _, i, output in seconds if output), default=0)
    out += [(c, last, last) if output else (c, i, i) for c, i, output in seconds]
    return out

  def _peaks(self, k: int, size, made=None) -> list[tuple[int, list[tuple[Any, bool]]]]:
    base = size or _nbytes
    def held(v):
      return v.nbytes if isinstance(v, Held) else base(v)
    buffers = self.buffers
    if made is not None and (self.reads or self.twice):
      buffers += tuple((c, first, last, False) for c, first, last in self._plan_copies(made))
    copies: dict[int, list[tuple[Any, bool]]] = {}
    for i, fixed, bodies in self.extras:
      if fixed:
        copies.setdefault(i, []).extend(fixed)
      inner = [body.held(size, made) for body in bodies]
      if inner:
        copies.setdefault(i, []).extend(
            (v, False) for v in max(inner, key=lambda vs: sum(map(held, vs))))
    # The bytes held at each point: add at the start, drop after the stop.
    delta = [0] * (self.end + 2)
    for v, first, last, _ in buffers:
      b = held(v)
      delta[first] += b
      delta[last + 1] -= b
    for i, vs in copies.items():
      delta[i] += sum(held(v) for v, _ in vs)
      delta[i + 1] -= sum(held(v) for v, _ in vs)
    totals, total = [], 0
    for i in range(max(self.end, 1)):
      total += delta[i]
      totals.append(total)
    peaks = heapq.nlargest(k, range(len(totals)), key=totals.__getitem__)
    return [(t, [(v, result) for v, first, last, result in buffers
                 if first <= t <= last] + copies.get(t, [])) for t in peaks]

  def mapped(self, fn: Callable[[Any], Any]) -> "Liveness":
    """The same buffers with each value ``v`` as ``fn(v)``, those for which
    it is None left out: their sizes must be 0 wherever :meth:`peaks` is
    called, so that the peaks are the same."""
    return Liveness(
        self.end,
        tuple((w, first, last, result) for v, first, last, result in self.buffers
              if (w := fn(v)) is not None),
        tuple((i, tuple((w, result) for v, result in fixed if (w := fn(v)) is not None),
               tuple(body.mapped(fn) for body in bodies))
              for i, fixed, bodies in self.extras),
        self.reads, self.twice)


def _nbytes(v) -> int:
  return math.prod(v.aval.shape) * itemsize(v.aval.dtype)


def liveness(jaxpr, *, gathered: Iterable[Var] = (), released: Iterable[Var] = (),
             folded: Iterable[Var] = (), platform: str = "cpu",
             results: Iterable[Var] = (),
             operand_copies: Callable[[Any, int], Iterable[tuple[Hashable, Any, bool]]]
             | None = None,
             twice: Callable[[Var], Iterable[tuple[Hashable, Any]]] | None = None
             ) -> Liveness:
  """The buffers of ``jaxpr`` and where they are held (see the module
  docstring and :func:`liveness_peaks`, which takes the same arguments);
  ``results``: the values a body gives back, marked so in the buffers.

  The copies a plan may make, whatever plan it is (``Liveness.peaks``'
  ``made`` says which it makes): ``operand_copies(eqn, position)``, the
  ``(key, item, from_start)`` of each copy of that operand a plan may make for
  the equation to read (a reshard's result, a gathered parameter), held
  from the equation that reads it (a ``from_start`` copy of one of the
  program's inputs from the start on "cpu", where XLA schedules the
  collectives the partitioner makes of parameters first); ``twice(value)``, those of each other buffer a plan may make of
  ``value`` where it is made (a partial sum all-reduced into a new
  buffer)."""
  eqns = jaxpr.eqns
  end = len(eqns)
  cpu = platform == "cpu"
  fusions = _fusions(jaxpr, platform)
  producer, outputs = fusions.producer, fusions.outputs

  # Where each buffer is read: the equations that run (not fused into their
  # readers), through what they recompute.
  last_use: dict[Var, int] = {}
  first_use: dict[Var, int] = {}
  reads: dict[int, list[Var]] = {}
  early: list = []                   # [copied value, first, last point]
  copied: dict[tuple, list] = {}     # (value, order) -> its copy in ``early``
  gathered = set(gathered)
  plan_reads = []                    # (first, point, key, item) of operand_copies
  program_inputs = set(jaxpr.invars)
  for i, eqn in enumerate(eqns):
    for pos in range(len(eqn.invars) if operand_copies is not None else 0):
      for key, item, from_start in operand_copies(eqn, pos):
        # XLA:CPU schedules the collectives of the program's inputs (a
        # parameter resharded for its reader) first: their copies are held
        # from the start.
        first = 0 if from_start and cpu and eqn.invars[pos] in program_inputs else i
        plan_reads.append((first, i, key, item))
    if not fusions.runs(i):
      continue
    reads[i] = fusions.reads(i)
    # An operand not in the order XLA:CPU's convolutions and dots take is
    # copied where it is made (the copy fused into its producer,
    # recomputing a ReLU, say), and the copy is held until the last
    # equation that reads it, which reads only it.
    for v, order in relayouts(eqn) if cpu else ():
      if type(v) is not Literal:
        # (A gathered input is copied from each reader's own gathered copy.)
        key = (v, order, i) if v in gathered else (v, order)
        if key not in copied:           # an input's copy: where it is first read
          copied[key] = [v, i if v in gathered else producer.get(v, first_use.get(v, i)), i]
          early.append(copied[key])
        copied[key][2] = i
        reads[i] = [u for u in reads[i] if u is not v]
        first_use.setdefault(v, i)
    for v in reads[i]:
      last_use[v] = i
      first_use.setdefault(v, i)
  early = [tuple(e) for e in early] + fusions.made_broadcasts()
  released = {v for v in released if type(v) is not Literal}
  folded = set(folded)
  results = {v for v in results if type(v) is not Literal}
  for v in outputs:
    if v not in released:
      last_use[v] = end

  # Each reader of a gathered input gathers its own copy (evaluate.py's
  # Rules.gathers), held while the reader runs; XLA runs it as soon as its
  # other operands are made (before independent work, such as a weight's
  # gradient made between them in the program's order, so that the
  # gathered copy is freed first): the copy is held at the point of the
  # last of them (at the reader's, where it reads no value made here).
  gathered_at: dict[int, list] = {}
  unanchored: dict = {}
  if gathered:
    made_at = {o: i for i, eqn in enumerate(eqns) for o in eqn.outvars}
    for i, eqn in enumerate(eqns):
      held = [v for v in dict.fromkeys(v for v in eqn.invars if type(v) is not Literal)
              if v in gathered]
      if not held:
        continue
      ready = [made_at[v] for v in eqn.invars if type(v) is not Literal and v in made_at]
      if ready and not region_jaxprs(eqn):
        gathered_at.setdefault(max(ready), []).extend(held)
      else:
        # A gather with no barrier (a loop's, a call's, or one whose
        # reader reads no value made here): XLA merges the equal ones
        # and issues them at the start, one copy held to the last reader.
        for v in held:
          unanchored[v] = i
  early += [[v, 0, last] for v, last in unanchored.items()]
  extras = []
  for i, eqn in enumerate(eqns):
    fixed = ()
    if cpu and eqn.primitive.name == "conv_general_dilated":
      # A result not in the convolution's order is written to a copy.
      fixed = tuple((v, v in results) for v in conv_relayouts(eqn)
                    if v is eqn.outvars[0] and v in last_use)
    fixed += tuple((v, False) for v in gathered_at.get(i, ()))
    # A loop's or branch's body holds its own values while it runs; its
    # results are the equation's (a scan's slices of its stacked outputs),
    # counted here already.
    bodies = region_jaxprs(eqn)
    if eqn.primitive.name == "while":
      bodies = bodies[1:]               # its cond's values are few and brief
    inner = tuple(liveness(sub, released=sub.outvars, platform=platform,
                           results=sub.outvars, operand_copies=operand_copies,
                           twice=twice) for sub in bodies)
    if fixed or inner:
      extras.append((i, fixed, inner))

  # Buffers by the value that made them: their first and last point.
  owner: dict[Var, Var] = {}         # value -> the value whose buffer it is in
  inputs = set(jaxpr.invars)         # and views of them: not counted
  start: dict[Var, int] = {}
  stop: dict[Var, int] = {}
  for i, eqn in enumerate(eqns):
    name = eqn.primitive.name
    taken: set[Var] = set()
    for j, o in enumerate(eqn.outvars):
      if o in released:
        last_use[o] = max(last_use.get(o, i), i)
      if o not in last_use or o in folded:
        continue                      # never read (or fused into its readers), or folded
      buf = None
      same = eqn.invars[0] if name in VIEWS else \
          eqn.invars[j] if name == "optimization_barrier" else None
      if same is not None and type(same) is not Literal:
        if same in inputs and same not in owner:
          inputs.add(o)
          continue
        buf = owner.get(same)
      elif is_elementwise(eqn) or name in IN_PLACE and j == 0:
        # A scatter's or dynamic update's result is written into its
        # operand's buffer.
        operands = reads[i] if name not in IN_PLACE else \
            [v for v in eqn.invars[:1] if type(v) is not Literal]
        for v in operands:
          b = owner.get(v)
          if b is not None and b not in taken and stop[b] == i and \
              _nbytes(b) == _nbytes(o):
            buf = b
            break
      if buf is None:
        owner[o] = o
        start[o], stop[o] = i, last_use[o]
      else:
        owner[o] = buf
        taken.add(buf)
        stop[buf] = max(stop[buf], last_use[o])

  # Copies and broadcasts XLA makes, each a buffer of the shape of the
  # value that stands for it in the result.
  seconds = []                       # (point, key, item, an output's) of twice
  for i, eqn in enumerate(eqns if twice is not None else ()):
    for o in eqn.outvars:
      for key, item in twice(o) if o in owner else ():
        # (An output's buffer is held to the end.)
        seconds.append((i, key, item, stop[owner[o]] == end))
  buffers = [(b, start[b], stop[b], b in results) for b in start]
  buffers += [(v, first, last, v in results) for v, first, last in early]
  return Liveness(end, tuple(buffers), tuple(extras), tuple(plan_reads), tuple(seconds))


def fusible(eqn) -> bool:
  """An element-wise operation XLA may fuse (not a barrier or a marker)."""
  return is_elementwise(eqn) and eqn.primitive.name not in (
      "optimization_barrier", "autopar_value")


# Element-wise operations XLA will not compute twice (after
# ``InstructionFusion::IsExpensive``: transcendental functions, division
# but an integer one by a constant): a value they make that has several
# readers is made once and held.
EXPENSIVE = frozenset({
    "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sqrt", "rsqrt",
    "cbrt", "pow", "atan2", "erf", "erfc", "erf_inv", "lgamma", "digamma", "tan",
    "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "div", "rem"})

_REDUCTIONS = ("reduce_sum", "reduce_max", "reduce_min")

# What a loop fusion can take a producer into: element-wise operations,
# reductions (as the fusion's root), broadcasts, views and slicing.
_CONSUMERS = frozenset({
    *_REDUCTIONS, "reduce_prod", "reduce_and", "reduce_or", "argmax", "argmin",
    "broadcast_in_dim", "concatenate", "pad", "slice", "dynamic_slice", *VIEWS})


def fusions(jaxpr, platform: str = "cpu") -> "Fusions":
  """Which of ``jaxpr``'s values XLA computes inside their readers (see
  :class:`Fusions`; XLA:CPU's YNNPACK kernels only on "cpu"); the ILP
  counts memory traffic with it."""
  return _fusions(jaxpr, platform)


_SHARED = threading.local()


@contextlib.contextmanager
def fusions_shared():
  """Within it, each jaxpr's :class:`Fusions` are found once on this thread:
  planning reads them for each problem over one program (its traffic, the
  price of a preset's layout on the same rows, the chosen plan's
  liveness), and each finding walks the whole unrolled program. They are
  let go at its end (the plan keeps its problems, and with them their
  jaxprs)."""
  outer = getattr(_SHARED, "seen", None)
  if outer is None:
    _SHARED.seen = {}
  try:
    yield
  finally:
    if outer is None:
      _SHARED.seen = None


def _fusions(jaxpr, platform: str) -> "Fusions":
  seen = getattr(_SHARED, "seen", None)
  if seen is None:
    return Fusions.of(jaxpr, platform)
  # (The jaxpr is held with its entry: its id is not another's meanwhile.)
  found = seen.get((id(jaxpr), platform))
  if found is None:
    found = seen[id(jaxpr), platform] = (jaxpr, Fusions.of(jaxpr, platform))
  return found[1]


class Fusions:
  """Which values XLA computes inside their readers instead of making.

  ``fused_into(v, i)``: whether reader ``i`` recomputes ``v``. A loop
  fusion takes in a cheap element-wise producer, a broadcast or an iota
  (recomputing it in each such reader, even where another reader needs it
  made, unless it reads more than one operand of its size), an expensive
  one only as its sole reader. A YNNPACK reduction of XLA:CPU's
  (``kernel_of``; with ``cpu`` False there are none) takes in only what
  nothing outside it reads. ``runs(i)``:
  whether equation ``i`` runs where it stands (some reader needs its
  result made); ``reads(i)``: the made values it reads, through what it
  recomputes. ``made_broadcasts()``: the broadcasts a kernel shares with
  other readers (XLA merges equal broadcasts), which are made for it.
  """

  @classmethod
  def of(cls, jaxpr, platform: str = "cpu") -> "Fusions":
    producer: dict[Var, int] = {}
    readers: dict[Var, list[int]] = {}
    for i, eqn in enumerate(jaxpr.eqns):
      for o in eqn.outvars:
        producer[o] = i
      for v in dict.fromkeys(v for v in eqn.invars if type(v) is not Literal):
        readers.setdefault(v, []).append(i)
    outputs = {v for v in jaxpr.outvars if type(v) is not Literal}
    return cls(jaxpr.eqns, producer, readers, outputs, platform == "cpu")

  def __init__(self, eqns, producer, readers, outputs, cpu: bool = True):
    self.eqns, self.producer, self.readers = eqns, producer, readers
    self.outputs = outputs
    self.cpu = cpu
    self._sources: dict[Var, list[Var]] = {}
    self._kernel: dict[int, int | None] = {}
    self._fused: dict[tuple[Var, int], bool] = {}    # (see fused_into)
    # In program order, so that each value's sources are found from its
    # operands' without a deep recursion.
    for i, eqn in enumerate(eqns):
      if len(eqn.outvars) == 1 and any(self.fused_into(eqn.outvars[0], r)
                                       for r in readers.get(eqn.outvars[0], ())):
        self._sources[eqn.outvars[0]] = self.reads(i)

  def made_broadcasts(self) -> list[tuple[Var, int, int]]:
    """The broadcasts made for YNNPACK kernels: (a value of the
    broadcast's shape and type standing for it, the first and the last
    kernel that reads it).

    An element-wise operation broadcasts an operand of fewer elements (a
    literal, or size-1 dimensions) to its own shape; XLA merges equal
    broadcasts (CSE), and a kernel takes one in only if nothing else reads
    it."""
    if not self.cpu:
      return []
    readers: dict[tuple, list[int]] = {}
    already = set()                   # made by a broadcast equation that runs
    for i, eqn in enumerate(self.eqns):
      if not eqn.outvars or not any(o in self.outputs or o in self.readers
                                    for o in eqn.outvars):
        continue                      # dead
      out = eqn.outvars[0].aval
      if eqn.primitive.name == "broadcast_in_dim" and type(eqn.invars[0]) is Literal:
        key = _broadcast_key(eqn.invars[0], out)
        readers.setdefault(key, []).extend(self.readers.get(eqn.outvars[0], ()))
        if self.runs(i):
          already.add(key)
      elif fusible(eqn) and out.shape:
        for v in eqn.invars:
          if tuple(v.aval.shape) != tuple(out.shape):
            readers.setdefault(_broadcast_key(v, out), []).append(i)
    made = []
    for key, rs in readers.items():
      where = {self.kernel_of(r) for r in rs}
      kernels = sorted(where - {None})
      if not kernels or len(where) < 2 or key in already:
        continue                      # no kernel reads it, one alone, or made anyway
      like = [o for o in (self.eqns[r].outvars[0] for r in rs if self.eqns[r].outvars)
              if str(o.aval.dtype) == key[-1] and tuple(o.aval.shape) == key[-2]]
      if like:
        made.append((like[0], kernels[0], kernels[-1]))
    return made

  def kernel_of(self, i: int) -> int | None:
    """The YNNPACK reduction of XLA:CPU's that equation ``i`` is, or runs
    inside: an element-wise operation, broadcast or iota all of whose
    readers are inside one."""
    if not self.cpu:
      return None
    got = self._kernel.get(i, -1)
    if got != -1:
      return got
    # Readers come later in the program: settle them first, last to first.
    todo = [i]
    while todo:
      j = todo[-1]
      eqn = self.eqns[j]
      got = None
      if eqn.primitive.name in _REDUCTIONS:
        got = j if jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.floating) else None
      elif (fusible(eqn) or eqn.primitive.name in ("broadcast_in_dim", "iota")) and \
          len(eqn.outvars) == 1 and eqn.outvars[0] not in self.outputs:
        rs = self.readers.get(eqn.outvars[0], ())
        pending = [r for r in rs if r not in self._kernel]
        if pending:
          todo.extend(pending)
          continue
        kernels = {self._kernel[r] for r in rs}
        if len(kernels) == 1:
          got = kernels.pop()
      self._kernel[j] = got
      todo.pop()
    return self._kernel[i]

  def fused_into(self, v: Var, i: int) -> bool:
    """Whether reader ``i`` computes ``v`` itself (asked for every operand of
    every equation, several times each: kept once found)."""
    key = (v, i)
    got = self._fused.get(key)
    if got is None:
      got = self._fused[key] = self._fused_into(v, i)
    return got

  def _fused_into(self, v: Var, i: int) -> bool:
    p = self.producer.get(v)
    if p is None or v in self.outputs:
      return False
    made = self.eqns[p]
    if len(made.outvars) != 1:
      return False
    rs = self.readers[v]
    if made.primitive.name not in ("broadcast_in_dim", "iota"):
      if not fusible(made) or (len(rs) > 1 and _expensive(made)):
        return False
      # XLA computes a value twice (made for one reader, again inside
      # another) only where that reads no more than one operand of its
      # size (``InstructionFusion::ComputeGloballyUnfusible``).
      if len(rs) > 1 and self._full_operands(made) > 1 and \
          not all(self._takes(self.eqns[r]) and self.kernel_of(r) is None for r in rs):
        return False
    kernel = self.kernel_of(i)
    if kernel is not None:            # a kernel takes in what only it reads
      return self.kernel_of(p) == kernel
    return self._takes(self.eqns[i])

  def _full_operands(self, eqn) -> int:
    """How many of an element-wise operation's operands are as large as its
    result and not a broadcast or an iota."""
    size = math.prod(eqn.outvars[0].aval.shape)
    n = 0
    for v in eqn.invars:
      if type(v) is Literal or math.prod(v.aval.shape) != size:
        continue
      p = self.producer.get(v)
      if p is None or self.eqns[p].primitive.name not in ("broadcast_in_dim", "iota"):
        n += 1
    return n

  @staticmethod
  def _takes(reader) -> bool:
    return fusible(reader) or reader.primitive.name in _CONSUMERS

  def held(self, o: Var) -> bool:
    """Whether value ``o`` is made and held (not only computed inside its
    readers)."""
    return o in self.outputs or any(not self.fused_into(o, r)
                                    for r in self.readers.get(o, ()))

  def runs(self, i: int) -> bool:
    """Whether equation ``i`` runs where it stands (some result of it is
    held), rather than only inside its readers."""
    eqn = self.eqns[i]
    return not eqn.outvars or bool(eqn.effects) or any(
        o in self.outputs or any(not self.fused_into(o, r) for r in self.readers.get(o, ()))
        for o in eqn.outvars)

  def reads(self, i: int) -> list[Var]:
    """The held values equation ``i`` reads, through what it recomputes."""
    out: dict[Var, None] = {}
    for v in self.eqns[i].invars:
      if type(v) is Literal:
        continue
      if self.fused_into(v, i):
        out.update(dict.fromkeys(self._sources_of(v)))
      else:
        out[v] = None
    return list(out)

  def _sources_of(self, v: Var) -> list[Var]:
    """What recomputing ``v`` reads (found in ``__init__``)."""
    return self._sources[v]


def _broadcast_key(v, out) -> tuple:
  """What XLA's CSE tells broadcasts apart by: the operand (a literal by
  its value), the shape and the type."""
  if type(v) is Literal:
    what = ("literal", np.asarray(v.val, v.aval.dtype).tobytes())
  else:
    what = ("value", id(v))
  return (*what, tuple(out.shape), str(v.aval.dtype))


def _expensive(eqn) -> bool:
  name = eqn.primitive.name
  if name in ("div", "rem"):          # integer division by a constant is cheap
    return not (jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.integer) and
                type(eqn.invars[1]) is Literal)
  return name in EXPENSIVE


def relayouts(eqn) -> list[tuple[Var, tuple]]:
  """The operands of a convolution or dot XLA:CPU reads through a copy in
  another order: (operand, the order it is copied to)."""
  name = eqn.primitive.name
  if name == "conv_general_dilated":
    lhs, rhs, _ = eqn.params["dimension_numbers"]
    copied = conv_relayouts(eqn)
    return [(v, tuple(order)) for v, order in zip(eqn.invars[:2], (lhs, rhs))
            if any(v is c for c in copied)]
  if name == "dot_general":
    return dot_relayouts(eqn)
  return []


def dot_relayouts(eqn) -> list[tuple[Var, tuple]]:
  """The operands of a ``dot_general`` that XLA:CPU copies before the dot.

  Its dots take each operand as a matrix after the batch dimensions, which
  lead: (batch, free, contracted) or (batch, contracted, free), except
  that the right one without batch dimensions must be (contracted, free)
  unless it is a plain matrix. Anything else (attention's query, key and
  value, whose heads sit between the batch and the sequence; a kernel of
  shape [d, heads, head_dim] contracted over its last two dimensions in
  the backward pass) is copied into the first order."""
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  out = []
  for side, (v, contract, batch) in enumerate(((eqn.invars[0], lc, lb),
                                               (eqn.invars[1], rc, rb))):
    n = len(v.aval.shape)
    free = tuple(d for d in range(n) if d not in contract and d not in batch)
    ok = [(*batch, *free, *contract)] if side == 0 else [(*batch, *contract, *free)]
    if side == 0 or batch or n == 2:
      ok.append((*batch, *contract, *free) if side == 0 else (*batch, *free, *contract))
    if not _ordered_as(v.aval.shape, ok):
      out.append((v, ok[0]))
  return out


def _ordered_as(shape, orders) -> bool:
  """Whether ``shape``'s dimensions are, leaving out those of size 1 (a
  copy moves nothing for them), in one of ``orders``."""
  for order in orders:
    kept = [d for d in order if shape[d] != 1]
    if kept == sorted(kept):
      return True
  return False


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
