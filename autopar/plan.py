"""The sharding plan: what autopar decided, as plain data.

A :class:`Plan` is frozen and printable. It records, for one step on one
mesh, the sharding of every input, output and gradient (and, for solver-made
plans, of intermediate values), the collectives the plan implies, an
estimate of per-device memory, the objective, and solver statistics. It
round-trips through JSON, so a plan made on a laptop for an abstract mesh can
be saved, read, and later given back to ``ShardParallel(plan=...)``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
from typing import Any, Mapping, Protocol, Sequence

import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from autopar.costs.cost_model import bytes_per_device
from autopar.errors import PlanError
from autopar.text import axes_str, format_bytes, format_rows, spec_str

__all__ = ["Plan", "ValuePlan", "CollectivePlan", "SolverStats", "StagePlan",
           "spec_to_json", "spec_from_json", "spec_str", "format_bytes", "PlanReader",
           "use_reader", "plan_constraints", "grad_stage_names", "grad_stage_label",
           "sync_stage_name", "ZERO_STAGE", "SYNC_STAGE", "SavedILPs"]


class PlanReader(Protocol):
  """What reads a plan for a person (``autopar.tools``): ``Plan.summary``,
  ``explain``, ``cost_if``, ``check`` and ``to_html`` call it, so that the
  data type imports no tool."""

  def summary(self, plan: "Plan") -> str: ...
  def explain(self, plan: "Plan", path: str) -> Any: ...
  def cost_if(self, plan: "Plan", pins: Any) -> Any: ...
  def check(self, plan: "Plan", executable: Any) -> Any: ...
  def to_html(self, plan: "Plan", title: str) -> str: ...
  def stage_table(self, plan: "Plan") -> list[str]: ...


# Process-wide, set once: autopar.tools registers itself when imported
# (``autopar/__init__.py`` imports it before any plan is read).
_READER: list[PlanReader] = []


def use_reader(reader: PlanReader) -> None:
  """Makes ``reader`` the one plans' reading methods call."""
  _READER[:] = [reader]


def _reader() -> PlanReader:
  if not _READER:
    raise PlanError("Plan: reading a plan (summary, explain, cost_if, check, to_html) "
                    "needs autopar.tools. Fix: import autopar (it imports the tools).")
  return _READER[0]

PLAN_FORMAT = 2     # 2: plans carry their fingerprint


class SavedILPs:
  """``Plan.replan`` of a plan read from JSON: the text of the ILPs it was
  solved with, as ``Plan.to_json`` saved it (its ``"ilp"`` entry:
  ``autopar.planner.solved.encode``), and for a plan ``cost_if`` made the
  pins it added (``"ilp_pins"``). ``autopar.planner.replan`` reads the text
  on the plan's first ``explain`` or ``cost_if`` and keeps what it read in
  ``read``, which every copy of the plan shares."""

  def __init__(self, text: str, pins: Mapping[str, PartitionSpec] | None = None):
    self.text = text
    self.pins = dict(pins or {})
    self.read: Any = None
    self.lock = threading.Lock()

  def to_json(self) -> dict:
    return {"ilp": self.text, **({"ilp_pins": {k: spec_to_json(v) for k, v in
                                               self.pins.items()}} if self.pins else {})}


def spec_to_json(spec: PartitionSpec | Sequence) -> list:
  out = []
  for entry in spec:
    if entry is None or isinstance(entry, str):
      out.append(entry)
    else:
      out.append(list(entry))
  return out


def spec_from_json(entries: Sequence) -> PartitionSpec:
  return PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in entries))


@dataclasses.dataclass(frozen=True)
class ValuePlan:
  """The sharding of one value: a pytree leaf, a gradient or an intermediate."""
  name: str
  shape: tuple[int, ...]
  dtype: str
  spec: PartitionSpec

  def bytes_per_device(self, axis_sizes: Mapping[str, int]) -> int:
    return bytes_per_device(self.shape, self.dtype, self.spec, axis_sizes)

  def to_json(self, spec_json: list | None = None) -> dict:
    """As a dict for JSON; ``spec_json``: ``spec_to_json(self.spec)``, if the
    caller has it."""
    return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype,
            "spec": spec_to_json(self.spec) if spec_json is None else spec_json}

  @classmethod
  def from_json(cls, d: Mapping, spec: PartitionSpec | None = None) -> "ValuePlan":
    """From a dict of :meth:`to_json`; ``spec``: its spec, if the caller has it."""
    return cls(name=d["name"], shape=tuple(d["shape"]), dtype=d["dtype"],
               spec=spec_from_json(d["spec"]) if spec is None else spec)


@dataclasses.dataclass(frozen=True)
class CollectivePlan:
  """A collective the plan implies.

  ``bytes`` is the per-device operand size; ``per_step`` how many times it
  runs in one training step (micro-batches included). ``submesh``: in a
  pipeline, the shape of the stage's submesh, over whose axis sizes
  ``axes`` run; () for the plan's whole mesh.
  """
  stage: str
  kind: str
  axes: tuple[str, ...]
  bytes: int
  per_step: int
  what: str
  submesh: tuple[int, ...] = ()

  def to_json(self) -> dict:
    d = dataclasses.asdict(self) | {"axes": list(self.axes)}
    if self.submesh:
      d["submesh"] = list(self.submesh)
    else:
      del d["submesh"]
    return d

  @classmethod
  def from_json(cls, d: Mapping) -> "CollectivePlan":
    return cls(stage=d["stage"], kind=d["kind"], axes=tuple(d["axes"]),
               bytes=int(d["bytes"]), per_step=int(d["per_step"]), what=d["what"],
               submesh=tuple(d.get("submesh", ())))


@dataclasses.dataclass(frozen=True)
class SolverStats:
  """How the plan was found.

  Attributes:
    solver, status: the ILP solver and its final status.
    seconds: the solver's time for the chosen batch axes.
    num_variables, num_constraints: the chosen problem's size.
    num_equations: equations in compute_grad + apply_grad.
    num_nodes: ILP nodes after merging elementwise equations into their
      operands (plus one per argument leaf and gradient).
    num_classes: node classes after sharing repeated layers (variable sets).
    timings: seconds per planning stage ("trace", "strategies", "classes",
      "build", "solve", "total"), summed over every batch-axes choice tried.
  """
  solver: str
  status: str
  seconds: float
  num_variables: int = 0
  num_constraints: int = 0
  num_equations: int = 0
  num_nodes: int = 0
  num_classes: int = 0
  timings: Mapping[str, float] = dataclasses.field(default_factory=dict)

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    d["timings"] = dict(self.timings)
    return d

  @classmethod
  def from_json(cls, d: Mapping) -> "SolverStats":
    return cls(**d)


@dataclasses.dataclass(frozen=True)
class StagePlan:
  """One pipeline stage of a ``PipeshardParallel`` plan.

  Attributes:
    index: the stage's number (0 first).
    layers: the first and one past the last layer it runs (of the layers the
      forward pass was cut into).
    params: the argument leaves (parameters) its layers read, by path.
    submesh_offset, submesh_shape: its sub-block of the mesh (the flattened
      index of its first device, and its shape).
    batch_axes: the submesh axes its micro-batches' rows are split over.
    inputs: the leaves it holds, with their specs on its submesh.
    time_per_micro_batch: predicted forward + backward time of one
      micro-batch (s); time_per_step: predicted gradient sync and update (s).
    memory_per_device: predicted bytes per device (state, gradients, the
      activations of the micro-batches it holds under the schedule).
    in_flight: how many micro-batches' activations it holds at most.
    bytes_to_next: bytes of activations it sends per micro-batch (all
      devices), and send_seconds the predicted time to send them.
    zero_state: its optimizer state (what only its update reads) is split
      over its batch axes (ZeRO-2), where the stage's ILP chose so (under a
      memory budget: it costs a gather of the updated values each step).
    zero_params: its parameters are split over its batch axes too (ZeRO-3),
      gathered by each pass that reads them, for every micro-batch.
    root_specs, grad_specs: per value the stage's passes read from outside
      it (its roots: parameters, constants), its spec there and its
      gradient's (the stage's ILP's); pins: per pass (forward, backward),
      equation path -> {output number: spec}, the intermediate shardings
      the ILP chose. The three hold for the step the plan was made for
      (its ``fingerprint``: program, arguments, mesh, the method's
      settings), and are followed only for that step.
    first_pass_seconds: where the loss's gradient reads sums over the
      batch that depend on the parameters, a first pass runs the forward
      passes alone before the schedule; the predicted time of this stage's
      for one micro-batch (0: it runs none).
  """
  index: int
  layers: tuple[int, int]
  params: tuple[str, ...]
  submesh_offset: int
  submesh_shape: tuple[int, ...]
  batch_axes: tuple[str, ...]
  inputs: tuple[ValuePlan, ...]
  time_per_micro_batch: float
  time_per_step: float
  memory_per_device: int
  in_flight: int
  bytes_to_next: int
  send_seconds: float = 0.0
  first_pass_seconds: float = 0.0
  zero_state: bool = False
  zero_params: bool = False
  root_specs: tuple = ()
  grad_specs: tuple = ()
  pins: tuple = ({}, {})

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    d["layers"] = list(self.layers)
    d["params"] = list(self.params)
    d["submesh_shape"] = list(self.submesh_shape)
    d["batch_axes"] = list(self.batch_axes)
    d["inputs"] = [v.to_json() for v in self.inputs]
    d["root_specs"] = [spec_to_json(x) for x in self.root_specs]
    d["grad_specs"] = [spec_to_json(x) for x in self.grad_specs]
    d["pins"] = [{path: {str(o): spec_to_json(x) for o, x in outs.items()}
                  for path, outs in table.items()} for table in self.pins]
    return d

  @classmethod
  def from_json(cls, d: Mapping) -> "StagePlan":
    return cls(index=int(d["index"]), layers=tuple(d["layers"]), params=tuple(d["params"]),
               submesh_offset=int(d["submesh_offset"]),
               submesh_shape=tuple(d["submesh_shape"]), batch_axes=tuple(d["batch_axes"]),
               inputs=tuple(ValuePlan.from_json(v) for v in d["inputs"]),
               time_per_micro_batch=float(d["time_per_micro_batch"]),
               time_per_step=float(d["time_per_step"]),
               memory_per_device=int(d["memory_per_device"]), in_flight=int(d["in_flight"]),
               bytes_to_next=int(d["bytes_to_next"]),
               send_seconds=float(d.get("send_seconds", 0.0)),
               first_pass_seconds=float(d.get("first_pass_seconds", 0.0)),
               zero_state=bool(d.get("zero_state", False)),
               zero_params=bool(d.get("zero_params", False)),
               root_specs=tuple(spec_from_json(x) for x in d.get("root_specs", ())),
               grad_specs=tuple(spec_from_json(x) for x in d.get("grad_specs", ())),
               pins=tuple({path: {int(o): spec_from_json(x) for o, x in outs.items()}
                           for path, outs in table.items()}
                          for table in d.get("pins", ({}, {}))))


@dataclasses.dataclass(frozen=True)
class Plan:
  """How one training step is sharded over one mesh.

  Attributes:
    method: the method that made it ("DataParallel", "ShardParallel", ...).
    mesh_axis_names, mesh_shape: the mesh it is for.
    num_micro_batches: micro-batches per step.
    batch_axes: mesh axes the batch is split over (gradients are partial sums
      over these axes until the last micro-batch).
    inputs: one entry per array leaf of the non-static arguments, in
      flattening order, named by pytree path.
    grads: one entry per gradient leaf, as the apply step receives it.
    outputs: one entry per output leaf, named ``out...`` by pytree path.
    intermediates: solver-decided shardings of values inside the step.
    hints: the step's own sharding hints (``with_sharding_constraint``,
      ``reshard``, nested ``jit`` shardings), named ``hint <part>/<equation>``,
      each with the spec the plan keeps for it.
    collectives: the collectives the plan implies.
    memory_per_device: estimated bytes per device (state, gradients, batch).
    objective: the planner's estimated cost of one step (seconds, α-β model).
    solver: how the plan was found, or None for preset methods.
    fingerprint: what the plan was made for (autopar version, digests of the
      program, the arguments and the method's options, the mesh, the number
      of micro-batches, the batch size), as (name, text) pairs; a saved plan
      is used only for a step with the same (see ``autopar/planner/cache.py``).
    stages: for a pipeline (``PipeshardParallel``), its stages, each with
      its own submesh and plan; empty otherwise.
    schedule: the pipeline's schedule ("1f1b", "gpipe", "zb-h1",
      "interleaved-1f1b", "zb-v"), or None.
    schedule_search: under ``schedule="auto"``, each schedule the search
      weighed as (schedule, its best plan's modelled step seconds, or None
      where no plan of it fits, and why), the chosen one among them; empty
      where the method named the schedule.
    micro_batch_search: under ``num_micro_batches="auto"``
      (``PipeshardParallel``), each number of micro-batches the search
      weighed as (number, its best plan's modelled step seconds, or None
      where none was found or it was not planned, and why), the chosen one
      among them; empty
      where the method named the number.
    virtual_stages: under ``"interleaved-1f1b"`` and ``"zb-v"``, the stages
      each submesh runs (``stages`` lists them all: with ``D = len(stages) /
      virtual_stages`` submeshes, stage ``k`` runs on submesh ``k % D``
      interleaved, ``min(k, 2 D - 1 - k)`` under ZB-V:
      ``costs.schedule.submesh_of``); 1 otherwise.
    grad_sync: where the gradients are summed over the batch axes with
      several micro-batches: ``"last"`` (in the last micro-batch's stage) or
      ``"apart"`` (a stage of its own; ``ParallelMethod.grad_sync``).
    costs: the costs the plan assumed: ``seconds_per_flop``, and per mesh
      axis ``alpha`` (s per collective step) and ``beta`` (s per byte).
    grad_inputs: per gradient, the path of the input it is the gradient of
      ("" if unknown), for reading the plan (``tools/groups.py``).
    predicted_time: the objective by stage (``planner.solved.predicted_time``):
      ``"gradient"`` and ``"apply"``, each {flops, memory, roofline,
      collectives, total} in seconds; what ``plan.check`` holds to the
      compiled modules. Empty where the step has no gradient marker.
  """
  method: str
  mesh_axis_names: tuple[str, ...]
  mesh_shape: tuple[int, ...]
  num_micro_batches: int
  batch_axes: tuple[str, ...]
  inputs: tuple[ValuePlan, ...]
  grads: tuple[ValuePlan, ...]
  outputs: tuple[ValuePlan, ...]
  intermediates: tuple[ValuePlan, ...] = ()
  hints: tuple[ValuePlan, ...] = ()
  collectives: tuple[CollectivePlan, ...] = ()
  memory_per_device: int = 0
  objective: float = 0.0
  solver: SolverStats | None = None
  fingerprint: tuple[tuple[str, str], ...] = ()
  stages: tuple[StagePlan, ...] = ()
  schedule: str | None = None
  schedule_search: tuple[tuple[str, float | None, str], ...] = ()
  micro_batch_search: tuple[tuple[int, float | None, str], ...] = ()
  virtual_stages: int = 1
  grad_sync: str = "last"
  costs: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False)
  grad_inputs: tuple[str, ...] = dataclasses.field(default=(), compare=False)
  predicted_time: Mapping[str, Any] = dataclasses.field(default_factory=dict,
                                                        compare=False)
  # How to solve the plan again with pins, for explain and cost_if (an
  # ``autopar.planner.replan.Replanner``; typed Any: the plan's data imports
  # no planner): the ILPs the solver solved (``plan_auto`` keeps them; no
  # arrays, no step), and a weak reference to the step (``step.plan()`` adds
  # it). Saved as the ILPs' text (``to_json``'s "ilp"; a ``SavedILPs`` in a
  # plan read back, which the planner reads on the first explain); None
  # where no ILP chose the plan (the presets, a pipeline's stage search).
  replan: Any = dataclasses.field(default=None, compare=False, repr=False)
  # Not serialized: the structure of the inputs (a ``pytrees.Partition`` of
  # the non-static arguments) and the mesh object the plan was made for. A
  # loaded plan has neither until it is applied.
  in_tree: Any = dataclasses.field(default=None, compare=False, repr=False)
  mesh: Any = dataclasses.field(default=None, compare=False, repr=False)

  # -- shardings ---------------------------------------------------------------

  @property
  def axis_sizes(self) -> dict[str, int]:
    return dict(zip(self.mesh_axis_names, self.mesh_shape, strict=True))

  def _mesh_for_shardings(self):
    if self.mesh is not None:
      return self.mesh
    return AbstractMesh(self.mesh_shape, self.mesh_axis_names)

  @property
  def input_shardings(self) -> Any:
    """The inputs' ``NamedSharding``s, shaped like the non-static arguments
    (None where an argument holds a static leaf, such as a function).

    For a plan loaded from JSON (which has no pytree structure), a dict from
    pytree path to ``NamedSharding``. For a pipeline plan each sharding lies
    on the submesh of the stage that holds the input (``placements``).
    """
    mesh = self._mesh_for_shardings()
    leaves = []
    for offset, shape, spec in self.placements():
      if offset != 0 or tuple(shape) != tuple(mesh.axis_sizes):
        leaves.append(NamedSharding(submesh(mesh, offset, shape), spec))
      else:
        leaves.append(NamedSharding(mesh, spec))
    if self.in_tree is None:
      return {v.name: s for v, s in zip(self.inputs, leaves, strict=True)}
    part = self.in_tree
    return dataclasses.replace(part, statics=(None,) * len(part.statics)).merge(leaves)

  def stage_of_inputs(self) -> dict[str, "StagePlan"]:
    """Input name -> the pipeline stage that first holds it (``placements``);
    empty for a plan without stages."""
    out: dict[str, StagePlan] = {}
    for st in self.stages:
      for v in st.inputs:
        out.setdefault(v.name, st)
    return out

  def placements(self) -> list[tuple[int, tuple[int, ...], PartitionSpec]]:
    """Where each input (``self.inputs`` order) is placed before the first
    step: (flattened index of the first device, submesh shape, spec). The
    whole mesh, except in a pipeline plan: there an input lives on the
    first stage that holds it (its parameters' stage; for the batch, the
    first stage that reads it), with that stage's spec."""
    whole = (0, tuple(self.mesh_shape))
    if not self.stages:
      return [(*whole, v.spec) for v in self.inputs]
    first = {}
    for st in self.stages:
      for v in st.inputs:
        first.setdefault(v.name, (st.submesh_offset, tuple(st.submesh_shape), v.spec))
    s0 = self.stages[0]
    return [first.get(v.name, (s0.submesh_offset, tuple(s0.submesh_shape),
                               PartitionSpec()))
            for v in self.inputs]

  # -- JSON --------------------------------------------------------------------

  def to_json(self, indent: int | None = 1) -> str:
    """The plan as JSON text (``indent=None``: compact, and about twice as
    fast to write for a large plan: Python's C encoder only runs unindented),
    with the ILPs it was solved with where it keeps them (``"ilp"``, for
    ``explain`` and ``cost_if``; see ``replan``)."""
    specs: dict = {}       # a plan has few distinct specs: one list each

    def values(vs) -> list:
      out = []
      for v in vs:
        spec = specs.get(v.spec)
        if spec is None:
          spec = specs[v.spec] = spec_to_json(v.spec)
        out.append(v.to_json(spec))
      return out

    d = {
        "format": PLAN_FORMAT,
        "method": self.method,
        "mesh_axis_names": list(self.mesh_axis_names),
        "mesh_shape": list(self.mesh_shape),
        "num_micro_batches": self.num_micro_batches,
        "batch_axes": list(self.batch_axes),
        "inputs": values(self.inputs),
        "grads": values(self.grads),
        "outputs": values(self.outputs),
        "intermediates": values(self.intermediates),
        "hints": values(self.hints),
        "collectives": [c.to_json() for c in self.collectives],
        "memory_per_device": self.memory_per_device,
        "objective": self.objective,
        "solver": None if self.solver is None else self.solver.to_json(),
        "fingerprint": dict(self.fingerprint),
    }
    if self.stages:
      d["stages"] = [st.to_json() for st in self.stages]
      d["schedule"] = self.schedule
      if self.schedule_search:
        d["schedule_search"] = [list(x) for x in self.schedule_search]
      if self.virtual_stages != 1:
        d["virtual_stages"] = self.virtual_stages
    if self.micro_batch_search:
      d["micro_batch_search"] = [list(x) for x in self.micro_batch_search]
    if self.grad_sync != "last":
      d["grad_sync"] = self.grad_sync
    if self.costs:
      d["costs"] = dict(self.costs)
    if self.grad_inputs:
      d["grad_inputs"] = list(self.grad_inputs)
    if self.predicted_time:
      d["predicted_time"] = {k: dict(v) for k, v in self.predicted_time.items()}
    if self.replan is not None:
      d.update(self.replan.to_json())      # "ilp" (and "ilp_pins"), if it has them
    return json.dumps(d, indent=indent)

  @classmethod
  def from_json(cls, text: str) -> "Plan":
    """Loads a plan written by :meth:`to_json` (its ILPs, if it saved them,
    are read on its first ``explain`` or ``cost_if``)."""
    try:
      d = json.loads(text)
    except json.JSONDecodeError as e:
      raise PlanError(f"Plan.from_json: not valid JSON ({e}). Fix: pass the "
                      f"string returned by Plan.to_json().") from e
    if not isinstance(d, dict):
      raise PlanError(f"Plan.from_json: expected a JSON object, got "
                      f"{type(d).__name__}. Fix: pass the string returned by "
                      f"Plan.to_json().")
    if d.get("format") != PLAN_FORMAT:
      raise PlanError(f"Plan.from_json: plan format {d.get('format')!r} is not "
                      f"supported (this autopar reads format {PLAN_FORMAT}). "
                      f"Fix: make the plan again with this version.")
    specs: dict = {}       # spec entries (lists made tuples) -> PartitionSpec

    def values(ds) -> tuple:
      out = []
      for v in ds:
        key = tuple(tuple(e) if isinstance(e, list) else e for e in v["spec"])
        spec = specs.get(key)
        if spec is None:
          spec = specs[key] = spec_from_json(key)
        out.append(ValuePlan.from_json(v, spec))
      return tuple(out)

    try:
      return cls._from_dict(d, values)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
      raise PlanError(f"Plan.from_json: the plan is incomplete or corrupt "
                      f"({type(e).__name__}: {e}). Fix: make the plan again and "
                      f"save Plan.to_json() unchanged.") from e

  @classmethod
  def _from_dict(cls, d: dict, values) -> "Plan":
    if d.get("grad_sync", "last") not in ("last", "apart"):
      raise ValueError(f"grad_sync={d['grad_sync']!r} (expected 'last' or 'apart')")
    return cls(
        method=d["method"], mesh_axis_names=tuple(d["mesh_axis_names"]),
        mesh_shape=tuple(d["mesh_shape"]),
        num_micro_batches=int(d["num_micro_batches"]),
        batch_axes=tuple(d["batch_axes"]),
        inputs=values(d["inputs"]), grads=values(d["grads"]),
        outputs=values(d["outputs"]), intermediates=values(d["intermediates"]),
        hints=values(d["hints"]),
        collectives=tuple(map(CollectivePlan.from_json, d["collectives"])),
        memory_per_device=int(d["memory_per_device"]),
        objective=float(d["objective"]),
        solver=None if d["solver"] is None else SolverStats.from_json(d["solver"]),
        fingerprint=tuple(d["fingerprint"].items()),
        stages=tuple(StagePlan.from_json(st) for st in d.get("stages", ())),
        schedule=d.get("schedule"),
        schedule_search=tuple((str(a), None if t is None else float(t), str(why))
                              for a, t, why in d.get("schedule_search") or ()),
        micro_batch_search=tuple((int(k), None if t is None else float(t), str(why))
                                 for k, t, why in d.get("micro_batch_search") or ()),
        virtual_stages=int(d.get("virtual_stages", 1)),
        grad_sync=d.get("grad_sync", "last"),
        costs=dict(d.get("costs") or {}),
        grad_inputs=tuple(d.get("grad_inputs") or ()),
        predicted_time={k: dict(v) for k, v in (d.get("predicted_time") or {}).items()},
        replan=SavedILPs(d["ilp"], {k: spec_from_json(v) for k, v in
                                    (d.get("ilp_pins") or {}).items()})
        if isinstance(d.get("ilp"), str) else None)

  # -- reading -----------------------------------------------------------------

  def summary(self, *, full: bool = False) -> str:
    """The plan on one screen: one row per parameter group (repeated
    layers collapsed) with its gradient's and optimizer state's specs, the
    other inputs, collectives per stage with their predicted time, memory
    per device by kind, the solver and the costs assumed; for a pipeline the
    stage table first (see ``autopar/tools/summary.py``). ``full=True``:
    every leaf on its own line."""
    if not full:
      return _reader().summary(self)
    return self.full_summary()

  def explain(self, path: str):
    """Why the leaf ``path`` (a pytree path, its slash form, or a glob)
    has its spec: each spec it could have, with the objective, collectives'
    time and memory of the plan re-solved with it pinned; the chosen one
    marked, and what decided (``autopar/tools/explain.py``). For a plan
    ShardParallel's solver made (``step.plan(...)``, ``get_executable``),
    which keeps its ILPs, and for that plan read back from its JSON (or
    from the plan cache), which keeps them too: the step may be gone."""
    return _reader().explain(self, path)

  def cost_if(self, pins):
    """The plan re-solved with ``pins`` ({path or glob: spec}) added: the
    objective before and after, and the diff."""
    return _reader().cost_if(self, pins)

  def check(self, executable):
    """The plan's predicted collectives (kind, axes, bytes) and peak memory
    against ``executable``'s compiled stages (``autopar/tools/check.py``).

    Example::

        exe = step.get_executable(state, batch)
        result = exe.plan.check(exe)
        print(result); assert not result.differences()
    """
    return _reader().check(self, executable)

  def to_html(self, path: str | None = None, *, title: str = "autopar plan") -> str:
    """A self-contained HTML report of the plan (``autopar/tools/report.py``):
    the summary's tables, a picture of each distinct sharding, collectives
    per stage, memory against the budget, a pipeline's stages and schedule.
    Written to ``path`` if given; returns the HTML."""
    text = _reader().to_html(self, title)
    if path is not None:
      with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return text

  def stage_table(self) -> list[str]:
    """The pipeline's stages, one row each, and its schedule (lines;
    ``autopar/tools/summary.py``)."""
    return _reader().stage_table(self)

  def full_summary(self) -> str:
    """Every input, gradient, output and hint on its own line, and every
    collective."""
    sizes = self.axis_sizes
    mesh = " x ".join(f"{n}={s}" for n, s in sizes.items())
    lines = self.stage_table() if self.stages else []
    split = ("per stage (the table above)" if self.stages else
             f"over {axes_str(self.batch_axes)}")
    lines += [
        f"autopar plan: {self.method} on mesh ({mesh}), "
        f"{self.num_micro_batches} micro-batch(es), batch split {split}",
        f"objective: {self.objective:.6g} s (estimated)",
    ]
    if self.solver is not None:
      s = self.solver
      lines.append(f"solver: {s.solver} ({s.status}) in {s.seconds:.3f} s, "
                   f"{s.num_variables} variables, {s.num_constraints} constraints")
      if s.num_equations:
        lines.append(f"problem: {s.num_equations} equations, {s.num_nodes} nodes "
                     f"after merging, {s.num_classes} after sharing repeated layers")
      if s.timings:
        lines.append("planning time: " + ", ".join(
            f"{k} {v:.2f} s" for k, v in s.timings.items()))
    stage_of = self.stage_of_inputs()
    grad_stage = {g.name: stage_of.get(p) for g, p in zip(self.grads, self.grad_inputs)}
    for title, values, where in (
        ("inputs", self.inputs, stage_of), ("gradients", self.grads, grad_stage),
        ("outputs", self.outputs, {}), ("sharding hints kept", self.hints, {})):
      if values:
        lines.append("")
        lines.extend(_table(title, values, sizes, self.stages and where))
    if self.collectives:
      lines.append("")
      lines.append("collectives per step:")
      rows = [("stage", "kind", "axes", "bytes/device", "x/step", "what")]
      for c in self.collectives:
        rows.append((c.stage, c.kind, axes_str(c.axes), format_bytes(c.bytes),
                     str(c.per_step), c.what))
      lines.extend(format_rows(rows))
      total = sum(c.bytes * c.per_step for c in self.collectives)
      lines.append(f"total collective operand bytes per step: {format_bytes(total)}")
    else:
      lines.append("")
      lines.append("collectives per step: none")
    lines.append("")
    lines.append(f"estimated memory per device: {format_bytes(self.memory_per_device)}")
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.summary()


def _table(title: str, values: Sequence[ValuePlan], sizes, stage_of=None) -> list[str]:
  """One row per value and its bytes per device. In a pipeline
  (``stage_of``: value name -> the StagePlan that holds it), a stage
  column, bytes per device of that stage's submesh, and totals by stage."""
  rows = [(title, "stage", "shape", "dtype", "spec", "bytes/device") if stage_of else
          (title, "shape", "dtype", "spec", "bytes/device")]
  totals: dict = {}
  for v in values:
    st = stage_of.get(v.name) if stage_of else None
    here = sizes if st is None else dict(zip(sizes, st.submesh_shape, strict=True))
    b = v.bytes_per_device(here)
    key = None if st is None else st.index
    totals[key] = totals.get(key, 0) + b
    where = () if not stage_of else ("-" if st is None else str(st.index),)
    rows.append((v.name, *where, str(tuple(v.shape)), v.dtype, spec_str(v.spec),
                 format_bytes(b)))
  out = format_rows(rows)
  if not stage_of:
    out.append(f"total {title}: {format_bytes(sum(totals.values()))} per device")
  else:
    out.append(f"total {title} per device of each stage: " + ", ".join(
        f"stage {k} {format_bytes(b)}" for k, b in sorted(
            totals.items(), key=lambda kb: -1 if kb[0] is None else kb[0])
        if k is not None) or "-")
  return out


# The stage that starts a step's partial sums of the gradients at zero (with
# several micro-batches), and the one that sums them over the batch axes
# after the last micro-batch (``Plan.grad_sync == "apart"``).
ZERO_STAGE = "zero_grad"
SYNC_STAGE = "sync_grad"


def grad_stage_names(n: int, grad_sync: str = "last") -> list[str]:
  """The gradient stage run for each of ``n`` micro-batches.

  With one micro-batch, ``compute_grad_sync`` computes the gradient and sums
  it over the batch axes. With more (``grad_sync="last"``),
  ``compute_grad`` starts this device's partial sums, ``accumulate_grad``
  adds to them, and the last micro-batch's stage, ``accumulate_grad_sync``,
  also sums them over the batch axes; with ``grad_sync="apart"`` every
  micro-batch runs ``accumulate_grad`` on sums ``ZERO_STAGE`` starts at
  zero, and ``SYNC_STAGE`` sums them after the last.
  """
  if n == 1:
    return ["compute_grad_sync"]
  if grad_sync == "apart":
    return ["accumulate_grad"] * n
  return ["compute_grad"] + ["accumulate_grad"] * (n - 2) + ["accumulate_grad_sync"]


def grad_stage_label(n: int) -> str:
  """How a plan names the stage a gradient stage's own collectives run in:
  every micro-batch's (each ``accumulate_grad``, or the one
  ``compute_grad_sync``)."""
  return "accumulate_grad (each micro-batch)" if n > 1 else grad_stage_names(1)[0]


def sync_stage_name(n: int, grad_sync: str = "last") -> str:
  """The stage that sums the gradients over the batch axes."""
  if n > 1 and grad_sync == "apart":
    return SYNC_STAGE
  return grad_stage_names(n, grad_sync)[-1]


def plan_constraints(plan: Plan, part: str) -> dict[str, dict]:
  """Equation path -> {output index, "in<k>" or "x<k>" for operand k: spec}.

  Plan intermediates are named ``<part>/<equation>/<output>`` (the spec an
  output is produced in), ``<part>/<equation>/in<k>`` (the spec operand
  ``k`` is resharded to before the equation) or, for a scan,
  ``<part>/<equation>/x<k>`` (the spec each trip's slice of scanned operand
  ``k`` enters the body in). An equation inside control flow has a path:
  ``12.0.5`` is equation 5 of sub-jaxpr 0 of equation 12.
  """
  out: dict[str, dict] = {}
  for v in plan.intermediates:
    prefix, i, j = v.name.split("/")
    if prefix == part:
      out.setdefault(i, {})[int(j) if j.isdigit() else j] = v.spec
  return out


def submesh(mesh, offset: int, shape) -> Mesh | AbstractMesh:
  """The sub-block of ``mesh`` of ``shape`` starting at flattened device
  ``offset``, with the mesh's axis names (Auto axes): a pipeline stage's."""
  names = tuple(mesh.axis_names)
  auto = (AxisType.Auto,) * len(names)
  if isinstance(mesh, AbstractMesh):
    return AbstractMesh(tuple(shape), names, axis_types=auto)
  devices = np.asarray(mesh.devices).reshape(-1)[offset:offset + math.prod(shape)]
  return Mesh(devices.reshape(shape), names, axis_types=auto)
