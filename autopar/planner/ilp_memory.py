"""The sharding ILP's memory model (``ilp.py``): what a plan holds per
device, as terms of the choice variables for the budget's constraints and
as bytes at a solution.

* the state: every leaf in its chosen spec, the gradients held
  besides one micro-batch's pass (``_gradient_items``), and the values of
  the pass held beyond it (``ShardingProblem``'s ``held``: a pipeline
  stage's residuals of the micro-batches in flight), counted last;
* the pass: the values live at its points (``autopar.costs.liveness``),
  each in its chosen spec; the budget's constraints take the points where
  what is held is not a part of what another holds (``_memory_items``),
  and a solution's own peaks are found again under its specs
  (``_peaks_at_solution``), which ``ShardingProblem.solve`` adds where they
  are over the budget;
* what the plan makes for the pass's readers (:class:`Copy`): an operand
  resharded by a collective to the spec its reader takes (a parameter
  stored split and gathered whole for a matmul, activations gathered over
  the rows), and a parameter split over the batch axes (ZeRO-3) gathered
  for the pass. XLA makes one such buffer per value and spec and holds it
  from its first reader to its last: the forward and backward matmuls of a
  layer read one gathered kernel. And the partial sums a strategy
  all-reduces: the all-reduce writes a new buffer, so the value is held
  twice where it is made, and a gradient twice where the last gradient
  so reduced is made (XLA combines their all-reduces into one there).

A memory item is ``(node, output, aval, factor)``: ``factor`` times that
output's bytes per device under the node's choice; or a :class:`Copy`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from autopar.planner import lp
from jax.extend.core import Var

from autopar.costs.cost_model import itemsize
from autopar.frontend.gradstack import find_grad_stacks, folded_values
from autopar.costs.liveness import Held, Liveness, liveness
from autopar.method import accumulation_dtype
from autopar.costs.strategies import REGIONS, local_bytes

__all__ = ["MemoryModel", "Copy"]


@dataclasses.dataclass(frozen=True)
class Copy:
  """A buffer the plan makes for the pass's readers, as a memory item.

  ``edge`` (``ChoiceGraph.operand_edges``): the operand resharded by a
  collective to the spec its reader takes, in that spec's bytes wherever
  the plan makes and reads it in different specs; ``leaf``: the node of a
  parameter, gathered over the batch axes where the plan splits it over
  them (ZeRO-3), whole: XLA gathers a partly manual operand over the
  automatic axes too before the batch axes' all-gather (measured on
  XLA:CPU, jax 0.10: a [4096, 64] table split over "data" and "model" of
  a 2 x 4 mesh is all-gathered to [2048, 64], then to [4096, 64]);
  ``reduced``: (node, output) of a value whose strategy all-reduces it, its
  bytes where the chosen strategy does; ``synced``: the gradient node of a
  gradient all-reduced over the batch axes at the end of a step of one
  micro-batch, its bytes in its spec; ``chain``: (value, k), the largest
  copy that a program input's readers from its ``k``-th on reshard it to
  (``MemoryModel._chains``).
  """
  aval: Any
  edge: tuple | None = None
  leaf: int | None = None
  reduced: tuple[int, int] | None = None
  synced: int | None = None
  chain: tuple | None = None


# Points of the pass (by replicated bytes, and by smallest) at which a
# memory budget is held from the first solve.
_POINTS = 256


def _whole(aval) -> float:
  """Bytes of the whole array."""
  return float(math.prod(aval.shape) * itemsize(aval.dtype))


def _distinct(points: list[tuple[int, list]]) -> list[tuple[int, list]]:
  """``points`` (each a point and the list of what is held there) less
  those that hold only what one before them holds (a constraint there adds
  nothing)."""
  kept: list[set] = []
  out = []
  for t, live in points:
    ids = {id(v) if not isinstance(v, Held) else v for v in live}
    if not any(ids <= k for k in kept):
      kept.append(ids)
      out.append((t, live))
  return out


class MemoryModel:
  """The memory terms of ``ShardingProblem``, which it is mixed into (it
  reads the graph's nodes, values and chosen specs)."""

  def _bytes(self, node_id, pos, aval, choice) -> float:
    """Bytes per device of a node's output ``pos`` under one of its choices."""
    node = self.nodes[node_id]
    if node.mem is not None:
      return node.mem[choice]
    return local_bytes(aval, node.specs[choice][pos], self.sizes)

  def _bytes_per_choice(self, node_id, pos, aval) -> list[float]:
    return [self._bytes(node_id, pos, aval, c)
            for c in range(len(self.nodes[node_id].choices))]

  def _memory_items(self):
    """What memory counts: ([(node, pos, aval, factor)] of the state,
    [the memory items at each point of the pass]). Which values are held
    together does not depend on their specs, so a plan's peak is at one of
    the points where what is held is not a part of what is held at
    another. Without a budget, the three highest in replicated bytes; with
    one, the ``_POINTS`` highest in replicated bytes,
    the ``_POINTS`` highest with each value at its smallest choice's bytes
    (where a plan within a tight budget holds the most) and the last
    point (the gradients), each with the copies a plan may hold there
    (:meth:`_copies_at`)."""
    if getattr(self, "_mem_items", None) is None:
      state = [(self.leaf_nodes[k], 0, aval, 1) for k, aval in enumerate(self.leaf_avals)]
      state += self._gradient_items()
      val = self._values
      # Held values count with the state against the budget, last.
      held = [(*val[v], v.aval, f) for v, f in getattr(self, "held", ()) if v in val]
      state += held
      self._num_held = len(held)
      def smallest(v):
        ref = val.get(v)
        return 0 if ref is None else min(self._bytes_per_choice(*ref, v.aval))
      k = _POINTS if self.memory_budget is not None else 3
      points = self._liveness.peaks(k, where=True) + \
          self._liveness.peaks(k, smallest, where=True)
      if self.memory_budget is not None:
        # The last point (the gradients, and their all-reduces) too.
        end = len(self.compute.jaxpr.eqns) - 1
        points += [p for p in self._liveness.peaks(end + 1, where=True) if p[0] == end]
      peaks = [self._items(live) + (self._copies_at(t, live)
                                    if self.memory_budget is not None else [])
               for t, live in _distinct(points)]
      self._mem_items = (state, peaks)
    return self._mem_items

  @functools.cached_property
  def _liveness(self) -> Liveness:
    """Where the pass holds its values (``liveness.liveness``), with the
    copies any plan may make of them (:meth:`_copy_candidates`,
    :meth:`_second_candidates`; sized only where a solution is, with
    :meth:`_made`)."""
    cj = self.compute.jaxpr
    folded = folded_values(cj, self._stacks) \
        if self.n > 1 or self._batch_size_devices > 1 else []
    self._gathers = 0
    return liveness(cj, folded=folded, platform=self.platform,
                    operand_copies=self._copy_candidates,
                    twice=self._second_candidates)

  @functools.cached_property
  def _own_liveness(self) -> Liveness:
    """:attr:`_liveness` with each value as its memory item (``(node,
    output, aval, 1)``), those the graph does not have left out (a plan
    holds them in no spec: 0 bytes at its own peak): what finds a
    solution's own peaks (:meth:`_peaks_at_solution`), and what a problem
    read back from a plan's JSON keeps of the pass (``ilp_saved.py``)."""
    val = self._values
    return self._liveness.mapped(lambda v: (*val[v], v.aval, 1) if v in val else None)

  def _copies_at(self, t: int, live) -> list[Copy]:
    """The copies any plan may hold at point ``t`` of the pass (``live``
    held there), as memory items: a program input's largest copy for its
    readers from ``t`` on (from its first reader on, except on "cpu"),
    its gather over the batch axes (ZeRO-3) where a reader runs, an
    activation's copy where its reader runs, the second buffer of a value
    all-reduced where it is made, and of every gradient at the last
    point. An activation's copy held between two readers is left to the
    plan's own peaks (``ShardingProblem.solve``)."""
    cj = self.compute.jaxpr
    cpu = self.platform == "cpu"
    out = []
    for v, readers in self._readers.items():
      points = [i for i, _ in readers]
      if v in self._inputs:
        if (cpu or t >= points[0]) and t <= points[-1]:
          k = next(j for j, i in enumerate(points) if i >= t)
          out.append(Copy(v.aval, chain=(v, k)))
      else:
        out.extend(Copy(v.aval, edge=e) for i, e in readers if i == t)
    for v, points in self._input_reads.items():
      node = self._values[v][0]
      if t in points and any(dim is not None for _, dim in self.nodes[node].choices):
        out.append(Copy(v.aval, leaf=node))
    end = len(cj.eqns) - 1
    made = [o for o in cj.eqns[t].outvars] if t < len(cj.eqns) else []
    for v in (live if t == end else made):
      ref = self._values.get(v) if isinstance(v, Var) else None
      if ref is not None and ref[0] not in self._leaf_node_set and \
          self._may_reduce(ref[0]):
        out.append(Copy(v.aval, reduced=ref))
    if t == end:
      out.extend(Copy(v.aval, synced=node) for v, node in self._synced.items())
    return out

  @functools.cached_property
  def _inputs(self) -> set:
    return set(self.compute.jaxpr.invars)

  @functools.cached_property
  def _readers(self) -> dict:
    """Per value of the pass's top level, the equations some plan reshards
    it for by a collective: [(point, edge)] in program order."""
    out: dict = {}
    for i, eqn in enumerate(self.compute.jaxpr.eqns):
      if eqn.primitive.name in REGIONS:
        continue
      for pos, v in enumerate(eqn.invars):
        edge = self.operand_edges.get((id(eqn), pos))
        if edge is not None and isinstance(v, Var) and self._flows.get(
            self._edge_key(edge[0][0], edge[0][1], *edge[1:])):
          out.setdefault(v, []).append((i, edge))
    return out

  @functools.cached_property
  def _input_reads(self) -> dict:
    """Per program input the pass's top level reads (a leaf): the points
    of its readers (each gathers its own copy where the plan splits it
    over the batch axes)."""
    out: dict = {}
    for i, eqn in enumerate(self.compute.jaxpr.eqns):
      for v in eqn.invars:
        if isinstance(v, Var) and v in self._inputs and v in self._values:
          out.setdefault(v, set()).add(i)
    return out

  def _chains(self) -> None:
    """The variables of the largest copies of the program inputs
    (:class:`Copy` ``chain``): ``y[v, k] >= y[v, k + 1]`` and ``y[v, k] >=``
    the copy for the ``k``-th reader, so that, held in a constraint of the
    budget, ``y[v, k]`` is the largest copy of ``v`` its readers from the
    ``k``-th on read (one buffer, where they read one spec)."""
    self._chain_vars = {}
    for v, readers in self._readers.items():
      if v not in self._inputs:
        continue
      ys = [self._variable(f"y_{len(self._chain_vars)}_{k}", lowBound=0)
            for k in range(len(readers))]
      self._chain_vars[v] = ys
      self.num_variables += len(ys)
      for k, (_, edge) in enumerate(readers):
        copy = self._copy_terms(Copy(v.aval, edge=edge))
        self.prob += lp.linear([(ys[k], 1.0)] + [(x, -b) for x, b in copy]) >= 0
        self.num_constraints += 1
        if k + 1 < len(readers):
          self.prob += lp.linear([(ys[k], 1.0), (ys[k + 1], -1.0)]) >= 0
          self.num_constraints += 1

  def _items(self, live) -> list:
    """Memory items of the values in ``live`` that the graph has, and of
    the copies among them."""
    val = self._values
    return [(*val[v], v.aval, 1) for v in live if v in val]

  @functools.cached_property
  def _values(self) -> dict:
    """The pass's values (its bodies' too) -> (node, output)."""
    return {**self.body_val["compute"], **self.compute_val}

  def _peak_at_solution(self) -> list:
    """Memory items at the pass's peak under the chosen specs: where the
    plan splits the values largest replicated, the peak moves to where
    the ones it keeps whole are held."""
    return (self._peaks_at_solution() or [[]])[0]

  def _peaks_at_solution(self) -> list[list]:
    """Memory items at the pass's highest points under the chosen specs,
    highest first: up to four, none holding only what another holds.
    Found once per solve (the solver clears ``_own_peak``)."""
    if getattr(self, "_own_peak", None) is None:
      live = self._own_liveness.peaks(16, lambda it: self._bytes(
          it[0], it[1], it[2], self._chosen(it[0])), where=True, made=self._made)
      self._own_peak = [[v.item if isinstance(v, Held) else v for v in p]
                        for _, p in _distinct(live)[:4]]
    return self._own_peak

  def _second_candidates(self, v) -> list[tuple[tuple, Copy]]:
    """The other buffers a plan may make of ``v`` (``liveness``'s
    ``twice``): where a strategy all-reduces it, and a gradient's over the
    batch axes (``_synced``)."""
    ref = self._values.get(v)
    if ref is None or ref[0] in self._leaf_node_set:
      return []
    out = []
    if self._may_reduce(ref[0]):
      out.append((("reduced", *ref), Copy(v.aval, reduced=ref)))
    if v in self._synced:
      out.append((("synced", *ref), Copy(v.aval, synced=self._synced[v])))
    return out

  @functools.cached_property
  def _synced(self) -> dict:
    """The gradients a step of one micro-batch all-reduces over the batch
    axes into buffers of their own, held beside the pass's where the last
    of them is made (XLA combines the all-reduces there): gradient output
    -> its gradient node. A stacked one (``gradstack.py``) is reduced a
    layer at a time inside its loop: it stays with the state's items."""
    if self.n > 1 or self._batch_size_devices == 1:
      return {}
    cj = self.compute.jaxpr
    stacked = {g for s in self._stacks for g in s.grads}
    return {cj.outvars[g]: node for g, node in enumerate(self.grad_nodes)
            if g not in stacked and isinstance(cj.outvars[g], Var)
            and cj.outvars[g] in self.compute_val}

  def _reduces(self, node, choice) -> bool:
    """Whether choice ``choice`` of node ``node`` all-reduces its result."""
    st = self.nodes[node].choices[choice]
    return any(kind == "all-reduce" for kind, _, _ in getattr(st, "collectives", ()))

  def _may_reduce(self, node) -> bool:
    """Whether some choice of node ``node`` all-reduces its result."""
    return any(self._reduces(node, c) for c in range(len(self.nodes[node].choices)))

  def _copy_candidates(self, eqn, pos) -> list[tuple[tuple, Copy, bool]]:
    """The copies a plan may make of operand ``pos`` of ``eqn`` for it to
    read (``liveness``'s ``operand_copies``): the operand resharded by a
    collective (a program input's from the start, on XLA:CPU), and a
    parameter gathered over the batch axes, by each reader for itself
    (``evaluate.py``'s ``Rules.gathers``). A loop or call reads its
    operands where its body does."""
    v = eqn.invars[pos]
    if not isinstance(v, Var) or eqn.primitive.name in REGIONS:
      return []
    ref = self._values.get(v)
    if ref is None:
      return []
    out = []
    if ref[0] in self._leaf_node_set and any(
        dim is not None for _, dim in self.nodes[ref[0]].choices):
      self._gathers += 1               # (one buffer per reader)
      out.append((("gathered", *ref, self._gathers), Copy(v.aval, leaf=ref[0]), False))
    edge = self.operand_edges.get((id(eqn), pos))
    if edge is not None:
      out.append((("reshard", *ref), Copy(edge[3], edge=edge), True))
    return out

  def _made(self, key: tuple, item: Copy):
    """What the solution makes of a copy ``_own_liveness`` holds
    (``Liveness.peaks``' ``made``): (its buffer's key, bytes), or None.
    Reshards of one value to one spec are one buffer (XLA makes one
    collective of one operand and sharding)."""
    b = self._copy_at_solution(item)
    if not b:
      return None
    if item.edge is not None:                 # (one buffer per spec read in)
      _, dst, dpos, _, _ = item.edge
      key = (key, self._read_spec(dst, dpos))
    return key, b

  def _read_spec(self, dst, dpos):
    """The spec the solution reads an edge's value in: operand ``dpos``
    of node ``dst``'s strategy, or (``dpos`` < 0) the spec of output
    ``-1 - dpos`` of the node an element-wise operand follows."""
    c = self._chosen(dst)
    if dpos >= 0:
      return self.nodes[dst].choices[c].in_specs[dpos]
    return self.nodes[dst].specs[c][-1 - dpos]

  @functools.cached_property
  def _leaf_node_set(self) -> set[int]:
    return set(self.leaf_nodes)

  def _copy_terms(self, item: Copy) -> list:
    """A copy's bytes as ``[(variable, bytes)]``, for any solution: for a
    reshard, the bytes of each spec its reader takes times the flows into
    it from the other specs (``ShardingProblem._edge``); for a gathered
    parameter, its choices split over the batch axes."""
    if item.leaf is not None:
      node = self.nodes[item.leaf]
      return [(x, _whole(item.aval))
              for (_, dim), x in zip(node.choices, node.vars) if dim is not None]
    if item.reduced is not None:
      n, pos = item.reduced
      return [(x, local_bytes(item.aval, specs[pos], self.sizes))
              for c, (specs, x) in enumerate(zip(self.nodes[n].specs, self.nodes[n].vars))
              if self._reduces(n, c)]
    if item.synced is not None:
      return [(x, b) for x, b in zip(self.nodes[item.synced].vars,
                                     self._bytes_per_choice(item.synced, 0, item.aval))]
    if item.chain is not None:
      v, k = item.chain
      return [(self._chain_vars[v][k], 1.0)]
    (src, spos), dst, dpos, aval, part = item.edge
    flows = self._flows.get(self._edge_key(src, spos, dst, dpos, aval, part), {})
    return [(x, local_bytes(aval, r, self.sizes))
            for (_, r), xs in flows.items() for x in xs]

  def _copy_at_solution(self, item: Copy) -> float:
    """A copy's bytes under the chosen specs."""
    if item.leaf is not None:
      _, dim = self.nodes[item.leaf].choices[self._chosen(item.leaf)]
      return 0.0 if dim is None else _whole(item.aval)
    if item.reduced is not None:
      n, pos = item.reduced
      c = self._chosen(n)
      return local_bytes(item.aval, self.nodes[n].specs[c][pos], self.sizes) \
          if self._reduces(n, c) else 0.0
    if item.synced is not None:
      return self._bytes(item.synced, 0, item.aval, self._chosen(item.synced))
    if item.chain is not None:
      v, k = item.chain
      return max(self._copy_at_solution(Copy(v.aval, edge=e))
                 for _, e in self._readers[v][k:])
    (src, spos), dst, dpos, aval, _ = item.edge
    p = self.nodes[src].specs[self._chosen(src)][spos]
    r = self._read_spec(dst, dpos)
    if r is None or r == p or self._reshard(aval, p, r) <= 0:
      return 0.0
    return local_bytes(aval, r, self.sizes)

  def _gradient_items(self):
    """The gradients held besides one micro-batch's pass (whose own
    gradients are at its liveness peaks), as memory items:

    * split over batch axes and run in several micro-batches: the
      un-reduced partial sums, in the spec the pass makes them and the
      accumulation dtype (float32 for bfloat16); the reduced gradients take
      their buffer where the dtype is the same (where they are scattered
      over the batch axes, ZeRO, their 1/d share is left out);
    * one micro-batch over batch axes: the reduced gradients, beside the
      pass's, are counted in the pass where the last gradient is made
      (``_synced``), except a stacked one's;
    * several micro-batches, no batch axes: the sums, in the gradients'
      spec and the accumulation dtype;
    * neither: nothing (the pass's gradients are the step's).

    A stacked gradient that a scan makes (``gradstack.py``) is folded into
    the sums or reduced a layer at a time, never held whole in the pass;
    its reduced gradients are a buffer of their own beside the sums.
    """
    cj = self.compute.jaxpr
    carried, split = self.n > 1, self._batch_size_devices > 1
    stacked = {g for s in self._stacks for g in s.grads}
    items = []
    for g, node in enumerate(self.grad_nodes):
      v = cj.outvars[g]
      aval = v.aval
      ratio = itemsize(accumulation_dtype(aval.dtype, self.accumulate)) / \
          itemsize(aval.dtype)
      if carried and split and isinstance(v, Var) and v in self.compute_val:
        items.append((*self.compute_val[v], aval, ratio))
      elif carried:
        items.append((node, 0, aval, ratio))
      if isinstance(v, Var) and v in self._synced:
        continue                    # beside the pass's, where it ends (_synced)
      if (split and (not carried or ratio != 1)) or (carried and g in stacked):
        items.append((node, 0, aval, 1))
    return items

  @functools.cached_property
  def _stacks(self):
    """The gradients scans make stacked (whatever specs the plan gives)."""
    return find_grad_stacks(self.compute.jaxpr, len(self.grad_nodes))

  def memory_terms(self):
    """(state bytes, [activation bytes at each liveness peak]) as expressions."""
    return self._memory_exprs(*self._memory_items())

  def _memory_exprs(self, state, peaks):
    def terms(item):
      if isinstance(item, Copy):
        return self._copy_terms(item)
      node, pos, aval, f = item
      return [(x, f * b) for b, x in zip(self._bytes_per_choice(node, pos, aval),
                                         self.nodes[node].vars)]
    def expr(items):
      return lp.linear(t for item in items for t in terms(item))
    return expr(state), [expr(p) for p in peaks]

  def _memory(self):
    if self.memory_budget is None:
      return
    self._chains()
    state, acts = self.memory_terms()
    for t, act in enumerate(acts or [0]):
      self.prob += state + act <= self.memory_budget, f"memory_{t}"
      self.num_constraints += 1

  def memory_at_solution(self) -> tuple[float, float]:
    """(state and gradient bytes, activation bytes at the peak) per device,
    the peak found under the chosen specs."""
    state, _ = self._memory_items()
    state = state[:len(state) - getattr(self, "_num_held", 0)]   # (not the held values)
    return float(self._total(state)), float(self._total(self._peak_at_solution()))

  def _total(self, items) -> float:
    return sum(self._copy_at_solution(item) if isinstance(item, Copy) else
               item[3] * self._bytes(*item[:3], self._chosen(item[0]))
               for item in items)

  def bytes_at_solution(self, v) -> float:
    """Bytes per device of the pass's value ``v`` in the spec the solution
    gives it (a leaf's in its own; the whole array where the graph has no
    node for it)."""
    ref = self._values.get(v)
    if ref is None:
      return _whole(v.aval)
    node, pos = ref
    return self._bytes(node, pos, v.aval, self._chosen(node))

  def _memory_at_solution(self) -> float:
    return sum(self.memory_at_solution())
