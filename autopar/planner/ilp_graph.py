"""The graph the sharding ILP chooses over (``ilp.py``): its nodes, each
with its choices and their costs, and the edges along which values move.

* a *leaf node* per argument leaf of the step, shared by ``compute_grad``
  and ``apply_grad``; its choices are the leaf's specs over the planned
  axes, and for a state leaf also the dimension split over the batch axes
  (ZeRO/FSDP);
* a *gradient node* per gradient (its all-reduce over the batch axes);
* an *equation node* per equation with a choice (its sharding strategies,
  ``autopar.costs.strategies``). An element-wise equation whose operands all have
  its output's shape follows its first operand instead (no node of its own);
  its other operands get an edge to that node;
* control flow (``scan``, ``while``, ``cond``, ``jax.checkpoint``) is planned
  through: a *value node* per loop carry, scanned input or output and branch
  result, and the body's equations as nodes, costed times the trips.

Edges are recorded as pending (producer node and output, consumer node and
operand) and as follow edges (a value resharded to another node's spec); the
ILP turns both into flow variables and reshard costs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Var

from autopar import jax_compat as jc
from autopar.costs.cost_model import MeshCost
from autopar.errors import PlanError
from autopar.costs.liveness import conv_relayouts, fusions, relayouts
from autopar.costs.strategies import (REGIONS, RuleContext, Spec, enumerate_specs,
                                grad_sync_costs, local_bytes, strategies_for,
                                without_unit_axes)
from autopar.costs.strategies.elementwise import is_elementwise

__all__ = ["ChoiceGraph", "REGIONS"]


@dataclasses.dataclass
class _Node:
  name: str
  choices: list                      # specs, (spec, dim) pairs, or strategies
  mult: float
  specs: list[tuple[Spec, ...]]      # per choice: spec of each output value
  costs: list[float]
  mem: list[float] | None = None     # per choice: bytes per device (leaves)
  key: Any = None                    # equal keys: identical choices and costs
  flops: list[float] | None = None   # per choice: seconds of compute (equations)
  part: str | None = None            # "compute" / "apply" (equations), None (leaves)
  vars: list = dataclasses.field(default_factory=list)


def on_axes(specs, axes) -> tuple:
  """``specs`` (a spec per output) with only the mesh ``axes`` left."""
  return tuple(None if sp is None else tuple(tuple(a for a in dim if a in axes)
                                            for dim in sp) for sp in specs)


class ChoiceGraph:
  """The nodes and edges of one sharding problem (see the module
  docstring); :class:`autopar.planner.ilp.ShardingProblem` adds the variables,
  constraints and objective.

  Args:
    compute, apply: the split step's jaxprs (consts lifted to leading inputs).
    num_consts: how many leading inputs are consts.
    leaf_avals: avals of the argument leaves, in order (batch leaves at the
      per-device micro-batch size).
    batch_leaves: which leaves are batch data.
    num_micro_batches: n (compute_grad's equations cost n times).
    batch_axes: S. planned_axes: A. sizes: every mesh axis's size.
    cost, seconds_per_flop, flop_rates: the strategies' costs
      (``RuleContext``).
    read_by_compute: leaves compute_grad reads: leaf index -> how many
      all-gathers of it the pass makes where it is split over the batch
      axes (``split.leaf_gather_sites``: one per reader), or a set of
      indices (one each).
    platform: whose fusion rules count the memory traffic ("cpu", "gpu",
      "tpu"; ``devices.platform_of``).
    pins: leaf index -> the spec it must take.
    leaf_names: leaves' pytree paths, for errors.
    keep: see :class:`autopar.planner.ilp.ShardingProblem`.
    zero3: whether leaves ``compute_grad`` reads may be split over the batch
      axes too (ZeRO-3), gathered for each reader (``read_by_compute``'s
      counts); else only the update-only state may be (ZeRO-2).
  """

  def __init__(self, *, compute, apply, num_consts: int, leaf_avals: Sequence,
               batch_leaves: Sequence[bool], num_micro_batches: int,
               batch_axes: Sequence[str], planned_axes: Sequence[str],
               sizes: Mapping[str, int], cost: MeshCost, seconds_per_flop: float,
               flop_rates: Mapping[str, float] | None = None, read_by_compute=(),
               platform: str = "cpu",
               pins: Mapping[int, Spec] | None = None, leaf_names: Sequence[str] = (),
               keep: tuple[Sequence[str], Mapping[str, tuple]] | None = None,
               zero3: bool = True):
    self.compute = compute
    self.apply = apply
    self.num_consts = num_consts
    self.leaf_avals = list(leaf_avals)
    self.batch_leaves = list(batch_leaves)
    self.n = num_micro_batches
    self.S = tuple(batch_axes)
    self.A = tuple(planned_axes)
    self.sizes = dict(sizes)
    self.cost = cost
    self.ctx = RuleContext(self.A, self.sizes, cost, seconds_per_flop, dict(flop_rates or {}))
    self.read_by_compute = set(read_by_compute)
    self.gathers_of = dict(read_by_compute) if isinstance(read_by_compute, Mapping) \
        else {k: 1 for k in read_by_compute}
    self.platform = platform
    self.pins = dict(pins or {})
    self.leaf_names = list(leaf_names)
    self.keep = keep
    self.zero3 = zero3
    self.nodes: list[_Node] = []
    self._pending_edges: list = []   # (src, dst node, operand position, aval, mult, part)
    self._follow_edges: list = []    # (src, dst, aval, mult, part)
    # (id of an equation, operand position) -> the edge along which that
    # operand reaches its reader: (src, dst node, position, aval, part), the
    # position as ``_edge_list`` gives it (-1 - output position of the node
    # an element-wise operand follows). For the copies a reshard makes
    # (``ilp_memory``).
    self.operand_edges: dict[tuple[int, int], tuple] = {}
    self._followers: dict[str, dict[int, tuple[int, int]]] = {"compute": {},
                                                               "apply": {}}
    # Path of a scan / while / cond -> (node, position) of the value node of
    # each of its outputs, and of what enters a loop: "in<k>" the carry
    # operand k, "x<k>" each trip's slice of scanned operand k. The lowering
    # pins them to what the plan chose, so that XLA reshards them where the
    # plan does, not inside the body wherever its propagation puts it.
    self._region_outs: dict[str, dict[str, list[tuple[int, int]]]] = {
        "compute": {}, "apply": {}}
    self._region_ins: dict[str, dict[str, dict[str, tuple[int, int]]]] = {
        "compute": {}, "apply": {}}
    # The values of control-flow bodies -> (node, position), for the memory
    # their bodies hold while they run.
    self.body_val: dict[str, dict[Var, tuple[int, int]]] = {"compute": {}, "apply": {}}
    self._strategy_cache: dict = {}
    self._kept_choices: dict = {}    # (see _add_node)
    # (part, multiplicity, (node, position), aval, kind): memory traffic and
    # merged element-wise work, charged at the node's choice: "bytes" (a
    # value at the spec of output ``position``), "read" (an operand at the
    # spec the node's strategy needs at ``position``), "flops" (a flop per
    # element of the value, at the output's spec).
    self.work: list = []
  # -- nodes ---------------------------------------------------------------------

  def _add_node(self, name, choices, specs, costs, mult, mem=None, key=None,
                flops=None, part=None) -> int:
    if self.keep is not None and name in self.keep[1]:
      axes, kept = self.keep[0], self.keep[1][name]
      # Nodes of one kind keeping the same choices share the lists, as
      # unfiltered ones do (the layers' nodes: filtered once; memory, and a
      # saved problem's size). Each choice has one spec on ``axes``, so
      # equal ``kept``, equal choices kept. None: all of them, or none, kept.
      memo = (id(choices), id(specs), id(costs), id(mem), id(flops), kept)
      if memo not in self._kept_choices:
        idx = [c for c, sp in enumerate(specs) if on_axes(sp, axes) == kept]
        self._kept_choices[memo] = None if not idx or len(idx) == len(choices) else (
            *([l[c] for c in idx] for l in (choices, specs, costs)),
            None if mem is None else [mem[c] for c in idx],
            None if flops is None else [flops[c] for c in idx],
            (choices, specs, costs, mem, flops))     # (kept: the ids stay theirs)
      hit = self._kept_choices[memo]
      if hit is not None:
        choices, specs, costs, mem, flops, _ = hit
        key = None if key is None else (key, kept)
    node = _Node(name, choices, mult, specs, costs, mem, key, flops, part)
    self.nodes.append(node)
    return len(self.nodes) - 1

  def _build_graph(self):
    nconst = self.num_consts
    A, sizes = self.A, self.sizes
    # Leaf nodes, shared by both jaxprs.
    self.leaf_nodes = []
    by_key = {}      # leaves of one shape and role (the layers') share their choices
    for k, aval in enumerate(self.leaf_avals):
      key = ("leaf", tuple(aval.shape), aval.dtype, self.batch_leaves[k],
             self.gathers_of.get(k, 0), self.pins.get(k))
      if key not in by_key:
        by_key[key] = self._leaf_choices(k, aval)
      choices, specs, costs, mem = by_key[key]
      self.leaf_nodes.append(self._add_node(f"leaf{k}", choices, specs, costs, 1, mem,
                                            key))

    # value -> (node, output position)
    self.compute_val: dict[Var, tuple[int, int]] = {}
    cj = self.compute.jaxpr
    for k, v in enumerate(cj.invars[nconst:]):
      self.compute_val[v] = (self.leaf_nodes[k], 0)
    self.compute_eqn_nodes = self._add_eqns(cj, self.compute_val, self.n, "compute")

    num_grads = len(self.apply.jaxpr.invars) - nconst - len(self.leaf_avals)
    self.grad_nodes = []
    for g in range(num_grads):
      v = cj.outvars[g]
      specs, costs = grad_sync_costs(v.aval, A, self.S, sizes, self.cost)
      self.grad_nodes.append(self._add_node(f"grad{g}", specs, [(s,) for s in specs],
                                            costs, 1,
                                            key=("grad", tuple(v.aval.shape),
                                                 v.aval.dtype)))

    self.apply_val: dict[Var, tuple[int, int]] = {}
    aj = self.apply.jaxpr
    for k, v in enumerate(aj.invars[nconst:nconst + len(self.leaf_avals)]):
      self.apply_val[v] = (self.leaf_nodes[k], 0)
    for g, v in enumerate(aj.invars[nconst + len(self.leaf_avals):]):
      self.apply_val[v] = (self.grad_nodes[g], 0)
    self.apply_eqn_nodes = self._add_eqns(aj, self.apply_val, 1, "apply")

    # What a solution is read at, by node: once the graph is built, solving
    # and reading needs no jaxpr (a problem read back from a plan's JSON
    # has none: ``ilp_saved.py``).
    self._grad_avals = [v.aval for v in cj.outvars[:num_grads]]
    # Each gradient's edge from the value the pass makes into its sync node.
    self._grad_edges = [(self.compute_val[v], self.grad_nodes[g], v.aval)
                        for g, v in enumerate(cj.outvars[:num_grads])
                        if isinstance(v, Var) and v in self.compute_val]
    self._apply_out_refs = [get_inner(self.apply_val, v) for v in aj.outvars]
    self._micro_out_refs = [get_inner(self.compute_val, v)
                            for v in cj.outvars[num_grads:]]

  def _leaf_choices(self, k, aval) -> tuple[list, list, list, list]:
    """(choices, specs, costs, bytes per device) of input leaf ``k``."""
    A, sizes = self.A, self.sizes
    fixed = (0,) if self.batch_leaves[k] and self.n > 1 and aval.shape else ()
    choices, specs, costs, mem = [], [], [], []
    for spec in enumerate_specs(aval.shape, A, sizes, fixed=fixed):
      for dim in self._batch_axes_dims(k, aval, spec):
        choices.append((spec, dim))
        specs.append((spec,))
        b = local_bytes(aval, spec, sizes)
        if dim is None:
          costs.append(0.0)
          mem.append(b)
          continue
        shard = b / self._batch_size_devices
        mem.append(shard)
        # ZeRO-3: the gradient computation all-gathers the leaf for each
        # reader each micro-batch; ZeRO-2 (optimizer state): the update is
        # gathered once.
        reps = self.n * self.gathers_of[k] if k in self.read_by_compute else 1
        costs.append(reps * self.cost.all_gather(shard, self.S))
    if k in self.pins:
      return self._pinned(k, aval, choices, specs, costs, mem)
    return choices, specs, costs, mem

  def _pinned(self, k, aval, choices, specs, costs, mem):
    """Leaf ``k``'s choices that give it its pinned spec (over all axes: the
    batch axes ahead of the planned ones where both split a dimension)."""
    pin = self.pins[k]
    pin = tuple(pin) + ((),) * (len(aval.shape) - len(pin))
    # Axes of size 1 split nothing, and the planned axes leave them out.
    want = without_unit_axes(pin, self.sizes)
    keep = []
    for c, (spec, dim) in enumerate(choices):
      batch_dim = 0 if self.batch_leaves[k] else dim
      full = tuple((tuple(self.S) if d == batch_dim and self.S else ()) + tuple(e)
                   for d, e in enumerate(spec))
      if without_unit_axes(full, self.sizes) == want:
        keep.append(c)
    if not keep:
      name = self.leaf_names[k] if k < len(self.leaf_names) else f"leaf {k}"
      raise PlanError(
          f"autopar: the pin of {name} to {pin} cannot be met with the batch split "
          f"over {self.S or 'no axes'}: the batch axes split "
          f"{'this batch leaf on dimension 0' if self.batch_leaves[k] else 'a state leaf on one dimension, ahead of the planned axes, or not at all'}. "
          f"Fix: pin it over the planned axes {self.A}, or put the batch axes "
          f"first in the pinned dimension.")
    return ([choices[c] for c in keep], [specs[c] for c in keep],
            [costs[c] for c in keep], [mem[c] for c in keep])

  @property
  def _batch_size_devices(self) -> int:
    return math.prod(self.sizes[a] for a in self.S)

  def _batch_axes_dims(self, k, aval, spec) -> list[int | None]:
    """None (replicated over the batch axes), and the dim a state leaf can
    also be split on over them (ZeRO/FSDP), if any."""
    d = self._batch_size_devices
    if d == 1 or self.batch_leaves[k] or not aval.shape or (
        not self.zero3 and k in self.read_by_compute):
      return [None]
    for dim, n in enumerate(aval.shape):
      if n % (d * math.prod(self.sizes[a] for a in spec[dim])) == 0:
        return [None, dim]
    return [None]

  def _add_eqns(self, jaxpr, val, mult, part, prefix="", eqn_nodes=None
                ) -> dict[str, int]:
    """Adds a node per equation (or merges it into its operand's).

    Equations are named by their index, and equations inside control flow by
    a path: ``"12.0.5"`` is equation 5 of sub-jaxpr 0 of equation 12.
    """
    eqn_nodes = {} if eqn_nodes is None else eqn_nodes
    for idx, eqn in enumerate(jaxpr.eqns):
      i = f"{prefix}{idx}"
      if eqn.primitive.name in REGIONS:
        self._add_region(eqn, i, val, mult, part, eqn_nodes)
        continue
      if eqn.primitive.name == "optimization_barrier":
        # An identity XLA does not look through: each output is its operand,
        # in its operand's spec (operands of any shapes; nothing to choose).
        for a, o in zip(eqn.invars, eqn.outvars, strict=True):
          if isinstance(a, Var) and a in val:
            val[o] = val[a]
        continue
      merge = is_elementwise(eqn) and len(eqn.outvars) == 1
      if merge:
        operands = [v for v in eqn.invars if isinstance(v, Var) and v.aval.shape]
        out = eqn.outvars[0]
      if (merge and operands
          and all(tuple(v.aval.shape) == tuple(out.aval.shape) for v in operands)
          and all(v in val for v in operands)):
        # Merged: the output follows its first operand's spec; every other
        # operand is resharded to that spec (an edge between the two nodes).
        lead = val[operands[0]]
        for v in operands[1:]:
          if val[v] != lead:
            self._follow_edges.append((val[v], lead, v.aval, mult, part))
        for pos, v in enumerate(eqn.invars):
          if isinstance(v, Var) and v.aval.shape and val[v] != lead:
            self.operand_edges[(id(eqn), pos)] = (val[v], lead[0], -1 - lead[1],
                                                  v.aval, part)
        val[out] = lead
        self._followers[part][i] = lead
        continue
      key = _eqn_key(eqn)
      cached = self._strategy_cache.get(key) if key is not None else None
      if cached is None:
        strategies = strategies_for(eqn, self.ctx)
        cached = (strategies, [s.out_specs for s in strategies],
                  [s.comm for s in strategies], [s.compute for s in strategies])
        if key is not None:
          self._strategy_cache[key] = cached
      choices, specs, comm, flops = cached
      node = self._add_node(f"{part}/{i}:{eqn.primitive.name}", choices, specs, comm,
                            mult, key=(part, key) if key is not None else ("eqn", part, i),
                            flops=flops, part=part)
      eqn_nodes[i] = node
      for pos, v in enumerate(eqn.invars):
        if isinstance(v, Var) and v in val:
          self._pending_edges.append((val[v], node, pos, v.aval, mult, part))
          self.operand_edges[(id(eqn), pos)] = (val[v], node, pos, v.aval, part)
      for j, v in enumerate(eqn.outvars):
        val[v] = (node, j)
    self._add_traffic(jaxpr, val, mult, part, prefix, eqn_nodes)
    return eqn_nodes

  def _add_traffic(self, jaxpr, val, mult, part, prefix, eqn_nodes):
    """Records the memory traffic of ``jaxpr``'s equations as XLA fuses
    them (``liveness.fusions``): an equation that runs (a fusion's root,
    or one XLA does not fuse) writes the results it holds and reads the
    held values it needs, through the element-wise producers it computes
    again inside; an element-wise equation computed inside its readers
    moves nothing of its own. Each such value is charged, at the spec the
    plan gives it, to the node that chooses that spec (``self.work``).
    Merged element-wise equations have no node: their flops (one per
    element) are charged to the node they follow. Loops and calls are
    their bodies' (recorded when the body is added)."""
    fus = fusions(jaxpr, self.platform)
    work = self.work
    copied = set()                    # XLA:CPU's relayout copies, one per order
    for idx, eqn in enumerate(jaxpr.eqns):
      if eqn.primitive.name in REGIONS:
        continue
      if self.platform == "cpu":
        self._add_relayouts(eqn, idx, val, mult, part, prefix, eqn_nodes, copied)
      if f"{prefix}{idx}" in self._followers[part]:
        out = eqn.outvars[0]
        work.append((part, mult, val[out], out.aval, "flops"))
      if not fus.runs(idx):
        continue
      for o in eqn.outvars:
        if o in val and fus.held(o):
          work.append((part, mult, val[o], o.aval, "bytes"))
      node = eqn_nodes.get(f"{prefix}{idx}")
      direct = {v: pos for pos, v in enumerate(eqn.invars)
                if isinstance(v, Var) and not fus.fused_into(v, idx)}
      for v in fus.reads(idx):
        self._charge_read(v, node, direct.get(v), val, mult, part)

  def _charge_read(self, v, node, pos, val, mult, part, times: int = 1):
    """Records ``times`` reads of value ``v``: as the reader's strategy
    needs operand ``pos`` (a gathered operand is read whole), charged to the
    reader's choice, where every choice of node ``node`` says; else at the
    spec the plan gives ``v``."""
    if node is not None and pos is not None and all(
        st.in_specs[pos] is not None for st in self.nodes[node].choices):
      self.work.extend([(part, mult, (node, pos), v.aval, "read")] * times)
    elif v in val:
      self.work.extend([(part, mult, val[v], v.aval, "bytes")] * times)

  def _add_relayouts(self, eqn, idx, val, mult, part, prefix, eqn_nodes, copied):
    """XLA:CPU's copies of a convolution's or dot's operands into the order
    its kernels take (``liveness.relayouts``), one per value and order, and
    of a convolution's result written in another order: each reads and
    writes the value once more."""
    node = eqn_nodes.get(f"{prefix}{idx}")
    for v, order in relayouts(eqn):
      if (v, order) in copied:
        continue
      copied.add((v, order))
      pos = next(p for p, a in enumerate(eqn.invars) if a is v)
      self._charge_read(v, node, pos, val, mult, part, times=2)
    if eqn.primitive.name == "conv_general_dilated":
      out = eqn.outvars[0]
      if out in val and any(c is out for c in conv_relayouts(eqn)):
        self.work.extend([(part, mult, val[out], out.aval, "bytes")] * 2)

  # -- control flow: planned through --------------------------------------------

  def _value_node(self, name, aval, mult, stack=None):
    """A node choosing one spec for a loop-carried / branch-joined value.

    ``stack``: also give the spec with a leading unsplit (stacked) dimension,
    at output position 1 ("xs in" / "ys out" of a scan) - or 0 and 1 swapped.
    """
    specs = enumerate_specs(aval.shape, self.A, self.sizes)
    if stack == "out":            # (per-iteration spec, stacked spec)
      rows = [(s, ((),) + s) for s in specs]
    elif stack == "in":           # (stacked spec, per-iteration spec)
      rows = [(((),) + s, s) for s in specs]
    else:
      rows = [(s,) for s in specs]
    key = ("value", name, tuple(aval.shape), aval.dtype, stack)
    return self._add_node(name, specs, rows, [0.0] * len(specs), mult, key=key)

  def _follow(self, src, dst, aval, mult, part):
    """Edge: the value at ``src`` is resharded to the spec of ``dst``."""
    if src is not None and src != dst:
      self._follow_edges.append((src, dst, aval, mult, part))

  def _add_region(self, eqn, i, val, mult, part, eqn_nodes):
    """Plans through scan / while / cond / checkpoint (see REGIONS)."""
    name = eqn.primitive.name
    get = lambda a: val.get(a) if isinstance(a, Var) else None
    ins = [get(a) for a in eqn.invars]
    if name == "scan":
      body, (nc, ncar) = eqn.params["jaxpr"], jc.scan_counts(eqn.params)
      length = eqn.params["length"]
      bj = body.jaxpr
      inner = dict(zip(bj.invars[:nc], ins[:nc]))
      carry = []
      for k, v in enumerate(bj.invars[nc:nc + ncar]):
        node = self._value_node(f"{part}/{i}:carry{k}", v.aval, mult)
        carry.append(node)
        inner[v] = (node, 0)
        self._follow(ins[nc + k], (node, 0), v.aval, mult, part)
      for k, v in enumerate(bj.invars[nc + ncar:]):
        node = self._value_node(f"{part}/{i}:xs{k}", v.aval, mult, stack="in")
        inner[v] = (node, 1)
        self._follow(ins[nc + ncar + k], (node, 0), eqn.invars[nc + ncar + k].aval,
                     mult, part)
      self._region_ins[part][i] = {
          **{f"in{nc + k}": (node, 0) for k, node in enumerate(carry)},
          **{f"x{k}": inner[v] for k, v in enumerate(bj.invars[nc + ncar:], start=nc + ncar)}}
      inner = {k: v for k, v in inner.items() if v is not None}
      self._add_eqns(bj, inner, mult * length, part, f"{i}.0.", eqn_nodes)
      self.body_val[part].update(inner)
      for k, (v, node) in enumerate(zip(bj.outvars[:ncar], carry)):
        self._follow(get_inner(inner, v), (node, 0), v.aval, mult * length, part)
        val[eqn.outvars[k]] = (node, 0)
      for k, v in enumerate(bj.outvars[ncar:]):
        node = self._value_node(f"{part}/{i}:ys{k}", v.aval, mult, stack="out")
        self._follow(get_inner(inner, v), (node, 0), v.aval, mult * length, part)
        val[eqn.outvars[ncar + k]] = (node, 1)
        # Each trip's result is copied into the stacked output (XLA's
        # dynamic-update-slice: the slice read and written).
        self.work.extend([(part, mult * length, (node, 0), v.aval, "bytes")] * 2)
      for v in bj.invars[nc + ncar:]:
        # Each trip's slice is copied out of the stacked input (a
        # dynamic-slice: read and written) before the body reads it.
        if v in inner:
          self.work.extend([(part, mult * length, inner[v], v.aval, "bytes")] * 2)
      self._region_outs[part][i] = [val[v] for v in eqn.outvars]
    elif name == "while":
      cn, bn = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
      bj = eqn.params["body_jaxpr"].jaxpr
      inner = dict(zip(bj.invars[:bn], ins[cn:cn + bn]))
      carry = []
      for k, v in enumerate(bj.invars[bn:]):
        node = self._value_node(f"{part}/{i}:carry{k}", v.aval, mult)
        carry.append(node)
        inner[v] = (node, 0)
        self._follow(ins[cn + bn + k], (node, 0), v.aval, mult, part)
      self._region_ins[part][i] = {f"in{cn + bn + k}": (node, 0)
                                   for k, node in enumerate(carry)}
      inner = {k: v for k, v in inner.items() if v is not None}
      # The trip count is unknown: the body is costed once.
      self._add_eqns(bj, inner, mult, part, f"{i}.1.", eqn_nodes)
      self.body_val[part].update(inner)
      for k, (v, node) in enumerate(zip(bj.outvars, carry)):
        self._follow(get_inner(inner, v), (node, 0), v.aval, mult, part)
        val[eqn.outvars[k]] = (node, 0)
      self._region_outs[part][i] = [val[v] for v in eqn.outvars]
    elif name == "cond":
      branches = eqn.params["branches"]
      outs = [self._value_node(f"{part}/{i}:out{k}", v.aval, mult)
              for k, v in enumerate(eqn.outvars)]
      for b, branch in enumerate(branches):
        bj = branch.jaxpr
        inner = {v: n for v, n in zip(bj.invars, ins[1:]) if n is not None}
        # One branch runs: each is costed at its share.
        self._add_eqns(bj, inner, mult / len(branches), part, f"{i}.{b}.", eqn_nodes)
        self.body_val[part].update(inner)
        for v, node in zip(bj.outvars, outs):
          self._follow(get_inner(inner, v), (node, 0), v.aval, mult, part)
      for v, node in zip(eqn.outvars, outs):
        val[v] = (node, 0)
      self._region_outs[part][i] = [(node, 0) for node in outs]
    else:                                     # checkpoint (remat): a call
      bj = eqn.params["jaxpr"]
      inner = {v: n for v, n in zip(bj.invars, ins) if n is not None}
      self._add_eqns(bj, inner, mult, part, f"{i}.0.", eqn_nodes)
      self.body_val[part].update(inner)
      for v, out in zip(bj.outvars, eqn.outvars):
        src = get_inner(inner, v)
        if src is not None:
          val[out] = src


def get_inner(val, v):
  """(node, output) of the value ``v`` in ``val``; None for a literal or
  a value the graph does not have."""
  return val.get(v) if isinstance(v, Var) else None


def _hashable(value):
  if isinstance(value, (Jaxpr, ClosedJaxpr)):
    return str(value)          # by content: scatter's update_jaxpr, loop bodies
  try:
    hash(value)
    return value
  except TypeError:
    if isinstance(value, (tuple, list)):
      return tuple(_hashable(v) for v in value)
    return repr(value)


def _eqn_key(eqn):
  """Equations with equal keys get the same strategies."""
  # A literal by its bytes (numpy's repr is slow); shapes are tuples already.
  ins = tuple(("lit", np.asarray(a.val).tobytes(), a.aval.shape, a.aval.dtype)
              if isinstance(a, Literal) else (a.aval.shape, a.aval.dtype)
              for a in eqn.invars)
  outs = tuple((v.aval.shape, v.aval.dtype) for v in eqn.outvars)
  params = tuple(sorted((k, _hashable(v)) for k, v in eqn.params.items()))
  return (eqn.primitive.name, params, ins, outs)
