"""The sharding ILP's memory model (``ilp.py``): what a plan holds per
device, as terms of the choice variables for the budget's constraints and
as bytes at a solution.

* the state: every leaf in its chosen spec, and the gradients held
  besides one micro-batch's pass (``_gradient_items``);
* the pass: the values live at its peaks (``autopar.costs.liveness``), each in
  its chosen spec; the constraints take the three peaks of replicated
  bytes, and a solution's own peak is found again under its specs
  (``_peak_at_solution``), which ``ShardingProblem.solve`` adds where it is
  over the budget.

A memory item is ``(node, output, aval, factor)``: ``factor`` times that
output's bytes per device under the node's choice.
"""

from __future__ import annotations

import functools

from autopar.planner import lp
from jax.extend.core import Var

from autopar.costs.cost_model import itemsize
from autopar.frontend.gradstack import find_grad_stacks, folded_values
from autopar.costs.liveness import Liveness, liveness
from autopar.method import accumulation_dtype
from autopar.costs.strategies import local_bytes

__all__ = ["MemoryModel"]


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
    [[(node, pos, aval, 1)] at each liveness peak])."""
    if getattr(self, "_mem_items", None) is None:
      state = [(self.leaf_nodes[k], 0, aval, 1) for k, aval in enumerate(self.leaf_avals)]
      state += self._gradient_items()
      peaks = [self._items(live) for live in self._liveness.peaks(3)]
      self._mem_items = (state, peaks)
    return self._mem_items

  @functools.cached_property
  def _liveness(self) -> Liveness:
    """Where the pass holds its values (``liveness.liveness``)."""
    cj = self.compute.jaxpr
    folded = folded_values(cj, self._stacks) \
        if self.n > 1 or self._batch_size_devices > 1 else []
    return liveness(cj, folded=folded, platform=self.platform)

  @functools.cached_property
  def _own_liveness(self) -> Liveness:
    """:attr:`_liveness` with each value as its memory item (``(node,
    output, aval, 1)``), those the graph does not have left out (a plan
    holds them in no spec: 0 bytes at its own peak): what finds a
    solution's own peak, and what a problem read back from a plan's JSON
    keeps of the pass (``ilp_saved.py``)."""
    val = self._values
    return self._liveness.mapped(lambda v: (*val[v], v.aval, 1) if v in val else None)

  def _items(self, live) -> list:
    """Memory items of the values in ``live`` that the graph has."""
    val = self._values
    return [(*val[v], v.aval, 1) for v in live if v in val]

  @functools.cached_property
  def _values(self) -> dict:
    """The pass's values (its bodies' too) -> (node, output)."""
    return {**self.body_val["compute"], **self.compute_val}

  def _peak_at_solution(self) -> list:
    """Memory items at the pass's peak under the chosen specs: where the
    plan splits the values largest replicated, the peak moves to where
    the ones it keeps whole are held. Found once per solve (the solver
    clears ``_own_peak``)."""
    if getattr(self, "_own_peak", None) is None:
      self._own_peak = self._find_own_peak()
    return self._own_peak

  def _find_own_peak(self) -> list:
    def local(item):
      node, pos, aval, _ = item
      return self._bytes(node, pos, aval, self._chosen(node))
    live = self._own_liveness.peaks(1, local)
    return live[0] if live else []

  def _gradient_items(self):
    """The gradients held besides one micro-batch's pass (whose own
    gradients are at its liveness peaks), as memory items:

    * split over batch axes and run in several micro-batches: the
      un-reduced partial sums, in the spec the pass makes them and the
      accumulation dtype (float32 for bfloat16); the reduced gradients take
      their buffer where the dtype is the same (where they are scattered
      over the batch axes, ZeRO, their 1/d share is left out);
    * one micro-batch over batch axes: the reduced gradients, beside the
      pass's;
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
    def expr(items):
      return lp.linear((x, f * b) for node, pos, aval, f in items
                       for b, x in zip(self._bytes_per_choice(node, pos, aval),
                                       self.nodes[node].vars))
    return expr(state), [expr(p) for p in peaks]

  def _memory(self):
    if self.memory_budget is None:
      return
    state, acts = self.memory_terms()
    for t, act in enumerate(acts or [0]):
      self.prob += state + act <= self.memory_budget, f"memory_{t}"
      self.num_constraints += 1

  def memory_at_solution(self) -> tuple[float, float]:
    """(state and gradient bytes, activation bytes at the peak) per device,
    the peak found under the chosen specs."""
    state, _ = self._memory_items()
    return float(self._total(state)), float(self._total(self._peak_at_solution()))

  def _total(self, items) -> float:
    return sum(f * self._bytes(node, pos, aval, self._chosen(node))
               for node, pos, aval, f in items)

  def _memory_at_solution(self) -> float:
    return sum(self.memory_at_solution())
