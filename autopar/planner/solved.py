"""What a ``ShardParallel`` plan keeps of the ILPs it was solved with, so
that ``plan.explain`` and ``plan.cost_if`` solve them again with leaves
pinned (``replan.py``), in this process or in another one that read the
plan from JSON or from the plan cache.

* :class:`PlanTemplate`: what turns a solution of the step's ILP into its
  :class:`~autopar.plan.Plan` (the step's leaves, gradients and outputs,
  its program's equations as the plan names them, the method's settings):
  everything a plan says that no choice changes, as data. The planner
  makes every plan through one (``shard.plan_template``), so a plan made
  again from a saved template is made by the same code.
* :class:`SolvedProblem`: a solved :class:`~autopar.planner.ilp.ShardingProblem`
  (one choice of batch axes), its objective and its template.
* :func:`encode` / :func:`decode`: the problems as the text ``Plan.to_json``
  saves under ``"ilp"``: JSON (each problem's graph, ``ilp_saved.py``, and
  its template; shapes, specs and repeated lists written once) compressed
  with xz (zlib where Python has no lzma), in base64. Never an array, never
  a function: a plan read in a fresh process, with no step, is solved
  again from it alone.

A saved problem is read only by the autopar that wrote it (the same version
and sources, ``cache.planner_digest``): its costs are the cost model's, and
another autopar would price the pins with another model than the plan's.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import math
import threading
import time
import zlib
from typing import Any, Mapping, Sequence

try:
  import lzma
except ImportError:          # a Python built without liblzma: zlib instead
  lzma = None

from jax.sharding import PartitionSpec

from autopar.gc_pause import gc_paused
from autopar.costs.strategies import (batch_spec, local_bytes, to_partition_spec,
                                      without_unit_axes)
from autopar.errors import PlanError
from autopar.frontend.hints import entry_axes
from autopar.planner.ilp import ShardingProblem
from autopar.planner.ilp_saved import Aval, Reader, Writer
from autopar.plan import (CollectivePlan, Plan, SolverStats, ValuePlan, grad_stage_label,
                          spec_from_json, spec_to_json, sync_stage_name)
from autopar.version import __version__

__all__ = ["PlanTemplate", "Program", "SolvedProblem", "encode", "decode",
           "predicted_time", "spec_axes", "with_batch_dim", "divisible_dim", "ILP_FORMAT",
           "READ_FIX"]

# The version of the saved problems' layout (``encode``): problems saved in
# another are not read (``decode`` says so, and the fix).
ILP_FORMAT = 1

# What every error of ``decode`` ends with.
READ_FIX = ("Fix: make the plan again with this autopar (step.plan(*args), or "
            "`autopar plan`) and save it again.")

# No spec: what a value a solution gives no spec is made in (``Program``).
_NONE = object()


@dataclasses.dataclass(frozen=True)
class Program:
  """The equations of one part of the step (``"compute"`` or ``"apply"``)
  as the plan names its intermediate values (``Plan.intermediates``).

  Values are numbered: first the part's inputs that the plan gives a spec
  (its leaves, then for ``apply`` the gradients), then the outputs of each
  equation in ``eqns`` in order.

  Attributes:
    num_inputs: how many of the part's inputs are numbered.
    eqns: per equation a solution gives output specs for, in path order:
      (its path, the aval of each output, and for an equation with a
      strategy (value number or -1, aval) per operand, else None).
    regions: (loop path, key, aval) of what enters a loop (``"in<k>"`` a
      carry, ``"x<k>"`` each trip's slice of a scanned operand) that is
      not a literal, in the order the solution gives them.
  """
  num_inputs: int
  eqns: tuple[tuple[str, tuple[Aval, ...], tuple[tuple[int, Aval], ...] | None], ...]
  regions: tuple[tuple[str, str, Aval], ...]

  def intermediates(self, part: str, inputs: Sequence, specs: Mapping,
                    strategies: Mapping, region_specs: Mapping) -> list[ValuePlan]:
    """The plan's intermediates of this part under a solution: each
    equation's outputs in their specs, each operand a strategy needs in
    another spec than it is made in (where the plan reshards it), and what
    enters each loop. ``inputs``: the specs of the numbered inputs."""
    # The spec each numbered value is made in (_NONE: none, as for an
    # output a solution gives no spec).
    produced: list = list(inputs[:self.num_inputs])
    produced += [_NONE] * (self.num_inputs - len(produced))
    for i, avals, _ in self.eqns:
      outs = specs[i]
      produced += list(outs[:len(avals)]) + [_NONE] * (len(avals) - len(outs))
    out = []
    for i, avals, operands in self.eqns:
      for j, (aval, s) in enumerate(zip(avals, specs[i])):
        out.append(ValuePlan(f"{part}/{i}/{j}", aval.shape, aval.dtype,
                             to_partition_spec(s)))
      st = strategies.get(i)
      for k, (value, aval) in enumerate(operands if st is not None else ()):
        need = st.in_specs[k]
        if need is not None and value >= 0 and produced[value] is not _NONE and \
            produced[value] != need:
          # Resharded on this edge: pin the operand where the plan reshards it.
          out.append(ValuePlan(f"{part}/{i}/in{k}", aval.shape, aval.dtype,
                               to_partition_spec(need)))
    for i, key, aval in self.regions:
      need = region_specs.get(i, {}).get(key)
      if need is not None:
        out.append(ValuePlan(f"{part}/{i}/{key}", aval.shape, aval.dtype,
                             to_partition_spec(need)))
    return out

  def to_data(self, w: Writer) -> dict:
    return {"num_inputs": self.num_inputs,
            "eqns": w.shared([[i, [w.aval(a) for a in avals],
                               None if ops is None else [[v, w.aval(a)] for v, a in ops]]
                              for i, avals, ops in self.eqns]),
            "regions": [[i, key, w.aval(a)] for i, key, a in self.regions]}

  @classmethod
  def from_data(cls, d: Mapping, r: Reader) -> "Program":
    return cls(d["num_inputs"],
               tuple((i, tuple(map(r.aval, avals)),
                      None if ops is None else tuple((v, r.aval(a)) for v, a in ops))
                     for i, avals, ops in r.shared(d["eqns"])),
               tuple((i, key, r.aval(a)) for i, key, a in d["regions"]))


@dataclasses.dataclass(frozen=True)
class PlanTemplate:
  """What turns a solution of a step's ILP into its :class:`Plan`
  (:meth:`plan`): everything the plan says that no choice changes.

  Attributes:
    method: the method's name. axis_names, sizes: the mesh's.
    num_micro_batches: n.
    prefer_reduce_scatter: ZeRO-2's gradients and optimizer state
      (``AutoShardingOption.prefer_reduce_scatter``).
    costs: the costs assumed (``Plan.costs``). grad_inputs: ``Plan.grad_inputs``.
    has_marker: whether the step has a grad marker (a gradient sync).
    leaves: (path, shape, dtype, is batch data) per argument leaf, at the
      whole batch.
    read: the leaves the gradient computation reads.
    pins: leaf index -> the user's pin, as written (``check_pins``).
    grads: (name, aval) per gradient, at the whole batch.
    outputs: per output leaf: (path, aval, kind: "apply" (apply_grad's),
      "concat" (rows joined over the batch), "other"; its index in its
      part's outputs, the dimension its rows are in, the donated leaf it
      replaces or None).
    programs: part -> its :class:`Program`.
    grad_sync: ``Plan.grad_sync``.
  """
  method: str
  axis_names: tuple[str, ...]
  sizes: Mapping[str, int]
  num_micro_batches: int
  prefer_reduce_scatter: bool
  costs: Mapping[str, Any]
  grad_inputs: tuple[str, ...]
  has_marker: bool
  leaves: tuple[tuple[str, tuple[int, ...], str, bool], ...]
  read: frozenset[int]
  pins: Mapping[int, PartitionSpec]
  grads: tuple[tuple[str, Aval], ...]
  outputs: tuple[tuple[str, Aval, str, int, int | None, int | None], ...]
  programs: Mapping[str, Program]
  grad_sync: str = "last"

  def plan(self, S: Sequence[str], sol, stats: Mapping[str, int],
           timings: Mapping[str, float], *, in_tree=None, mesh=None) -> Plan:
    """The :class:`Plan` of the solution ``sol``
    (:class:`~autopar.planner.ilp.Solution`) with batch axes ``S``;
    ``stats``: the problem's size (``SolverStats``), ``timings`` the
    planning's; ``in_tree`` and ``mesh`` as ``Plan`` takes them (None in a
    plan read back: it has neither until it is applied)."""
    sizes = dict(self.sizes)
    S = tuple(S)
    n = self.num_micro_batches

    def with_batch(spec):
      first = S + tuple(spec[0]) if spec else S
      return to_partition_spec((first, *spec[1:]))

    leaf_dims = list(sol.leaf_batch_dims)
    # The ILP plans the reductions over the rows apply_grad takes (combine.py)
    # as it plans gradients; the plan's gradients are the gradients.
    grad_specs = sol.grad_specs[:len(self.grads)]
    grad_dims = [None] * len(grad_specs)
    d_batch = math.prod(sizes[a] for a in S)
    if self.prefer_reduce_scatter and d_batch > 1:
      # ZeRO-2: gradients reduce-scattered over the batch axes and the optimizer
      # state (what compute_grad does not read) split over them too; the
      # updated parameters are all-gathered, so the bytes equal an all-reduce.
      for k, ((_, shape, _, is_batch), spec) in enumerate(zip(self.leaves,
                                                              sol.leaf_specs)):
        if leaf_dims[k] is None and not is_batch and k not in self.read:
          leaf_dims[k] = divisible_dim(shape, spec, d_batch, sizes)
      for g, ((_, a), spec) in enumerate(zip(self.grads, grad_specs)):
        grad_dims[g] = divisible_dim(a.shape, spec, d_batch, sizes)

    in_specs = [with_batch(s) if leaf[3] else with_batch_dim(s, dim, S)
                for leaf, s, dim in zip(self.leaves, sol.leaf_specs, leaf_dims,
                                        strict=True)]
    # A pin stays as the user wrote it: the ILP, which plans the axes of size
    # > 1 alone, meets it up to the axes of size 1 it names (they split
    # nothing).
    for k, pin in self.pins.items():
      if without_unit_axes(spec_axes(pin), sizes) == \
          without_unit_axes(spec_axes(in_specs[k]), sizes):
        in_specs[k] = pin
    inputs = tuple(ValuePlan(path, shape, dtype, s)
                   for (path, shape, dtype, _), s in zip(self.leaves, in_specs,
                                                        strict=True))
    grads = tuple(ValuePlan(name, a.shape, a.dtype, with_batch_dim(s, dim, S))
                  for (name, a), s, dim in zip(self.grads, grad_specs, grad_dims,
                                               strict=True))
    batch_entry = None if not S else S[0] if len(S) == 1 else S
    outputs = []
    for path, aval, kind, idx, dim, pair in self.outputs:
      if pair is not None:
        spec = in_specs[pair]
      elif kind == "apply":
        s = sol.apply_out_specs[idx]
        spec = to_partition_spec(s) if s is not None else PartitionSpec()
      elif kind == "concat":
        spec = batch_spec(len(aval.shape), dim, batch_entry)
      else:
        spec = PartitionSpec()
      outputs.append(ValuePlan(path, aval.shape, aval.dtype, spec))

    inter = []
    for part, specs, strategies in (
        ("compute", sol.compute_specs, sol.compute_strategies),
        ("apply", sol.apply_specs, sol.apply_strategies)):
      inter += self.programs[part].intermediates(
          part, (*sol.leaf_specs, *sol.grad_specs), specs, strategies,
          sol.region_in_specs.get(part, {}))

    colls = {}
    grad_stage = grad_stage_label(n)
    for part, kind, axes, b, mult in sol.collectives:
      stage = grad_stage if part == "compute_grad" else part
      key = (stage, kind, axes, mult)
      colls[key] = colls.get(key, 0.0) + b
    collectives = [CollectivePlan(stage=k[0], kind=k[1], axes=k[2], bytes=int(b),
                                  per_step=k[3], what="activations / partial sums")
                   for k, b in colls.items()]
    if d_batch > 1 and self.has_marker:
      # Operand bytes: the gradient as each device holds it before the sync.
      gb = sum(local_bytes(a, s, sizes) for (_, a), s in zip(self.grads, grad_specs))
      scattered = any(dim is not None for dim in grad_dims)
      collectives.append(CollectivePlan(
          stage=sync_stage_name(n, self.grad_sync),
          kind="reduce-scatter" if scattered else "all-reduce", axes=S,
          bytes=int(gb), per_step=1, what="gradients"))
    solver = SolverStats(solver=sol.solver, status=sol.status, seconds=sol.seconds,
                         num_variables=sol.num_variables,
                         num_constraints=sol.num_constraints, **stats,
                         timings=dict(timings))
    return Plan(method=self.method, mesh_axis_names=self.axis_names,
                mesh_shape=tuple(sizes.values()), num_micro_batches=n,
                batch_axes=S, inputs=inputs, grads=grads, outputs=tuple(outputs),
                intermediates=tuple(inter), collectives=tuple(collectives),
                memory_per_device=int(sol.memory), objective=sol.objective,
                solver=solver, costs=dict(self.costs), grad_inputs=self.grad_inputs,
                predicted_time=predicted_time(sol.stage_times), grad_sync=self.grad_sync,
                in_tree=in_tree, mesh=mesh)

  def to_data(self, w: Writer) -> dict:
    return {
        "head": w.shared({
            "method": self.method, "axis_names": list(self.axis_names),
            "sizes": [[a, s] for a, s in self.sizes.items()],
            "num_micro_batches": self.num_micro_batches,
            "prefer_reduce_scatter": self.prefer_reduce_scatter,
            "costs": dict(self.costs), "grad_inputs": list(self.grad_inputs),
            "has_marker": self.has_marker, "grad_sync": self.grad_sync,
            "leaves": [[p, list(s), d, b] for p, s, d, b in self.leaves],
            "read": sorted(self.read),
            "pins": [[k, spec_to_json(s)] for k, s in self.pins.items()],
            "grads": [[name, w.aval(a)] for name, a in self.grads],
            "outputs": [[p, w.aval(a), kind, idx, dim, pair]
                        for p, a, kind, idx, dim, pair in self.outputs]}),
        "programs": {part: p.to_data(w) for part, p in self.programs.items()}}

  @classmethod
  def from_data(cls, d: Mapping, r: Reader) -> "PlanTemplate":
    h = r.shared(d["head"])
    return cls(
        method=h["method"], axis_names=tuple(h["axis_names"]),
        sizes={a: s for a, s in h["sizes"]},
        num_micro_batches=h["num_micro_batches"],
        prefer_reduce_scatter=h["prefer_reduce_scatter"], costs=h["costs"],
        grad_inputs=tuple(h["grad_inputs"]), has_marker=h["has_marker"],
        grad_sync=h.get("grad_sync", "last"),
        leaves=tuple((p, tuple(s), dt, b) for p, s, dt, b in h["leaves"]),
        read=frozenset(h["read"]),
        pins={k: spec_from_json(s) for k, s in h["pins"]},
        grads=tuple((name, r.aval(a)) for name, a in h["grads"]),
        outputs=tuple((p, r.aval(a), kind, idx, dim, pair)
                      for p, a, kind, idx, dim, pair in h["outputs"]),
        programs={part: Program.from_data(p, r) for part, p in d["programs"].items()})


def with_batch_dim(spec, dim, batch_axes) -> PartitionSpec:
  """``spec`` (the ILP's, over the planned axes) with dimension ``dim`` also
  split over ``batch_axes`` ahead of them (a state leaf's ZeRO/FSDP
  split); as it is where ``dim`` is None."""
  if dim is None:
    return to_partition_spec(spec)
  spec = list(spec)
  spec[dim] = tuple(batch_axes) + tuple(spec[dim])
  return to_partition_spec(tuple(spec))


def divisible_dim(shape, spec, d_batch, sizes) -> int | None:
  """First dim that can also be split over the batch axes, if any."""
  for dim, n in enumerate(shape):
    if n % (d_batch * math.prod(sizes[a] for a in spec[dim])) == 0:
      return dim
  return None


def predicted_time(times: dict) -> dict:
  """A plan's predicted seconds per step by stage, from
  ``ShardingProblem.stage_times``: ``"gradient"`` (every micro-batch's
  gradient stage together, the gradient sync and ZeRO's gathers
  included) and ``"apply"``, each with its ``flops``, ``memory`` (traffic
  over bandwidth), ``roofline`` (the larger) and ``collectives``
  seconds, and ``total``; the gradient's ``passes`` too, the seconds of
  ``zero_grad`` and ``sync_grad`` (``grad_sync="apart"``), stages of their
  own added to its total."""
  grad = dict(times["compute"])
  grad["collectives"] += times["sync"] + times["state"]
  grad["passes"] = times.get("passes", 0.0)
  grad["total"] = grad["roofline"] + grad["collectives"] + grad["passes"]
  return {"gradient": grad, "apply": dict(times["apply"])}


class SolvedProblem:
  """An ILP solved while planning a ``ShardParallel`` step, kept with the
  plan (``Plan.replan``) so that ``plan.explain`` and ``plan.cost_if`` solve
  it again with leaves pinned, tracing and building nothing: the solved
  :class:`~autopar.planner.ilp.ShardingProblem` of one choice of batch axes
  (the planner's, or one restored from a plan's JSON), its objective, and
  the :class:`PlanTemplate` that turns another of its solutions into a
  :class:`Plan` (never an array, never the step).

  A pin holds the leaf's whole class (the leaves that share its variables,
  :meth:`sharing`): the problem is solved as built, repeated layers alike.

  Args:
    problem: the solved problem. objective: its objective at planning.
    template: its plans' template. stats: its size (``SolverStats``).
    in_tree, mesh: what its plans are made with (``PlanTemplate.plan``).
  """

  def __init__(self, problem: ShardingProblem, objective: float,
               template: PlanTemplate, stats: Mapping[str, int], *, in_tree=None,
               mesh=None):
    self.problem = problem
    self.objective = objective
    self.template = template
    self.stats = dict(stats)
    self.batch_axes = tuple(problem.S)
    self.in_tree = in_tree
    self.mesh = mesh
    self._index = {leaf[0]: k for k, leaf in enumerate(template.leaves)}
    self._lock = threading.Lock()      # one solve at a time: the problem is shared

  @property
  def kept_axes(self) -> tuple[str, ...]:
    """The planned axes whose splits the problem kept from a plan over
    fewer axes (``extend_model_axes``); () if it chose over all of them."""
    return tuple(self.problem.keep[0]) if self.problem.keep is not None else ()

  def can_pin(self, path: str, spec: PartitionSpec) -> bool:
    """Whether some choice of the leaf ``path`` gives it ``spec``."""
    return bool(self.problem.pin_choices(self._index[path], spec_axes(spec)))

  def pinned(self, path: str) -> bool:
    """Whether the method's pins (``AutoShardingOption(pins=...)``) hold
    the leaf ``path``."""
    return self._index[path] in self.problem.pins

  def sharing(self, path: str) -> tuple[str, ...]:
    """The leaves pinned with ``path`` (its class, itself first)."""
    names = self.problem.leaf_names
    k = self._index[path]
    return (path, *(names[j] for j in self.problem.sharing(k) if j != k))

  def plan(self, pins: Mapping[str, PartitionSpec], time_limit: float = 60.0, *,
           above: float | None = None) -> Plan | None:
    """The plan of the problem solved again with ``pins`` (leaf path ->
    spec over every mesh axis); PlanError if no plan has them; None if
    ``above`` is given and no plan with them can cost less
    (``ShardingProblem.solve_pinned``)."""
    t0 = time.perf_counter()
    held = {self._index[path]: spec_axes(spec) for path, spec in pins.items()}
    with self._lock:
      sol = self.problem.solve_pinned(held, time_limit, above=above)
    if sol is None:
      return None
    return self.template.plan(self.batch_axes, sol, self.stats,
                              {"solve": sol.seconds, "total": time.perf_counter() - t0},
                              in_tree=self.in_tree, mesh=self.mesh)

  def to_data(self, w: Writer) -> dict:
    with self._lock:
      return {"objective": self.objective, "stats": self.stats,
              "problem": self.problem.to_data(w), "template": self.template.to_data(w)}

  @classmethod
  def from_data(cls, d: Mapping, r: Reader) -> "SolvedProblem":
    return cls(ShardingProblem.from_data(d["problem"], r), d["objective"],
               PlanTemplate.from_data(d["template"], r), d["stats"])


def spec_axes(spec) -> tuple[tuple[str, ...], ...]:
  """A PartitionSpec as the ILP writes specs: the axes of each dimension."""
  return tuple(entry_axes(e) for e in spec)


def encode(problems: Sequence[SolvedProblem], source: str) -> str:
  """The problems as the text ``Plan.to_json`` saves (see the module
  docstring); ``source``: the digest of autopar's sources
  (``cache.planner_digest``)."""
  w = Writer()
  with gc_paused():
    problems = [p.to_data(w) for p in problems]
    data = {"format": ILP_FORMAT, "autopar": __version__, "source": source,
            "tables": w.tables(), "problems": problems}
    raw = json.dumps(data, separators=(",", ":")).encode()
  if lzma is not None:
    # xz's preset 3 (a 4 MiB window) finds the problems' likeness to each
    # other: on the 24-layer GPT of benchmark/explain.py a third of zlib's
    # size, in about the time zlib takes.
    return "xz:" + base64.b64encode(lzma.compress(raw, preset=3)).decode("ascii")
  return "zlib:" + base64.b64encode(zlib.compress(raw, 6)).decode("ascii")


def decode(text: str, source: str) -> tuple[SolvedProblem, ...]:
  """The problems :func:`encode` wrote.

  Raises:
    PlanError: they cannot be read: another autopar wrote them (its
      version, or its sources: ``source`` is this one's digest), or the
      text is corrupt; the message says which and the fix.
  """
  fix = READ_FIX
  how, _, body = text.partition(":")
  if how == "xz" and lzma is None:
    raise PlanError("the plan's saved ILPs are compressed with xz, and this Python "
                    "has no lzma module. Fix: use a Python built with liblzma, or "
                    "make the plan again here.")
  try:
    packed = base64.b64decode(body.encode("ascii"), validate=True)
    if how == "xz":
      raw = lzma.decompress(packed)
    elif how == "zlib":
      raw = zlib.decompress(packed)
    else:
      raise ValueError(f"unknown compression {how!r}")
    with gc_paused():
      data = json.loads(raw)
  except (binascii.Error, zlib.error, ValueError, UnicodeError,
          *((lzma.LZMAError,) if lzma is not None else ())) as e:
    raise PlanError(f"the plan's saved ILPs (its \"ilp\" entry) are corrupt "
                    f"({type(e).__name__}: {e}). {fix}") from None
  if not isinstance(data, dict) or data.get("format") != ILP_FORMAT:
    got = data.get("format") if isinstance(data, dict) else None
    raise PlanError(f"the plan's saved ILPs are in format {got!r}; this autopar "
                    f"reads format {ILP_FORMAT}. {fix}")
  if data.get("autopar") != __version__ or data.get("source") != source:
    raise PlanError(
        f"the plan's saved ILPs were written by autopar {data.get('autopar')} "
        f"(sources {data.get('source')}), and this is autopar {__version__} (sources "
        f"{source}): their costs are another cost model's, so solving them again "
        f"here could price the pins differently from the plan. {fix}")
  try:
    r = Reader(data["tables"])
    with gc_paused():
      return tuple(SolvedProblem.from_data(p, r) for p in data["problems"])
  except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
    raise PlanError(f"the plan's saved ILPs are incomplete or corrupt "
                    f"({type(e).__name__}: {e}). {fix}") from None
