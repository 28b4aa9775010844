"""One ILP over accumulate_grad and apply_grad: choose every sharding.

Part of the planner (``planner/``), for ``ShardParallel``. The batch axes ``S`` are
fixed by the caller (``shard.py`` tries each choice); this module plans the
remaining mesh axes ``A`` for the ``compute_grad`` jaxpr (traced at the rows
one device holds along ``S``; it runs ``n`` times per step) and the
``apply_grad`` jaxpr (once per step) together.

Nodes and variables (the graph is built in ``ilp_graph.py``)
  * a *leaf node* per argument leaf, a *gradient node* per gradient, and an
    *equation node* per equation that has a choice; each has one-hot binary
    variables ``x[v, c]`` over its choices (specs for leaf and gradient nodes,
    :class:`~autopar.costs.strategies.Strategy` for equations). Elementwise equations
    whose array operands all have the output's shape *follow* their first
    operand: they get no variables ("merged"), and each other operand gets an
    edge to the first one's node.
  * a state leaf's choices come in two kinds: replicated over the batch axes
    ``S``, or also split over them on one dimension (ZeRO/FSDP): ``1/|S|`` of
    the memory, for an all-gather over ``S`` per micro-batch where
    compute_grad reads it (per step for optimizer state).
  * ``e[p, r] >= 0`` for each edge (a value produced in spec ``p`` and
    consumed in spec ``r``): how much of the edge goes from ``p`` to ``r``.

Objective (seconds per step)::

    min  Σ_stage max(F_stage, B_stage)                                 (rooflines)
       + Σ_v Σ_c  m_v · comm[v,c] · x[v,c]                            (collectives)
       + Σ_edges Σ_{p,r} m · reshard(p, r) · e[p,r]                     (reshards)
       + Σ_g Σ_c  allreduce_S(bytes(g, c)) · x[g,c] + α_S              (gradient sync)

with ``m = n`` for compute_grad and ``1`` for apply_grad; per stage
(compute_grad over its micro-batches, apply_grad) ``F`` the seconds of its
flops (each at its dtype's rate) and ``B`` its bytes moved at fusion
boundaries over the memory bandwidth, each a sum over the choices
(``_rooflines``). The max is found by solving with one of the two terms
per stage and again where the other is the larger (``_solve``).

Constraints (one method each)
  * one choice per node: ``Σ_c x[v,c] = 1``                      (``_one_hot``)
  * edge flows (a tight linearisation of x_u(p)·x_w(r)):
    ``Σ_r e[p,r] = Σ_{c: p} x[u,c]`` and ``Σ_p e[p,r] = Σ_{c: r} x[w,c]``
                                                                  (``_edges``)
  * a donated leaf and the output that replaces it share a spec:
    ``Σ_{c: s} x[out,c] = x[leaf,s]`` for every spec ``s``        (``_donation``)
  * memory per device at the points of the pass, when a budget is set:
    ``Σ_{values live at t} Σ_c bytes(value, c) · x[v,c] + copies(t) + state
    ≤ budget`` at the points where what is held is not a part of what
    another holds (``ilp_memory``: the copies a plan makes for its readers
    as terms of the edge flows and chained variables), and at up to four of
    the solution's own peaks under its specs where they are over the
    budget, added and solved again (``solve``, at most ``_BUDGET_ROUNDS``
    times; a ``PlanError`` if the plan's own peak is still over it)

Solved with PuLP and HiGHS (CBC if HiGHS is missing): the LP relaxation
first, which the edge flows make tight, and branch and bound only if its
solution is fractional. An infeasible memory budget raises an error with the
smallest budget that would fit.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Mapping, Sequence

from autopar.costs.cost_model import MeshCost, itemsize
from autopar.planner import lp
from autopar.errors import PlanError
from autopar.method import accumulation_dtype
from autopar.planner.ilp_graph import ChoiceGraph, on_axes
from autopar.planner.ilp_memory import MemoryModel
from autopar.planner.ilp_saved import SavedGraph
from autopar.planner.refine import refine_colors
from autopar.costs.strategies import (Spec, Strategy, grad_sync_latency, local_bytes,
                                      without_unit_axes)

__all__ = ["ShardingProblem", "Solution", "reshard_cost"]

BIG = 1e3   # seconds: a cost that rules a choice out (disallowed collectives)
MIP_GAP = 1e-4     # relative optimality gap at which the solver stops
# Colour-refinement rounds that tell layers' equations apart (see _classes).
# Merged elementwise equations join the residual stream of all layers into
# few nodes, so every extra round tells more layers near the ends apart: on
# the 96-layer GPT of benchmark/planner.py, 4 rounds give 451 classes and 8
# give 1366 (3x the solve time) for an objective lower by 6e-6 (relative),
# below the solver's gap.
LAYER_ROUNDS = 4


def reshard_collectives(src: Spec, dst: Spec) -> list[tuple[str, tuple[str, ...]]]:
  """The collectives (kind, axes) that turn ``src`` into ``dst``.

  An axis that leaves a dimension is all-gathered; one that moves to another
  dimension is an all-to-all; one that is added only slices locally (free).
  That holds where a dimension's axes kept in it lead its axes before and
  after, in one order: a dimension split over ("data", "model") holds on
  each device a block of "model"'s block, so gathering "model" away is one
  all-gather, but gathering "data" away (or adding "data" ahead of
  "model", or swapping the two) moves blocks between devices first, which
  XLA does with a collective-permute of the shard over the dimension's axes.
  """
  if src == dst:
    return []
  pos_src = {a: d for d, e in enumerate(src) for a in e}
  pos_dst = {a: d for d, e in enumerate(dst) for a in e}
  moved = tuple(a for a in pos_src if a in pos_dst and pos_dst[a] != pos_src[a])
  gone = tuple(a for a in pos_src if a not in pos_dst)
  permuted: list[str] = []
  for before, after in zip(src, dst):
    kept = tuple(a for a in before if a in after)
    if kept != before[:len(kept)] or kept != after[:len(kept)]:
      permuted += [a for a in dict.fromkeys((*before, *after)) if a not in permuted]
  permuted.sort()          # one name for one permute, whatever the direction
  out = []
  if permuted:
    out.append(("collective-permute", tuple(permuted)))
  if moved:
    out.append(("all-to-all", moved))
  if gone:
    out.append(("all-gather", gone))
  return out


def reshard_steps(aval, src: Spec, dst: Spec, sizes) -> list[tuple[str, tuple[str, ...], float]]:
  """The collectives of :func:`reshard_collectives` with the bytes per
  device each one's operand has: the ``src`` shard, except that a permute
  moves the smaller of the two blocks (the slice of the shard to be kept,
  or the shard before it is gathered)."""
  steps = reshard_collectives(src, dst)
  if not steps:
    return []
  b = float(local_bytes(aval, src, sizes))
  permute = min(b, float(local_bytes(aval, dst, sizes)))
  return [(kind, axes, permute if kind == "collective-permute" else b)
          for kind, axes in steps]


def reshard_cost(aval, src: Spec, dst: Spec, cost: MeshCost, sizes, *,
                 allow_all_gather=True, allow_all_to_all=True) -> float:
  """Seconds to turn a value sharded ``src`` into ``dst`` (0 if equal)."""
  allowed = {"all-gather": allow_all_gather, "all-to-all": allow_all_to_all,
             "collective-permute": True}
  return sum(cost.collective(kind, b, axes) if allowed[kind] else BIG
             for kind, axes, b in reshard_steps(aval, src, dst, sizes))


def _solver(time_limit: float | None = None, relax: bool = False):
  """HiGHS through highspy, or CBC if it is missing (``lp.solver``)."""
  return lp.solver(gap=MIP_GAP, time_limit=time_limit, relax=relax)


@dataclasses.dataclass(frozen=True)
class Solution:
  """What the solver chose."""
  leaf_specs: tuple[Spec, ...]
  leaf_batch_dims: tuple[int | None, ...]      # dim also split over the batch axes
  grad_specs: tuple[Spec, ...]
  compute_specs: dict[str, tuple[Spec, ...]]      # eqn path (loops too) -> output specs
  apply_specs: dict[str, tuple[Spec, ...]]
  compute_strategies: dict[int, Strategy]
  apply_strategies: dict[int, Strategy]
  apply_out_specs: tuple[Spec | None, ...]
  micro_out_specs: tuple[Spec | None, ...]
  objective: float
  status: str
  solver: str
  seconds: float
  num_variables: int
  num_constraints: int
  collectives: tuple[tuple[str, str, tuple[str, ...], float, int], ...]
  memory: float           # bytes per device: state, gradients, activation peak
  # part ("compute"/"apply") -> loop path -> "in<k>" (carry operand k) or
  # "x<k>" (each trip's slice of scanned operand k) -> the spec it enters in
  region_in_specs: dict = dataclasses.field(default_factory=dict)
  # ShardingProblem.stage_times() at the solution: the objective by stage
  stage_times: dict = dataclasses.field(default_factory=dict)


class ShardingProblem(ChoiceGraph, MemoryModel, SavedGraph):
  """The ILP for one choice of batch axes (see the module docstring).

  Args:
    compute, apply: the split step's jaxprs (consts lifted to leading inputs).
    num_consts: how many leading inputs are consts.
    leaf_avals: avals of the argument leaves, in order (batch leaves at the
      per-device micro-batch size).
    batch_leaves: which leaves are batch data.
    donation: apply output index -> leaf index it replaces.
    num_micro_batches: n.
    batch_axes: S. planned_axes: A.
    keep: ``(axes, decisions)`` from :meth:`decisions` of a problem solved
      over planned ``axes``, a subset of A: every node keeps how that
      solution split its values over those axes and chooses only over the
      others (a node whose choices at this size meet none keeps them all).
      The problem is then about as small as the solved one's.
    held: ``(value of the pass, times)``: values held beyond the pass that
      count with the state against the memory budget, in the specs the plan
      gives them (a pipeline stage's residuals, once per micro-batch in
      flight); ``memory_at_solution`` leaves them out of the state.
  """

  # The keyword arguments ``shard.sharding_problem`` made it with (None for
  # a problem made otherwise, or read back from a plan's JSON): what tells a
  # problem that differs from another only in its pins (``shard.price_layout``).
  arguments: dict | None = None

  def __init__(self, *, compute, apply, num_consts: int, leaf_avals: Sequence,
               batch_leaves: Sequence[bool], donation: Mapping[int, int],
               num_micro_batches: int, batch_axes: Sequence[str],
               planned_axes: Sequence[str], sizes: Mapping[str, int],
               cost: MeshCost, seconds_per_flop: float, seconds_per_byte: float = 0.0,
               flop_rates: Mapping[str, float] | None = None, platform: str = "cpu",
               allow_all_gather: bool = True, allow_all_to_all: bool = True,
               memory_budget: float | None = None, read_by_compute=(),
               share_layers: bool = True, pins: Mapping[int, Spec] | None = None,
               leaf_names: Sequence[str] = (), accumulate: str | None = "float32",
               keep: tuple[Sequence[str], Mapping[str, tuple]] | None = None,
               zero3: bool = True, held: Sequence[tuple] = (), grad_sync: str = "last"):
    super().__init__(compute=compute, apply=apply, num_consts=num_consts,
                     leaf_avals=leaf_avals, batch_leaves=batch_leaves,
                     num_micro_batches=num_micro_batches, batch_axes=batch_axes,
                     planned_axes=planned_axes, sizes=sizes, cost=cost,
                     seconds_per_flop=seconds_per_flop, flop_rates=flop_rates,
                     read_by_compute=read_by_compute, platform=platform,
                     pins=pins, leaf_names=leaf_names, keep=keep, zero3=zero3)
    self.donation = dict(donation)
    self.seconds_per_byte = seconds_per_byte
    self.sync_latency = 0.0      # set by build: the combined gradient sync's latency
    self.allow_all_gather = allow_all_gather
    self.allow_all_to_all = allow_all_to_all
    self.memory_budget = memory_budget
    # (pass value, times): values held beyond the pass against the budget
    # (a pipeline stage's residuals of the other micro-batches in flight).
    self.held = tuple(held)
    self.accumulate = accumulate
    self.grad_sync = grad_sync
    self.share_layers = share_layers
    self.prob = lp.problem("autopar_sharding")
    self._status = None
    self.objective: dict = {}       # variable -> cost coefficient (seconds)
    self.num_variables = 0
    self.num_constraints = 0
    self._edge_count = 0
    self._reshard_cache: dict = {}
    self._edge_traffic: dict = {"compute": {}, "apply": {}}   # var -> bytes (reshards)
    self._chosen_memo: dict = {}
    self._added_peaks: list = []      # the plan's own peaks held to the budget (solve)
    self._vars: list = []             # the variables, in the order they are made
    self.timings: dict[str, float] = {}

  def solution_keys(self) -> dict[str, tuple[set[str], set[str], dict[str, tuple[str, ...]]]]:
    """Per part ("compute", "apply"): the equation paths a solution gives
    output specs (``Solution.compute_specs``) and strategies
    (``compute_strategies``), and per loop the keys of what enters it
    (``region_in_specs``); the same for every solution of the problem."""
    out = {}
    for part, eqn_nodes in (("compute", self.compute_eqn_nodes),
                            ("apply", self.apply_eqn_nodes)):
      specs = {*eqn_nodes, *self._followers[part], *self._region_outs[part]}
      out[part] = (specs, set(eqn_nodes),
                   {i: tuple(ins) for i, ins in self._region_ins[part].items()})
    return out

  def decisions(self) -> dict[str, tuple]:
    """Node name -> how the solution splits its outputs over the planned
    axes (after :meth:`solve`; for ``keep`` of a problem over more axes)."""
    return {node.name: on_axes(node.specs[self._chosen(i)], self.A)
            for i, node in enumerate(self.nodes)}

  # -- variables and constraints ---------------------------------------------------

  def _variable(self, name: str, lowBound=None, cat="Continuous"):
    """A new variable of the problem (``lp.variable``), numbered in
    ``self._vars`` by the order it was made in (the same in a problem
    restored from its data, ``ilp_saved.py``)."""
    x = lp.variable(self.prob, name, lowBound=lowBound, cat=cat)
    self._vars.append(x)
    return x

  def _classes(self) -> list[int]:
    """Node -> class: nodes of one class share their variables.

    Repeated layers (a Python loop over blocks) trace to equations that are
    alike up to which weights they read. Colour refinement finds them: every
    node starts with its key (equal keys: identical choices and costs), then
    for ``LAYER_ROUNDS`` rounds takes the colours of its producers and
    consumers (with operand positions) into its own. Nodes that still share a
    colour have the same neighbourhood that far out, which in a stack of
    identical layers holds for the same equation in every layer away from the
    ends. They then get one set of strategy variables, so the ILP's size does
    not grow with depth. It is a restriction of the problem: the solution is
    valid, and no worse when the best plan treats those layers alike.
    """
    n = len(self.nodes)
    if not self.share_layers:
      return list(range(n))
    ids: dict = {}
    color = [ids.setdefault(node.key, len(ids)) if node.key is not None else
             ids.setdefault(("node", i), len(ids)) for i, node in enumerate(self.nodes)]
    edges = [(src, dst, spos, dpos)
             for (src, spos), dst, dpos, _, _, _ in self._edge_list()]
    color = refine_colors(color, edges, LAYER_ROUNDS)
    return self._split_leaves(color, edges)

  def _split_leaves(self, color: list[int], edges) -> list[int]:
    """Leaves keep a class only with leaves whose readers and donors ended
    in the same classes.

    A leaf is a source: what tells one layer's optimizer state from
    another's is far from it (the moment ``mu`` is read by an update whose
    gradient comes from that layer's matmul, five or more steps away), so
    the rounds of refinement can leave the ``mu`` of a column-split kernel
    in one class with the ``mu`` of a row-split one and force them one
    spec. One more round for leaves alone, over the final colours of the
    equations that read them and of the one whose output is donated into
    them, splits those; the leaves of layers that are alike stay together.
    """
    readers: dict[int, list] = {}
    for src, dst, spos, dpos in edges:
      readers.setdefault(src, []).append((color[dst], spos, dpos))
    donor: dict[int, tuple] = {}
    for out_idx, leaf in self.donation.items():
      ref = self._apply_out_refs[out_idx]
      if ref is not None:
        src, pos = ref
        donor[self.leaf_nodes[leaf]] = (color[src], pos)
    ids: dict = {}
    fresh = max(color, default=-1) + 1
    out = list(color)
    for node in self.leaf_nodes:
      key = (color[node], tuple(sorted(readers.get(node, ()))), donor.get(node))
      out[node] = ids.setdefault(key, fresh + len(ids))
    return out

  def _edge_list(self):
    """((src node, output pos), dst node, dst pos or -1 (follow), aval, mult,
    part)."""
    for src, dst, pos, aval, mult, part in self._pending_edges:
      yield src, dst, pos, aval, mult, part
    for src, (dst, dpos), aval, mult, part in self._follow_edges:
      yield src, dst, -1 - dpos, aval, mult, part
    for src, node, aval in self._grad_edges:
      yield src, node, -1, aval, self.n, "compute"

  def _variables(self, classes: Sequence[int] | None = None):
    """One-hot variables per class of nodes (``classes``: node -> class,
    default :meth:`_classes`), and the costs of their choices."""
    t0 = time.perf_counter()
    self.node_class = list(classes) if classes is not None else self._classes()
    self.timings["classes"] = time.perf_counter() - t0
    shared: dict[int, list] = {}
    weight: dict[int, float] = {}
    for idx, node in enumerate(self.nodes):
      c = self.node_class[idx]
      if c not in shared:
        shared[c] = [self._variable(f"x_{idx}_{k}", cat="Binary")
                     for k in range(len(node.choices))]
        self.num_variables += len(node.choices)
      node.vars = shared[c]
      weight[c] = weight.get(c, 0.0) + node.mult
    self.num_classes = len(shared)
    rep = {}
    for idx, c in enumerate(self.node_class):
      rep.setdefault(c, idx)
    for c, idx in rep.items():
      node = self.nodes[idx]
      for var, cost in zip(node.vars, node.costs):
        if cost:
          self._cost(var, weight[c] * cost)
    self._class_rep = rep
    self._class_weight = weight       # class -> its nodes' summed multiplicity

  def _rooflines(self):
    """Each stage's compute as the roofline of all its work: ``max(F, B)``
    with ``F = Σ flops·seconds per flop`` and ``B = Σ bytes moved · seconds
    per byte`` over the equations of ``compute_grad`` (times the
    micro-batches) and of ``apply_grad``, each term at the chosen spec
    (``self.work``: memory traffic at fusion boundaries; reshards and
    collectives read and write theirs). This is how the compiled stage is
    judged (``plan.check``): flops and bytes accessed of the whole module
    against the device's peak rate and bandwidth. The terms are kept per
    stage; :meth:`_set_objective` and :meth:`_solve` minimise the max."""
    flops = {"compute": {}, "apply": {}}
    traffic = {"compute": {}, "apply": {}}

    def add(terms, var, value):
      if value:
        terms[var] = terms.get(var, 0.0) + value
    for part in traffic:
      for var, b in self._edge_traffic[part].items():
        add(traffic[part], var, b)
    # Nodes of one class share their variables, choices, flops and part
    # (equal keys): each class is charged once, at its nodes' summed
    # multiplicity (:meth:`_variables`), and so is each kind of work on it.
    for c, idx in self._class_rep.items():
      node = self.nodes[idx]
      if node.flops is None or node.part is None:
        continue
      mult = self._class_weight[c]
      for var, f, st in zip(node.vars, node.flops, node.choices):
        add(flops[node.part], var, mult * f)
        # A collective reads its operand and writes its result.
        add(traffic[node.part], var, mult * sum(2 * b for _, _, b in st.collectives))
    for g, idx in enumerate(self.grad_nodes):
      node = self.nodes[idx]
      aval = self._grad_avals[g]
      for var, (spec,) in zip(node.vars, node.specs):
        add(traffic["compute"], var, self._grad_traffic(aval, spec))
    elementwise = self.ctx.flop_seconds()
    sizes = self.sizes
    grouped: dict = {}
    for part, mult, (idx, pos), aval, kind in self.work:
      key = (part, self.node_class[idx], pos, tuple(aval.shape), aval.dtype, kind)
      if key in grouped:
        grouped[key][0] += mult
      else:
        grouped[key] = [mult, aval]
    local = {}
    for (part, c, pos, shape, dtype, kind), (mult, aval) in grouped.items():
      node = self.nodes[self._class_rep[c]]
      for ch, var in enumerate(node.vars):
        spec = (node.choices[ch].in_specs[pos] if kind == "read" else
                node.specs[ch][pos])
        key = (shape, dtype, spec)
        b = local.get(key)
        if b is None:
          b = local[key] = local_bytes(aval, spec, sizes)
        if kind != "flops":
          add(traffic[part], var, mult * b)
        else:
          add(flops[part], var, mult * elementwise * b / max(itemsize(dtype), 1))
    spb = self.seconds_per_byte
    self._flop_terms = flops
    self._memory_terms = {p: {v: spb * b for v, b in t.items()} for p, t in traffic.items()}
    # The bound each stage starts from: the larger total over all choices.
    self._regime = {p: "memory" if sum(self._memory_terms[p].values()) >
                    sum(flops[p].values()) else "flops" for p in flops}

  def _set_objective(self) -> None:
    """The objective with each stage's roofline as the term its regime
    names: ``max(F, B)`` is F where the stage is compute bound and B where it
    is memory bound, and with one of them the problem stays separable (its
    LP relaxation tight; a ``t >= F, t >= B`` variable makes it fractional
    and the solve a branch and bound, ten times slower). :meth:`_solve`
    finds the regime that holds at the solution."""
    terms = dict(self.objective)
    for part, regime in self._regime.items():
      chosen = self._flop_terms if regime == "flops" else self._memory_terms
      for v, a in chosen[part].items():
        terms[v] = terms.get(v, 0.0) + a
    self.prob.setObjective(lp.linear(terms))
    # A solver model kept for solve_pinned has the old objective.
    self._relaxed = None

  @property
  def _apart(self) -> bool:
    """Whether the gradients are reduced in a stage of their own
    (``grad_sync="apart"`` with several micro-batches), their sums started
    by ``zero_grad``."""
    return self.grad_sync == "apart" and self.n > 1

  def _grad_bytes(self, aval, spec) -> tuple[float, float]:
    """(the gradient's bytes per device at ``spec``, those of its partial
    sum, in the accumulation dtype)."""
    b = local_bytes(aval, spec, self.sizes)
    acc = accumulation_dtype(aval.dtype, self.accumulate)
    return b, b * itemsize(acc) / max(itemsize(aval.dtype), 1)

  def _grad_traffic(self, aval, spec) -> float:
    """Bytes a gradient moves in the gradient stages per step besides the
    pass's own traffic: under ``"last"``, the all-reduce in the last
    stage reads and writes it; under ``"apart"`` (the all-reduce is in
    ``sync_grad``, :meth:`grad_pass_seconds`), the first micro-batch adds
    it to the sum ``zero_grad`` made (reading both, writing the sum) where
    ``"last"``'s first pass writes the gradient as the sum.

    The later micro-batches' additions, the same under both, are not
    counted: ``plan.check`` finds the predictions within its tolerances
    without them (the pass's own traffic, counted at fusion boundaries,
    comes out above XLA's). ``"apart"`` is priced by what it adds."""
    b, a = self._grad_bytes(aval, spec)
    if self._apart:
      return 3 * a
    return 2 * b if self.S else 0.0

  def grad_pass_seconds(self, aval, spec) -> float:
    """Seconds of a gradient's passes outside the gradient stages under
    ``grad_sync="apart"`` (0 otherwise): ``zero_grad`` writes its sum,
    ``sync_grad`` reads it and writes the reduced gradient (the all-reduce,
    if any, is that read and write). Stages of their own: added to the
    step's time, not under the gradient stages' roofline."""
    if not self._apart:
      return 0.0
    b, a = self._grad_bytes(aval, spec)
    return self.seconds_per_byte * (2 * a + b)

  def _roofline_values(self) -> dict[str, tuple[float, float]]:
    """Per stage, (flops seconds, memory seconds) at the current solution."""
    return {p: (lp.value_of(self._flop_terms[p]), lp.value_of(self._memory_terms[p]))
            for p in self._flop_terms}

  def true_objective(self) -> float:
    """Seconds per step at the current solution: the costs of the choices
    and edges, each stage's roofline ``max(F, B)`` and the gradient sync's
    latency."""
    base = lp.value_of(self.objective)
    return base + sum(max(f, b) for f, b in self._roofline_values().values()) + \
        self.sync_latency

  def _solve(self, time_limit: float) -> str:
    """Solves with each stage's roofline as one of its two terms, then
    again with a stage's other term where that one is the larger at the
    solution, and keeps the best solution by :meth:`true_objective`. A
    solution whose stages are each bound by the term it was solved with is
    optimal for the true objective: any other costs at least its own
    chosen terms, which cost at least this one."""
    deadline = time.perf_counter() + time_limit
    parts = sorted(self._regime)
    every = [dict(zip(parts, c)) for c in itertools.product(("flops", "memory"),
                                                            repeat=len(parts))]
    tried, best, self.regimes_settled = [], None, False
    while True:
      tried.append(dict(self._regime))
      solver_name = self._run_solver(max(1.0, deadline - time.perf_counter()))
      if not self._status.optimal:
        break
      value = self.true_objective()
      if best is None or value < best[0]:
        best = (value, {v: v.varValue for v in self.prob.variables()}, solver_name,
                self._status, dict(self._regime))
      bound = {p: ("memory" if b > f else "flops")
               for p, (f, b) in self._roofline_values().items()}
      if bound == self._regime:
        self.regimes_settled = True   # optimal (see above)
        break
      # The other term is the larger somewhere: solve with it; where that
      # was tried, with a choice of terms not tried yet (at most four).
      todo = [r for r in [bound] + every if r not in tried]
      if not todo:
        break                         # none settles: the best found is kept
      self._regime = todo[0]
      self._set_objective()
    if best is None:
      return solver_name
    value, values, solver_name, self._status, regime = best
    for v, x in values.items():
      v.varValue = x
    if regime != self._regime:
      self._regime = regime
      self._set_objective()
    self._chosen_memo, self._own_peak = {}, None
    return solver_name

  def _one_hot(self):
    for c, idx in self._class_rep.items():
      self._equal([(x, 1) for x in self.nodes[idx].vars], 1, f"one_hot_{c}")

  def _cost(self, var, seconds: float) -> None:
    """Adds ``seconds · var`` to the objective."""
    self.objective[var] = self.objective.get(var, 0.0) + seconds

  def _equal(self, terms, rhs: float, name: str | None = None) -> None:
    """Adds ``Σ coef · var == rhs`` for ``terms`` = [(var, coef)], built
    directly as one expression (PuLP's operators copy it term by term)."""
    expr: dict = {}
    for x, a in terms:
      expr[x] = expr.get(x, 0) + a
    self.prob.addConstraint(lp.linear(expr) == rhs, name)
    self.num_constraints += 1

  def _spec_groups(self, node_id: int, pos: int) -> dict[Spec, list]:
    groups: dict[Spec, list] = {}
    node = self.nodes[node_id]
    for c, specs in enumerate(node.specs):
      groups.setdefault(specs[pos], []).append(node.vars[c])
    return groups

  def _required_groups(self, node_id: int, pos: int) -> dict[Spec, list]:
    groups: dict[Spec, list] = {}
    node = self.nodes[node_id]
    for c, st in enumerate(node.choices):
      req = st.in_specs[pos]
      if req is not None:
        groups.setdefault(req, []).append(node.vars[c])
    return groups

  def _edge(self, produced: dict, required: dict, aval, mult, part) -> dict:
    """Resharding cost of one edge, linearised as a transportation problem;
    returns the flows that reshard: ``(p, r) -> [variables]`` whose sum is
    1 where the value is made in ``p`` and read in ``r`` (the memory
    model's copies, ``ilp_memory``).

    ``e[p, r] >= 0`` with ``Σ_r e[p,r] = x_u(p)`` and ``Σ_p e[p,r] = x_w(r)``:
    for one-hot ``x`` it is the product ``x_u(p)·x_w(r)``, and unlike
    ``y >= x_u + x_w - 1`` its LP relaxation is tight, so HiGHS solves the
    ILP with little branching. An edge with one side fixed is linear. A
    reshard's collectives cost their α-β seconds in the objective, and the
    bytes they (and the copies around them) move count in ``part``'s
    memory traffic (:meth:`_rooflines`).
    """
    costs = {(p, r): self._reshard(aval, p, r) for p in produced for r in required}
    if not any(costs.values()):
      return {}
    traffic = self._edge_traffic[part]

    def charge(x, p, r):
      if costs[p, r] > 0:
        self._cost(x, mult * costs[p, r])
        traffic[x] = traffic.get(x, 0.0) + mult * self._reshard_bytes(aval, p, r)
    if len(produced) == 1 or len(required) == 1:
      for (p, r) in costs:
        for x in (required[r] if len(produced) == 1 else produced[p]):
          charge(x, p, r)
      return {(p, r): required[r] if len(produced) == 1 else produced[p]
              for (p, r), c in costs.items() if c > 0}
    flows = {}
    for (p, r) in costs:
      e = self._variable(f"e_{self._edge_count}", lowBound=0)
      self._edge_count += 1
      self.num_variables += 1
      flows[p, r] = e
      charge(e, p, r)
    for p, pvars in produced.items():
      self._equal([(flows[p, r], 1) for r in required] + [(x, -1) for x in pvars], 0)
    for r, rvars in required.items():
      self._equal([(flows[p, r], 1) for p in produced] + [(x, -1) for x in rvars], 0)
    return {pr: [e] for pr, e in flows.items() if costs[pr] > 0}

  def _reshard_bytes(self, aval, p: Spec, r: Spec) -> float:
    """Bytes a reshard moves through memory on one device: each collective
    (or slicing copy) reads the value's shard and writes the new one."""
    steps = max(1, len(reshard_collectives(p, r)))
    return steps * (local_bytes(aval, p, self.sizes) + local_bytes(aval, r, self.sizes))

  def _reshard(self, aval, p: Spec, r: Spec) -> float:
    key = (tuple(aval.shape), aval.dtype, p, r)
    c = self._reshard_cache.get(key)
    if c is None:
      c = self._reshard_cache[key] = reshard_cost(
          aval, p, r, self.cost, self.sizes, allow_all_gather=self.allow_all_gather,
          allow_all_to_all=self.allow_all_to_all)
    return c

  def _edges(self):
    # Edges between the same classes (and value shape) share their flows;
    # their costs add up.
    merged: dict = {}
    for (src, spos), dst, dpos, aval, mult, part in self._edge_list():
      key = self._edge_key(src, spos, dst, dpos, aval, part)
      if key in merged:
        merged[key][-2] += mult
      else:
        merged[key] = [src, spos, dst, dpos, aval, mult, part]
    self._flows = {}
    for key, (src, spos, dst, dpos, aval, mult, part) in merged.items():
      if dpos >= 0:
        required = self._required_groups(dst, dpos)
      else:
        required = self._spec_groups(dst, -1 - dpos) if dst not in self._grad_node_set \
            else {s[0]: [x] for s, x in zip(self.nodes[dst].specs, self.nodes[dst].vars)}
      self._flows[key] = self._edge(self._spec_groups(src, spos), required, aval, mult,
                                    part)

  def _edge_key(self, src, spos, dst, dpos, aval, part) -> tuple:
    """Edges with equal keys (between the same classes, of one value
    shape) share their flows."""
    return (self.node_class[src], spos, self.node_class[dst], dpos,
            tuple(aval.shape), aval.dtype, part)

  def _donation(self):
    seen = set()
    for out_idx, leaf in self.donation.items():
      if self._apply_out_refs[out_idx] is None:
        continue
      src, pos = self._apply_out_refs[out_idx]
      key = (self.node_class[src], pos, self.node_class[self.leaf_nodes[leaf]])
      if key in seen:
        continue
      seen.add(key)
      produced = self._spec_groups(src, pos)
      for spec, xs in self._spec_groups(self.leaf_nodes[leaf], 0).items():
        self._equal([(x, 1) for x in produced.get(spec, [])] + [(x, -1) for x in xs],
                    0, f"donate_{out_idx}_{self.num_constraints}")

  # -- solve ---------------------------------------------------------------------

  def build(self) -> "ShardingProblem":
    t0 = time.perf_counter()
    self._build_graph()
    self._grad_node_set = set(self.grad_nodes)
    # The gradients' all-reduces are combined (XLA's combiner): one
    # latency a step, a constant of the problem (grad nodes cost bandwidth).
    self.sync_latency = grad_sync_latency(self.S, self.cost) if self.grad_nodes else 0.0
    # With grad_sync="apart", each gradient's passes in zero_grad and
    # sync_grad, stages of their own (added to its node's costs, a list
    # per node: nodes of one key share theirs).
    for g, idx in enumerate(self.grad_nodes):
      node = self.nodes[idx]
      node.costs = [c + self.grad_pass_seconds(self._grad_avals[g], spec)
                    for c, (spec,) in zip(node.costs, node.specs, strict=True)]
    self.timings["strategies"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    self._variables()
    self._one_hot()
    self._edges()
    self._rooflines()
    self._donation()
    self._memory()
    self._set_objective()
    self.timings["build"] = time.perf_counter() - t0 - self.timings["classes"]
    return self

  def solve(self, time_limit: float = 60.0) -> float:
    """Solves the problem; returns its objective (seconds per step).

    :meth:`solution` then reads what was chosen: the planner compares the
    objectives of several problems and reads only the best one's solution.
    """
    t0 = time.perf_counter()
    deadline = t0 + time_limit
    over = None
    try:
      solver_name = self._solve(time_limit)
      # The budget is held at the peaks of replicated bytes; where the
      # plan's own peak (its specs' bytes) is elsewhere and over it, it is
      # held there too and the problem solved again.
      for rounds in range(_BUDGET_ROUNDS + 1 if self.memory_budget is not None else 0):
        if not self._status.optimal:
          break
        state, _ = self._memory_items()
        held = self._total(state)
        over = held + self._total(self._peak_at_solution())
        if over <= self.memory_budget * (1 + 1e-6):
          over = None
          break
        if rounds == _BUDGET_ROUNDS:
          break
        for peak in self._peaks_at_solution():
          if held + self._total(peak) > self.memory_budget * (1 + 1e-6):
            self._hold_peak(peak)
        solver_name = self._solve(max(1.0, deadline - time.perf_counter()))
    finally:
      self.solve_seconds = seconds = time.perf_counter() - t0
    status = self._status.name
    if not self._status.optimal:
      if self.memory_budget is not None:
        raise PlanError(self._infeasible_message(status))
      raise PlanError(f"autopar: the sharding ILP ended with status {status!r}. "
                      f"Fix: report this with the step's jaxpr.")
    if over is not None:
      raise PlanError(
          f"autopar: no sharding found within memory_budget_per_device="
          f"{self.memory_budget:.0f} bytes on batch axes {self.S}: after "
          f"{_BUDGET_ROUNDS} rounds the plan's own peak is still {over:.0f} bytes. "
          f"Fix: raise memory_budget_per_device, use more micro-batches or a "
          f"larger mesh.")
    if not getattr(self, "regimes_settled", True):
      status += " (no choice of roofline terms settled: the best solution found)"
    self._solved = (status, solver_name, seconds)
    return self.true_objective()

  def _hold_peak(self, peak) -> None:
    """Holds the memory items of ``peak`` (a plan's own peak) with the
    state to the budget, for every solve from now on."""
    self._added_peaks.append(peak)
    s_expr, (p_expr,) = self._memory_exprs(self._memory_items()[0], [peak])
    self.prob += s_expr + p_expr <= self.memory_budget, f"memory_{self.num_constraints}"
    self.num_constraints += 1

  def _run_solver(self, time_limit: float) -> str:
    """Solves ``self.prob``; returns the solver's name."""
    # The edge flows make the LP relaxation tight (see _edge), so its
    # solution is most often already integral, and then optimal for the
    # ILP; the branch-and-bound solve runs only when it is not.
    solver, solver_name = _solver(time_limit, relax=True)
    self._status = lp.solve(self.prob, solver)
    if not self._status.optimal or not self._integral():
      solver, solver_name = _solver(time_limit)
      self._status = lp.solve(self.prob, solver)
    self._chosen_memo = {}            # the choices read so far are the last solve's
    self._own_peak = None
    return solver_name

  def solution(self) -> Solution:
    """What the solver chose (after :meth:`solve`)."""
    return self._read_solution(*self._solved)

  def _integral(self, tol: float = 1e-6) -> bool:
    """Whether every one-hot variable of the current solution is 0 or 1."""
    for idx in self._class_rep.values():
      for x in self.nodes[idx].vars:
        v = x.varValue
        if v is None or min(v, 1.0 - v) > tol:
          return False
    return True

  def _infeasible_message(self, status) -> str:
    need = self.min_memory()
    return (f"autopar: no sharding fits memory_budget_per_device="
            f"{self.memory_budget:.0f} bytes on batch axes {self.S} and planned axes "
            f"{self.A} (solver status {status}); the smallest budget that fits is "
            f"about {need:.0f} bytes. Fix: set memory_budget_per_device >= {need:.0f}, "
            f"use more micro-batches or a larger mesh.")

  def min_memory(self) -> float:
    """The smallest peak memory any sharding reaches (a separate small ILP)."""
    prob = lp.problem("autopar_min_memory")
    peak = lp.variable(prob, "autopar_peak", lowBound=0)
    state, acts = self.memory_terms()
    _, added = self._memory_exprs(self._memory_items()[0], self._added_peaks)
    twins: dict = {}        # the main problem's variables, as this one's
    state = lp.moved(prob, state, twins)
    for t, act in enumerate([*acts, *added] or [0]):
      prob += peak >= state + lp.moved(prob, act, twins)
    for idx, node in enumerate(self.nodes):
      prob += lp.linear((lp.moved(prob, x, twins), 1.0) for x in node.vars) == 1
    prob.setObjective(lp.linear({peak: 1.0}))
    lp.solve(prob, _solver()[0])
    return float(lp.value(peak) or 0.0)

  def _chosen(self, node_id) -> int:
    xs = self.nodes[node_id].vars
    c = self._chosen_memo.get(id(xs))
    if c is None:
      vals = [v.varValue or 0.0 for v in xs]
      c = self._chosen_memo[id(xs)] = max(range(len(vals)), key=vals.__getitem__)
    return c

  def _spec_at(self, ref: tuple[int, int] | None) -> Spec | None:
    """The chosen spec of output ``pos`` of node ``node`` (``ref``), if any."""
    if ref is None:
      return None
    node, pos = ref
    return self.nodes[node].specs[self._chosen(node)][pos]

  def cost_by_part(self) -> dict[str, float]:
    """The solution's objective (seconds) split by where it is spent:
    ``"compute"`` (compute_grad, all micro-batches: its roofline and its
    collectives), ``"apply"``, ``"sync"`` (the gradients' reduction over
    the batch axes, and under ``grad_sync="apart"`` the passes of
    ``zero_grad`` and ``sync_grad`` over their sums) and ``"state"``
    (gathering state split over the batch axes, ZeRO). The parts add up to
    the objective."""
    times = self.stage_times()
    out = {"compute": times["compute"]["total"], "apply": times["apply"]["total"],
           "sync": times["sync"] + times["passes"], "state": times["state"]}
    return out

  def stage_times(self) -> dict:
    """The solution's predicted time by stage: for ``"compute"`` (every
    micro-batch's compute_grad together) and ``"apply"``, the seconds of
    its flops, of its memory traffic, its roofline (the larger of the two)
    and its collectives; and the seconds of the gradient sync
    (``"sync"``), of gathering state split over the batch axes
    (``"state"``) and of ``zero_grad``'s and ``sync_grad``'s passes over the
    gradients' sums (``"passes"``, ``grad_sync="apart"``). Their totals add
    up to the objective."""
    self._chosen_memo = getattr(self, "_chosen_memo", {})
    out = {part: {"flops": f, "memory": b, "collectives": 0.0}
           for part, (f, b) in self._roofline_values().items()}
    out["sync"], out["state"], out["passes"] = self.sync_latency, 0.0, 0.0
    grads = {idx: g for g, idx in enumerate(self.grad_nodes)}
    leaves = set(self.leaf_nodes)
    for idx, node in enumerate(self.nodes):
      c = node.costs[self._chosen(idx)] * node.mult
      if idx in grads:
        p = self.grad_pass_seconds(self._grad_avals[grads[idx]], self._spec_at((idx, 0)))
        out["passes"] += p
        out["sync"] += c - p
      elif idx in leaves:
        out["state"] += c
      else:
        out["apply" if node.name.startswith("apply/") else "compute"]["collectives"] += c
    for (src, pos), r, aval, mult, part in self._chosen_edges():
      if r is None:
        continue
      p = self.nodes[src].specs[self._chosen(src)][pos]
      out["apply" if part == "apply" else "compute"]["collectives"] += \
          mult * self._reshard(aval, p, r)
    for part in ("compute", "apply"):
      t = out[part]
      t["roofline"] = max(t["flops"], t["memory"])
      t["total"] = t["roofline"] + t["collectives"]
    return out

  def _chosen_edges(self) -> list:
    """Per edge of the solution: ((producing node, output), the spec its
    reader requires (None: any), aval, multiplicity, part), the gradients'
    edges into their sync nodes included."""
    edges = [(src, self.nodes[dst].choices[self._chosen(dst)].in_specs[pos], aval,
              mult, part) for src, dst, pos, aval, mult, part in self._pending_edges]
    edges += [(src, self.nodes[dst[0]].specs[self._chosen(dst[0])][dst[1]], aval,
               mult, part) for src, dst, aval, mult, part in self._follow_edges]
    edges += [(src, self.nodes[node].specs[self._chosen(node)][0], aval, self.n,
               "compute") for src, node, aval in self._grad_edges]
    return edges

  def _chosen_reshards(self):
    """(part, kind, axes, bytes, per step) of every resharding the plan does."""
    out = []
    for (src, pos), r, aval, mult, part in self._chosen_edges():
      p = self.nodes[src].specs[self._chosen(src)][pos]
      if r is None or self._reshard(aval, p, r) <= 0:
        continue
      stage = "compute_grad" if part == "compute" else "apply_grad"
      out.extend((stage, kind, axes, b, mult)
                 for kind, axes, b in reshard_steps(aval, p, r, self.sizes))
    return out

  def _read_solution(self, status, solver_name, seconds) -> Solution:
    self._chosen_memo = {}
    leaf_specs = tuple(self.nodes[n].specs[self._chosen(n)][0] for n in self.leaf_nodes)
    leaf_batch_dims = tuple(self.nodes[n].choices[self._chosen(n)][1]
                            for n in self.leaf_nodes)
    grad_specs = tuple(self.nodes[n].specs[self._chosen(n)][0] for n in self.grad_nodes)
    cstrat = {i: self.nodes[n].choices[self._chosen(n)]
              for i, n in self.compute_eqn_nodes.items()}
    astrat = {i: self.nodes[n].choices[self._chosen(n)]
              for i, n in self.apply_eqn_nodes.items()}
    colls = []
    for part, strat, nodes in (("compute_grad", cstrat, self.compute_eqn_nodes),
                               ("apply_grad", astrat, self.apply_eqn_nodes)):
      for i, st in strat.items():
        mult = self.nodes[nodes[i]].mult      # x loop length inside a scan
        for kind, axes, b in st.collectives:
          colls.append((part, kind, tuple(axes), float(b), mult))
    colls.extend(self._chosen_reshards())
    for k, n in enumerate(self.leaf_nodes):
      c = self._chosen(n)
      if self.nodes[n].choices[c][1] is not None and self.gathers_of.get(k):
        # A leaf split over the batch axes (ZeRO-3), gathered for each
        # reader in every micro-batch (``evaluate.gather_sites``).
        colls.append(("compute_grad", "all-gather", self.S,
                      float(self.nodes[n].mem[c]) * self.gathers_of[k], 1))
    def with_followers(strat, part):
      specs = {i: st.out_specs for i, st in strat.items()}
      for i, (node, pos) in self._followers[part].items():
        specs[i] = (self.nodes[node].specs[self._chosen(node)][pos],)
      for i, outs in self._region_outs[part].items():
        specs[i] = tuple(self.nodes[node].specs[self._chosen(node)][pos]
                         for node, pos in outs)
      return specs

    return Solution(
        leaf_specs=leaf_specs, leaf_batch_dims=leaf_batch_dims, grad_specs=grad_specs,
        compute_specs=with_followers(cstrat, "compute"),
        apply_specs=with_followers(astrat, "apply"),
        compute_strategies=cstrat, apply_strategies=astrat,
        apply_out_specs=tuple(map(self._spec_at, self._apply_out_refs)),
        micro_out_specs=tuple(map(self._spec_at, self._micro_out_refs)),
        objective=self.true_objective(),
        status=status,
        solver=solver_name, seconds=seconds,
        num_variables=self.num_variables,
        num_constraints=self.num_constraints, collectives=tuple(colls),
        memory=self._memory_at_solution(), stage_times=self.stage_times(),
        region_in_specs={part: {i: {k: self.nodes[node].specs[self._chosen(node)][pos]
                                    for k, (node, pos) in ins.items()}
                                for i, ins in regions.items()}
                         for part, regions in self._region_ins.items()})

  # -- solving again with pins (plan.explain, plan.cost_if) ---------------------------

  def pin_choices(self, leaf: int, spec: Spec, choices=None) -> list[int]:
    """The choices of leaf ``leaf``'s node (or of ``choices``, ``(planned
    spec, batch dim)`` pairs) that give it ``spec``, a spec over every mesh
    axis read as a pin is (the batch axes ahead of the planned ones in the
    dimension both split): empty if none does, as for a spec whose
    batch-axis part these batch axes cannot give."""
    rank = len(self.leaf_avals[leaf].shape)
    spec = tuple(tuple(e) for e in spec) + ((),) * (rank - len(spec))
    spec = without_unit_axes(spec, self.sizes)     # (they split nothing)
    if choices is None:
      choices = self.nodes[self.leaf_nodes[leaf]].choices
    out = []
    for c, (planned, dim) in enumerate(choices):
      batch_dim = 0 if self.batch_leaves[leaf] else dim
      full = tuple((self.S if d == batch_dim else ()) + tuple(e)
                   for d, e in enumerate(planned))
      if without_unit_axes(full, self.sizes) == spec:
        out.append(c)
    return out

  def sharing(self, leaf: int) -> list[int]:
    """The leaves whose nodes share their variables with leaf ``leaf``'s
    (itself included, see :meth:`_classes`): pinning one pins them all."""
    xs = self.nodes[self.leaf_nodes[leaf]].vars
    return [k for k, n in enumerate(self.leaf_nodes) if self.nodes[n].vars is xs]

  def solve_pinned(self, pins: Mapping[int, Spec], time_limit: float = 60.0, *,
                   above: float | None = None) -> Solution | None:
    """The solution of this problem with leaf ``k`` held to ``pins[k]``
    (see :meth:`pin_choices`), after :meth:`solve`; None if ``above`` is
    given and the pinned problem's LP relaxation (a lower bound) already
    costs at least that.

    Each pin holds the variables of its node's other choices at 0 (their
    upper bound) for the solve; the bounds, and the roofline terms the
    objective takes (:meth:`_solve`), are restored after it, so the problem
    is again the one solved and each pinned solve's answer depends on its
    pins alone. Its last solution is the pinned one:
    :meth:`solution` reads that. Nothing is built again: without a memory
    budget the LP relaxation is solved first, from the basis of the last
    one (HiGHS's dual simplex, a few iterations; PuLP 3, ``lp.RESOLVES``),
    and where it is integral it is the solution; else, with a budget, and
    under PuLP 4, the problem is solved as :meth:`solve` does. A leaf's
    variables are its class's (:meth:`sharing`): the pin holds every leaf
    of the class. The memory budget's peaks added while solving stay (each
    holds for any plan within the budget).

    Raises:
      PlanError: a pin that no choice of its leaf meets, two pins of one
        class that disagree, or no solution with the pins.
    """
    return self.solution() if self._solve_held(pins, time_limit, above) else None

  def price_pinned(self, pins: Mapping[int, Spec], time_limit: float = 60.0
                   ) -> tuple[float, dict]:
    """(objective, :meth:`stage_times`) of this problem solved with the
    leaves held to ``pins`` as :meth:`solve_pinned` holds them, the rest of
    the solution not read: a preset's layout priced on the problem planning
    built over the same program (``shard.price_layout``)."""
    self._solve_held(pins, time_limit)
    return self.true_objective(), self.stage_times()

  def _solve_held(self, pins: Mapping[int, Spec], time_limit: float,
                  above: float | None = None) -> bool:
    """Solves with the pins (:meth:`solve_pinned`); False where ``above``
    bounds the relaxation and nothing was solved."""
    held: dict[int, tuple[list, set[int]]] = {}
    for k, spec in pins.items():
      name = self.leaf_names[k] if k < len(self.leaf_names) else f"leaf {k}"
      allowed = set(self.pin_choices(k, spec))
      if not allowed:
        raise PlanError(
            f"autopar: {name} cannot be held to {spec} in this problem: with the "
            f"batch over {self.S or 'no axes'}, its choices give it none such. Fix: "
            f"a spec whose batch axes {self.S} come first in the one dimension they "
            f"split, or plan again with the pin (AutoShardingOption(pins=...)).")
      xs = self.nodes[self.leaf_nodes[k]].vars
      if id(xs) in held:
        allowed &= held[id(xs)][1]
        if not allowed:
          raise PlanError(
              f"autopar: {name} shares its choice with other leaves of its class "
              f"({len(self.sharing(k))} leaves), and the pins give them different "
              f"specs. Fix: pin the leaves of one class alike, or plan again with "
              f"the pins (AutoShardingOption(pins=...)).")
      held[id(xs)] = (xs, allowed)
    fixed = [(x, x.lowBound, x.upBound) for xs, allowed in held.values()
             for c, x in enumerate(xs) if c not in allowed]
    regime = dict(self._regime)
    t0 = time.perf_counter()
    relaxed = self._relaxation() if self.memory_budget is None and lp.RESOLVES else None
    if relaxed is not None:
      status = lp.resolve(self.prob, relaxed, [(x, low, 0) for x, low, _ in fixed])
      if status is not None and status.optimal:
        self._status, self._chosen_memo, self._own_peak = status, {}, None
        held = all((b > f) == (self._regime[p] == "memory")
                   for p, (f, b) in self._roofline_values().items())
        if self._integral() and held:
          self._solved = (status.name, "HiGHS", time.perf_counter() - t0)
          return True
        if above is not None and (lp.value(self.prob.objective) or 0.0) + \
            self.sync_latency >= above:
          return False
    try:
      for x, low, _ in fixed:
        lp.set_bounds(x, low, 0)
      try:
        self.solve(max(1.0, time_limit - (time.perf_counter() - t0)))
      except PlanError as e:
        names = ", ".join(self.leaf_names[k] if k < len(self.leaf_names) else
                          f"leaf {k}" for k in pins)
        raise PlanError(f"autopar: no plan of this problem holds {names} to the "
                        f"spec(s) pinned: {e}") from None
      return True
    finally:
      for x, low, up in fixed:
        lp.set_bounds(x, low, up)
      if self._regime != regime:
        # Each pinned solve starts from the roofline terms planning
        # settled on, so that its answer does not depend on the solves
        # before it (nor does a problem restored from a plan's JSON's).
        self._regime = regime
        self._set_objective()

  def _relaxation(self):
    """The HiGHS model of this problem's LP relaxation, solved (once; kept
    for :meth:`solve_pinned` to start from its basis); None where the
    solver keeps no model (``lp.resolve``)."""
    if getattr(self, "_relaxed", None) is None:
      lp.solve(self.prob, _solver(relax=True)[0])
      self._relaxed = getattr(self.prob, "solverModel", None)
    return self._relaxed

# Solves at most this many times more to hold the memory budget at the
# plan's own peaks (each adds up to four of them, those over the budget, as
# constraints).
_BUDGET_ROUNDS = 2
