"""A built sharding ILP (``ilp.py``) as plain data, and back: what a plan
keeps of the problems it was solved with (``solved.py``), so that
``plan.explain`` and ``plan.cost_if`` solve them again in a process that
read the plan from JSON, with no step and no jaxpr.

Once the graph is built (``ilp_graph.py``), solving the problem and reading
a solution need only its nodes, edges and what the solution is read at; the
jaxprs are read no more. So the data is the graph, not the program:

* nodes: each node's name, multiplicity, part and class (the classes share
  variables, ``ShardingProblem._classes``), and its choices with their
  output specs, costs, bytes and flops; nodes of one kind (the same
  equation in every layer) share one entry;
* edges: the pending edges (an operand a strategy needs in a spec), the
  follow edges (a value resharded to another node's spec) and the
  gradients' edges into their sync nodes;
* the roofline terms per stage (``ShardingProblem._rooflines``: each
  choice's flops and memory traffic, summed over the program's equations),
  by variable, with the terms the objective takes at the solution;
* the memory items: the state's, those at the three liveness peaks, the
  plan's own peaks held to the budget, and where the pass holds its
  values (``liveness.Liveness``, each value as its item) for a solution's
  own peak;
* what a solution is read at: the leaf, gradient and equation nodes, the
  followers, what enters and leaves each loop, the outputs.

Restored, the problem is built as planning built it (the same variables in
the same order, the same constraints and objective), so a pinned solve
gives what it gives on the planner's problem. Shapes and specs are written
once, in tables (:class:`Writer`); a list that several problems have alike
(leaf paths, a template's head) too.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Mapping

from autopar.costs.cost_model import MeshCost, dtype_name
from autopar.costs.liveness import Liveness
from autopar.costs.strategies import Strategy
from autopar.planner.ilp_memory import Copy

__all__ = ["Aval", "Writer", "Reader", "SavedGraph"]

_PARTS = ("compute", "apply")


@dataclasses.dataclass(frozen=True)
class Aval:
  """A value's shape and dtype name: the aval of a problem read back."""
  shape: tuple[int, ...]
  dtype: str


class Writer:
  """The tables a plan's saved problems share: every distinct aval and
  spec once (by number), and lists that recur (:meth:`shared`)."""

  def __init__(self):
    self._avals: dict = {}
    self._aval_ids: dict = {}
    self._specs: dict = {}
    self._spec_ids: dict = {}
    self._shared: dict = {}

  def aval(self, aval) -> int:
    """An aval's number (anything with ``shape`` and ``dtype``)."""
    hit = self._aval_ids.get(id(aval))      # (by the object first, as specs)
    if hit is not None:
      return hit[0]
    key = (tuple(map(int, aval.shape)), dtype_name(aval.dtype))
    i = self._avals.get(key)
    if i is None:
      i = self._avals[key] = len(self._avals)
    self._aval_ids[id(aval)] = (i, aval)
    return i

  def spec(self, spec) -> int:
    """A spec's number (a spec: a tuple of axis-name tuples); -1 for None."""
    if spec is None:
      return -1
    # By the object first: a problem shares a few spec objects among its
    # many choices, and hashing a nested tuple each time is slow.
    hit = self._spec_ids.get(id(spec))
    if hit is not None:
      return hit[0]
    i = self._specs.get(spec)
    if i is None:
      i = self._specs[spec] = len(self._specs)
    self._spec_ids[id(spec)] = (i, spec)     # (the spec kept: its id stays its)
    return i

  def shared(self, value) -> int:
    """``value`` (JSON data) by number, written once however often given."""
    key = json.dumps(value, separators=(",", ":"))
    i = self._shared.get(key)
    if i is None:
      i = self._shared[key] = len(self._shared)
    return i

  def tables(self) -> dict:
    return {"avals": [[list(shape), dtype] for shape, dtype in self._avals],
            "specs": [[list(e) for e in spec] for spec in self._specs],
            "shared": [json.loads(text) for text in self._shared]}


class Reader:
  """The tables of :class:`Writer`, read back."""

  def __init__(self, tables: Mapping):
    self._avals = [Aval(tuple(shape), dtype) for shape, dtype in tables["avals"]]
    self._specs = [tuple(tuple(e) for e in spec) for spec in tables["specs"]]
    self._shared = tables["shared"]

  def aval(self, i: int) -> Aval:
    return self._avals[i]

  def spec(self, i: int):
    return None if i < 0 else self._specs[i]

  def shared(self, i: int) -> Any:
    return self._shared[i]


class SavedGraph:
  """The data of a built ``ShardingProblem`` (see the module docstring),
  which it is mixed into: :meth:`to_data` and :meth:`from_data`."""

  def to_data(self, w: Writer) -> dict:
    """The problem as JSON data (after ``build``); its own peak's liveness
    and its memory items are found here if no solution needed them yet."""
    leaves = set(self.leaf_nodes)
    kinds: list = []
    kind_of: dict = {}
    node_kinds = []
    for idx, node in enumerate(self.nodes):
      key = (id(node.choices), id(node.specs), id(node.costs), id(node.mem),
             id(node.flops), idx in leaves)
      k = kind_of.get(key)
      if k is None:
        k = kind_of[key] = len(kinds)
        kinds.append(_kind_data(node, idx in leaves, w))
      node_kinds.append(k)
    var_index = {id(x): i for i, x in enumerate(self._vars)}

    def terms(by_part):
      return {part: [[var_index[id(x)], a] for x, a in t.items()]
              for part, t in by_part.items()}

    def item(it):
      node, pos, aval, factor = it
      return [node, pos, w.aval(aval), factor]
    state, peaks = self._memory_items()
    ref = lambda r: None if r is None else list(r)
    return {
        "S": list(self.S), "A": list(self.A), "sizes": [[a, s] for a, s in self.sizes.items()],
        "n": self.n, "alpha": dict(self.cost.alpha), "beta": dict(self.cost.beta),
        "seconds_per_flop": self.ctx.seconds_per_flop,
        "flop_rates": dict(self.ctx.flop_rates), "seconds_per_byte": self.seconds_per_byte,
        "platform": self.platform, "allow_all_gather": self.allow_all_gather,
        "allow_all_to_all": self.allow_all_to_all, "memory_budget": self.memory_budget,
        "accumulate": self.accumulate, "grad_sync": self.grad_sync,
        "share_layers": self.share_layers,
        "keep": None if self.keep is None else list(self.keep[0]),
        "pins": [[k, [list(e) for e in spec]] for k, spec in self.pins.items()],
        "leaf_names": w.shared(list(self.leaf_names)),
        "leaf_avals": [w.aval(a) for a in self.leaf_avals],
        "batch_leaves": [bool(b) for b in self.batch_leaves],
        "gathers_of": [[k, g] for k, g in self.gathers_of.items()],
        "donation": [[o, k] for o, k in self.donation.items()],
        "sync_latency": self.sync_latency,
        "num_held": getattr(self, "_num_held", 0),
        "kinds": kinds,
        "nodes": {"names": [n.name for n in self.nodes], "kinds": node_kinds,
                  "mults": [n.mult for n in self.nodes],
                  "parts": [n.part for n in self.nodes], "classes": self.node_class},
        "leaf_nodes": self.leaf_nodes, "grad_nodes": self.grad_nodes,
        "eqn_nodes": {"compute": list(self.compute_eqn_nodes.items()),
                      "apply": list(self.apply_eqn_nodes.items())},
        "pending_edges": [[s, sp, d, pos, w.aval(a), m, _PARTS.index(part)]
                          for (s, sp), d, pos, a, m, part in self._pending_edges],
        "follow_edges": [[s, sp, d, dp, w.aval(a), m, _PARTS.index(part)]
                         for (s, sp), (d, dp), a, m, part in self._follow_edges],
        "grad_edges": [[s, sp, g, w.aval(a)] for (s, sp), g, a in self._grad_edges],
        "grad_avals": [w.aval(a) for a in self._grad_avals],
        "followers": {p: [[i, n, pos] for i, (n, pos) in f.items()]
                      for p, f in self._followers.items()},
        "region_outs": {p: [[i, [list(r) for r in refs]] for i, refs in f.items()]
                        for p, f in self._region_outs.items()},
        "region_ins": {p: [[i, [[key, n, pos] for key, (n, pos) in ins.items()]]
                           for i, ins in f.items()] for p, f in self._region_ins.items()},
        "apply_out_refs": [ref(r) for r in self._apply_out_refs],
        "micro_out_refs": [ref(r) for r in self._micro_out_refs],
        "flop_terms": terms(self._flop_terms), "memory_terms": terms(self._memory_terms),
        "regime": dict(self._regime),
        "regimes_settled": bool(getattr(self, "regimes_settled", True)),
        "state": [item(it) for it in state],
        "peaks": [[item(it) for it in peak] for peak in peaks],
        "added_peaks": [[item(it) for it in peak] for peak in self._added_peaks],
        "liveness": _liveness_data(self._own_liveness, w),
    }

  @classmethod
  def from_data(cls, d: Mapping, r: Reader):
    """The problem :meth:`to_data` wrote, built (its variables, constraints
    and objective as planning made them) and ready for ``solve_pinned``."""
    t0 = time.perf_counter()
    sizes = {a: s for a, s in d["sizes"]}
    problem = cls(
        compute=None, apply=None, num_consts=0,
        leaf_avals=[r.aval(a) for a in d["leaf_avals"]],
        batch_leaves=d["batch_leaves"], donation={o: k for o, k in d["donation"]},
        read_by_compute={k: g for k, g in d["gathers_of"]},
        num_micro_batches=d["n"], batch_axes=d["S"], planned_axes=d["A"], sizes=sizes,
        cost=MeshCost(sizes, d["alpha"], d["beta"]),
        seconds_per_flop=d["seconds_per_flop"], seconds_per_byte=d["seconds_per_byte"],
        flop_rates=d["flop_rates"], platform=d["platform"],
        allow_all_gather=d["allow_all_gather"], allow_all_to_all=d["allow_all_to_all"],
        memory_budget=d["memory_budget"], share_layers=d["share_layers"],
        pins={k: tuple(tuple(e) for e in spec) for k, spec in d["pins"]},
        leaf_names=r.shared(d["leaf_names"]), accumulate=d["accumulate"],
        grad_sync=d.get("grad_sync", "last"),
        keep=None if d["keep"] is None else (tuple(d["keep"]), {}))
    problem._restore_graph(d, r)
    problem._restore_problem(d, r)
    problem.timings["build"] = time.perf_counter() - t0
    return problem

  def _restore_graph(self, d: Mapping, r: Reader) -> None:
    kinds = [_kind_from_data(k, r) for k in d["kinds"]]
    nodes = d["nodes"]
    for name, k, mult, part in zip(nodes["names"], nodes["kinds"], nodes["mults"],
                                   nodes["parts"], strict=True):
      choices, specs, costs, mem, flops = kinds[k]
      self._add_node(name, choices, specs, costs, mult, mem, None, flops, part)
    self.leaf_nodes = list(d["leaf_nodes"])
    self.grad_nodes = list(d["grad_nodes"])
    self.compute_eqn_nodes = {i: n for i, n in d["eqn_nodes"]["compute"]}
    self.apply_eqn_nodes = {i: n for i, n in d["eqn_nodes"]["apply"]}
    self._pending_edges = [((s, sp), dst, pos, r.aval(a), m, _PARTS[p])
                           for s, sp, dst, pos, a, m, p in d["pending_edges"]]
    self._follow_edges = [((s, sp), (dst, dp), r.aval(a), m, _PARTS[p])
                          for s, sp, dst, dp, a, m, p in d["follow_edges"]]
    self._grad_edges = [((s, sp), g, r.aval(a)) for s, sp, g, a in d["grad_edges"]]
    self._grad_avals = [r.aval(a) for a in d["grad_avals"]]
    self._followers = {p: {i: (n, pos) for i, n, pos in f}
                       for p, f in d["followers"].items()}
    self._region_outs = {p: {i: [tuple(x) for x in refs] for i, refs in f}
                         for p, f in d["region_outs"].items()}
    self._region_ins = {p: {i: {key: (n, pos) for key, n, pos in ins} for i, ins in f}
                        for p, f in d["region_ins"].items()}
    self._apply_out_refs = [None if x is None else tuple(x) for x in d["apply_out_refs"]]
    self._micro_out_refs = [None if x is None else tuple(x) for x in d["micro_out_refs"]]

  def _restore_problem(self, d: Mapping, r: Reader) -> None:
    """Variables, constraints and objective, in planning's order."""
    self._grad_node_set = set(self.grad_nodes)
    self.sync_latency = d["sync_latency"]
    self._variables(d["nodes"]["classes"])
    self._one_hot()
    self._edges()
    xs = self._vars
    self._flop_terms = {p: {xs[i]: a for i, a in t} for p, t in d["flop_terms"].items()}
    self._memory_terms = {p: {xs[i]: a for i, a in t}
                          for p, t in d["memory_terms"].items()}
    self._regime = dict(d["regime"])
    self.regimes_settled = d["regimes_settled"]
    self._donation()

    def item(it):
      node, pos, aval, factor = it
      return (node, pos, r.aval(aval), factor)
    self._mem_items = ([item(it) for it in d["state"]],
                       [[item(it) for it in peak] for peak in d["peaks"]])
    self._num_held = d.get("num_held", 0)
    # (a cached property's value, set as the planner's problem finds it)
    self._own_liveness = _liveness_from_data(d["liveness"], item, r)
    self._memory()
    for peak in d["added_peaks"]:
      self._hold_peak([item(it) for it in peak])
    self._set_objective()


def _kind_data(node, leaf: bool, w: Writer) -> dict:
  """A node's choices, output specs, costs, bytes and flops."""
  if leaf:
    role, choices = "leaf", [[w.spec(spec), dim] for spec, dim in node.choices]
  elif node.choices and isinstance(node.choices[0], Strategy):
    role = "strategy"
    choices = [[st.name, [w.spec(s) for s in st.out_specs],
                [w.spec(s) for s in st.in_specs], st.compute, st.comm,
                [[kind, list(axes), b] for kind, axes, b in st.collectives]]
               for st in node.choices]
  else:
    role, choices = "spec", [w.spec(spec) for spec in node.choices]
  return {"role": role, "choices": choices,
          "specs": [[w.spec(s) for s in outs] for outs in node.specs],
          "costs": list(node.costs), "mem": None if node.mem is None else list(node.mem),
          "flops": None if node.flops is None else list(node.flops)}


def _kind_from_data(d: Mapping, r: Reader) -> tuple:
  if d["role"] == "leaf":
    choices = [(r.spec(s), dim) for s, dim in d["choices"]]
  elif d["role"] == "strategy":
    choices = [Strategy(name, tuple(map(r.spec, outs)), tuple(map(r.spec, ins)),
                        compute, comm,
                        tuple((kind, tuple(axes), b) for kind, axes, b in colls))
               for name, outs, ins, compute, comm, colls in d["choices"]]
  else:
    choices = [r.spec(s) for s in d["choices"]]
  return (choices, [tuple(map(r.spec, outs)) for outs in d["specs"]], d["costs"],
          d["mem"], d["flops"])


def _liveness_data(live: Liveness, w: Writer) -> dict:
  """A :class:`Liveness` whose values are memory items, and the copies a
  plan may make of them (``ilp_memory.Copy``), as data."""
  def item(it):
    node, pos, aval, _ = it
    return [node, pos, w.aval(aval)]
  return {"end": live.end,
          "buffers": [[*item(v), first, last, result]
                      for v, first, last, result in live.buffers],
          "extras": [[i, [[*item(v), result] for v, result in fixed],
                      [_liveness_data(b, w) for b in bodies]]
                     for i, fixed, bodies in live.extras],
          "reads": [[first, i, list(key), _copy_data(c, w)]
                    for first, i, key, c in live.reads],
          "twice": [[i, list(key), _copy_data(c, w), output]
                    for i, key, c, output in live.twice]}


def _liveness_from_data(d: Mapping, item, r: Reader) -> Liveness:
  return Liveness(
      d["end"],
      tuple((item((node, pos, aval, 1)), first, last, result)
            for node, pos, aval, first, last, result in d["buffers"]),
      tuple((i, tuple((item((node, pos, aval, 1)), result)
                      for node, pos, aval, result in fixed),
             tuple(_liveness_from_data(b, item, r) for b in bodies))
            for i, fixed, bodies in d["extras"]),
      tuple((first, i, tuple(key), _copy_from_data(c, r))
            for first, i, key, c in d["reads"]),
      tuple((i, tuple(key), _copy_from_data(c, r), output)
            for i, key, c, output in d["twice"]))


def _copy_data(c: Copy, w: Writer) -> dict:
  """A copy of a reshard, a gathered parameter or an all-reduce (not a
  budget's chain, which only a traced step has) as data."""
  edge = None
  if c.edge is not None:
    (src, spos), dst, dpos, aval, part = c.edge
    edge = [src, spos, dst, dpos, w.aval(aval), _PARTS.index(part)]
  return {"aval": w.aval(c.aval), "edge": edge, "leaf": c.leaf,
          "reduced": None if c.reduced is None else list(c.reduced), "synced": c.synced}


def _copy_from_data(d: Mapping, r: Reader) -> Copy:
  edge = None
  if d["edge"] is not None:
    src, spos, dst, dpos, aval, part = d["edge"]
    edge = ((src, spos), dst, dpos, r.aval(aval), _PARTS[part])
  return Copy(r.aval(d["aval"]), edge=edge, leaf=d["leaf"],
              reduced=None if d["reduced"] is None else tuple(d["reduced"]),
              synced=d["synced"])
