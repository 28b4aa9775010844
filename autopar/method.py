"""Parallelization methods and the solver's options, as frozen dataclasses.

A method says how a step is parallelized; it is passed explicitly to
``@autopar.parallelize(method=...)`` and never read from global state.

* :class:`ShardParallel`: the planner decides every sharding.
* :class:`DataParallel`: the batch is split over ``batch_axes`` (all mesh axes
  of size > 1 by default), parameters and optimizer state are replicated, gradients are
  all-reduced once per step.
* :class:`Zero2Parallel`: as data parallel, but gradients are reduce-scattered
  and the optimizer state is sharded; parameters are all-gathered after the
  update.
* :class:`Zero3Parallel`: as Zero2, and the parameters stay sharded too,
  gathered by each equation that reads them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, PartitionSpec

from autopar.errors import InputError, MeshError
from autopar.costs.schedule import SCHEDULES as PIPELINE_SCHEDULES, VIRTUAL_SCHEDULES
from autopar.costs.submesh import tile
from autopar.frontend.remat import check_remat, check_remat_loop

__all__ = ["AutoShardingOption", "ParallelMethod", "ShardParallel",
           "DataParallel", "Zero2Parallel", "Zero3Parallel", "PipeshardParallel",
           "resolve_mesh",
           "axis_names_of", "axis_sizes_of", "split_axes_of", "GRAD_SYNCS", "grad_sync_for"]


# ParallelMethod.grad_sync's values (None: the platform's, ``grad_sync_for``).
GRAD_SYNCS = (None, "last", "apart")


def grad_sync_for(platform: str) -> str:
  """The default ``grad_sync`` on ``platform``: ``"apart"`` on CPU, whose
  collectives run synchronously (nothing to overlap them with), so one
  gradient module is compiled; ``"last"`` elsewhere."""
  return "apart" if platform == "cpu" else "last"


def _as_items(mapping: Mapping[str, float] | None, what: str, key: str = "mesh axis name"
              ) -> tuple[tuple[str, float], ...] | None:
  if mapping is None:
    return None
  if isinstance(mapping, tuple) and all(isinstance(kv, tuple) and len(kv) == 2
                                        for kv in mapping):
    mapping = dict(mapping)      # already normalized (dataclasses.replace)
  if not isinstance(mapping, Mapping):
    raise InputError(f"AutoShardingOption: {what} must be a mapping from {key} "
                     f"to a float, got {type(mapping).__name__}.")
  out = []
  for k, v in mapping.items():
    if not isinstance(k, str) or not isinstance(v, (int, float)) or v < 0:
      raise InputError(f"AutoShardingOption: {what}[{k!r}] = {v!r}; expected a "
                       f"{key} mapped to a non-negative float.")
    out.append((k, float(v)))
  return tuple(sorted(out))


def _as_pins(pins) -> tuple[tuple[str, PartitionSpec], ...] | None:
  if pins is None or isinstance(pins, tuple) and all(
      isinstance(p, tuple) and len(p) == 2 and isinstance(p[1], PartitionSpec)
      for p in pins):
    return pins or None
  if not isinstance(pins, Mapping):
    raise InputError(f"AutoShardingOption: pins must be a mapping from an argument "
                     f"leaf's pytree path to a PartitionSpec, got "
                     f"{type(pins).__name__}.")
  out = []
  for path, spec in pins.items():
    if not isinstance(path, str):
      raise InputError(f"AutoShardingOption: pins key {path!r} is not a pytree path "
                       f"string (e.g. \"state.params['Dense_0']['kernel']\").")
    if isinstance(spec, (tuple, list)):
      spec = PartitionSpec(*spec)
    if not isinstance(spec, PartitionSpec):
      raise InputError(f"AutoShardingOption: pins[{path!r}] = {spec!r}; expected a "
                       f"jax.sharding.PartitionSpec.")
    out.append((path, spec))
  return tuple(sorted(out, key=lambda p: p[0])) or None


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutoShardingOption:
  """Knobs of the auto-sharding solver. All keyword-only, all optional.

  Args:
    force_data_parallel: plan pure data parallelism (batch split over every
      mesh axis, everything else replicated) without solving.
    force_batch_dim_to_mesh_dim: mesh axis name (or tuple of names) the batch
      dimension must be split over; a mesh dimension's index, as in Alpa,
      means that dimension's axis.
    prefer_reduce_scatter: when the batch is split over more than one device,
      reduce-scatter the gradients over the batch axes and split the optimizer
      state over them (ZeRO-2): the same bytes as an all-reduce plus the
      gather of the updated parameters, and less optimizer memory.
    allow_all_gather: let the solver use all-gather to reshard values.
    allow_all_to_all: let the solver use all-to-all to reshard values.
    memory_budget_per_device: bytes one device may use; None for no limit.
    mesh_alpha: mesh axis name -> latency of a collective step along it (s).
    mesh_beta: mesh axis name -> inverse bandwidth along it (s/byte).
    seconds_per_flop: compute cost of one floating-point operation on one
      device; weighs compute against collectives. None (default): 1 / the
      peak rate of the device kind for the step's main float dtype, or
      1e-12 (a 1 TFLOP/s device) where no kind is known.
    memory_bandwidth: bytes per second one device reads and writes its own
      memory; with ``seconds_per_flop`` it makes the compute roofline (an
      operation costs the larger of flops x seconds per flop and bytes moved
      / bandwidth). None (default): the device kind's, or 50 GB/s where no
      kind is known.
    max_model_axes: how many mesh axes the solver searches in full to split
      values inside a micro-batch (tensor parallelism); the other axes split
      the batch. Axes of size 1 split nothing and are not searched (nor
      counted). 2 searches 2-D tensor parallelism in full, at the price of
      an ILP about ten times larger.
    extend_model_axes: once the batch-axes choices are solved, try each
      solved plan with one of its batch axes planned as well, its planned
      axes' decisions kept (how ShardParallel finds 2-D tensor parallelism
      by default), and so on from those: one more problem about the size
      of the solved one per try; a plan so found is kept only where it
      costs less. False: plans use at most ``max_model_axes`` planned axes.
    share_layers: give equations that repeat layer after layer one set of
      decisions (see ``docs/planner.md``), so the problem does not grow with
      depth. False solves every equation on its own.
    plan_cache: keep solved plans on disk (``$AUTOPAR_CACHE_DIR``, default
      ``~/.cache/autopar/plans``), keyed by the traced program, the mesh and
      these options, so the same step is not solved twice.
    verbose: print each planning stage and its time to stderr. None: only
      once planning has taken more than 2 seconds.
    pins: argument leaf path -> ``PartitionSpec`` (over any mesh axes) that
      the plan must give that leaf, e.g. ``{"state.params['embed']['embedding']":
      P(None, "model")}``; paths as ``plan.inputs`` names them. The rest is
      planned around them. The new state returned in place of a pinned
      donated leaf gets the same spec.
    costs: None (default): mesh_alpha, mesh_beta and seconds_per_flop as
      given; "measured": from ``autopar.calibrate(mesh)`` (measured on the
      first plan for a mesh of real devices and kept on disk; for an
      AbstractMesh, a calibration kept for ``device_kind`` and that mesh).
      Axes given in mesh_alpha / mesh_beta keep their given values.
    device_kind: the devices' kind ("H100", "A100", "TPU v5p", ...; see
      ``autopar/costs/devices.py``), read from the devices of a real mesh; for an
      AbstractMesh, name it to cost each axis from the hardware (and to find
      a calibration with ``costs="measured"``). Axes not in mesh_alpha /
      mesh_beta then cost the links inside a node, or between nodes for the
      axes that cross hosts.
    seconds_per_flop_by_dtype: dtype name -> seconds per flop of work in
      that dtype (1 / its peak rate; a matmul runs at its operands' dtype,
      element-wise work at float32's). None (default): the device kind's
      peak rates, or a calibration's; where ``seconds_per_flop`` is given by
      hand (and this is not), every dtype runs at it.
    devices_per_host: for an AbstractMesh, devices per host in
      ``jax.devices()`` order, which says which axes cross hosts (None:
      none do). A real mesh's hosts are read from its devices.

  Example::

      AutoShardingOption(mesh_beta={"data": 1e-9, "model": 1e-11})
  """
  force_data_parallel: bool = False
  force_batch_dim_to_mesh_dim: str | int | tuple[str | int, ...] | None = None
  prefer_reduce_scatter: bool = False
  allow_all_gather: bool = True
  allow_all_to_all: bool = True
  memory_budget_per_device: int | float | None = None
  mesh_alpha: Any = None
  mesh_beta: Any = None
  seconds_per_flop: float | None = None
  memory_bandwidth: float | None = None
  max_model_axes: int = 1
  extend_model_axes: bool = True
  share_layers: bool = True
  plan_cache: bool = True
  verbose: bool | None = None
  pins: Any = None
  costs: str | None = None
  device_kind: str | None = None
  devices_per_host: int | None = None
  seconds_per_flop_by_dtype: Any = None

  def __post_init__(self):
    if self.costs not in (None, "measured"):
      raise InputError(f"AutoShardingOption: costs={self.costs!r}; expected None (the "
                       f"α, β and seconds per flop given) or 'measured' (from "
                       f"autopar.calibrate).")
    if self.device_kind is not None and not isinstance(self.device_kind, str):
      raise InputError(f"AutoShardingOption: device_kind={self.device_kind!r}; expected "
                       f"a device kind name (jax.Device.device_kind) or None.")
    object.__setattr__(self, "pins", _as_pins(self.pins))
    object.__setattr__(self, "mesh_alpha", _as_items(self.mesh_alpha, "mesh_alpha"))
    object.__setattr__(self, "mesh_beta", _as_items(self.mesh_beta, "mesh_beta"))
    object.__setattr__(self, "seconds_per_flop_by_dtype", _as_items(
        self.seconds_per_flop_by_dtype, "seconds_per_flop_by_dtype", "dtype name"))
    f = self.force_batch_dim_to_mesh_dim
    if isinstance(f, list):
      object.__setattr__(self, "force_batch_dim_to_mesh_dim", tuple(f))
    if not isinstance(self.max_model_axes, int) or self.max_model_axes < 0:
      raise InputError(f"AutoShardingOption: max_model_axes={self.max_model_axes!r}; "
                       f"expected a non-negative int.")
    bw = self.memory_bandwidth
    if bw is not None and (not isinstance(bw, (int, float)) or bw <= 0):
      raise InputError(f"AutoShardingOption: memory_bandwidth={bw!r}; expected a "
                       f"positive number of bytes per second or None.")
    b = self.memory_budget_per_device
    if b is not None and (not isinstance(b, (int, float)) or b <= 0):
      raise InputError(f"AutoShardingOption: memory_budget_per_device={b!r}; "
                       f"expected a positive number of bytes or None.")

  def forced_batch_axes(self, mesh) -> tuple[str, ...] | None:
    """``force_batch_dim_to_mesh_dim`` as mesh axis names (None: not set)."""
    f = self.force_batch_dim_to_mesh_dim
    if f is None:
      return None
    names = axis_names_of(mesh)
    out = []
    for a in ((f,) if isinstance(f, (str, int)) else f):
      if isinstance(a, int) and not isinstance(a, bool):
        if not 0 <= a < len(names):
          raise MeshError(f"AutoShardingOption(force_batch_dim_to_mesh_dim={f!r}): "
                          f"mesh dimension {a} does not exist; the mesh has "
                          f"{len(names)} axes {names}.")
        a = names[a]
      out.append(a)
    check_axes(out, mesh, "AutoShardingOption(force_batch_dim_to_mesh_dim=...)")
    return tuple(out)

  @property
  def pin_map(self) -> dict[str, PartitionSpec]:
    return dict(self.pins or ())

  @property
  def flop_seconds(self) -> float:
    """``seconds_per_flop``, or 1e-12 where it is not set."""
    return 1e-12 if self.seconds_per_flop is None else float(self.seconds_per_flop)

  @property
  def byte_seconds(self) -> float:
    """1 / ``memory_bandwidth``, or 1 / 50 GB/s where it is not set."""
    return 1.0 / (50e9 if self.memory_bandwidth is None else float(self.memory_bandwidth))

  @property
  def dtype_flop_seconds(self) -> dict[str, float]:
    """``seconds_per_flop_by_dtype`` as a dict (the device kind fills it
    only where ``seconds_per_flop`` is not given by hand)."""
    return dict(self.seconds_per_flop_by_dtype or ())

  @property
  def alpha(self) -> dict[str, float]:
    return dict(self.mesh_alpha or ())

  @property
  def beta(self) -> dict[str, float]:
    return dict(self.mesh_beta or ())


@dataclasses.dataclass(frozen=True)
class ParallelMethod:
  """Base of all methods: the mesh and the number of micro-batches.

  Args:
    mesh: a ``jax.sharding.Mesh`` (from ``jax.make_mesh`` or built by hand),
      or an ``AbstractMesh`` for planning only. None: a 1-D mesh named
      ``"data"`` over all devices.
    num_micro_batches: split each batch into this many micro-batches and
      accumulate gradients over them (None or 1: no split).
    remat: ``"none"`` (default); ``"layers"``: the repeated layers of the
      function passed to ``autopar.grad``/``value_and_grad`` are found and
      checkpointed one by one, so the backward pass recomputes one layer at
      a time (see ``autopar/frontend/remat.py``); or a
      ``jax.checkpoint_policies`` policy: the same, saving what it names.
    remat_loop: how those layers run. ``"unrolled"``: one after another, each
      reading its own weights (no loop, no conditional; XLA compiles every
      layer); ``"scan"``: one ``lax.scan`` over the layers, compiled once,
      which picks each layer's weights with a ``lax.switch`` (a conditional,
      whose branch index XLA:GPU reads back to the host). None (default):
      ``"unrolled"`` on GPU and TPU, ``"scan"`` on CPU (where XLA would merge
      an unrolled layer's recomputation with its forward pass), but
      ``"unrolled"`` under ``Zero3Parallel`` everywhere (each recomputed
      layer gathers its weights anew, which XLA does not merge; a scan
      would gather every layer's weights at once). A pipeline's
      stages (``PipeshardParallel`` with several) checkpoint their layers
      their own way and do not read it.
    grad_accumulation_dtype: ``"float32"`` (default): bfloat16 and float16
      gradients are summed over micro-batches and devices in float32 and
      handed to the update in their own dtype; None: summed in their own
      dtype (half the buffer, more rounding).
    one_executable: None (default) or True: with one micro-batch, the
      gradient and the update compile as one executable (stage
      ``grad_and_apply``): one dispatch per call instead of two, no gradient
      written out between them, and no wait on the host for the gradient
      before the update's dispatch (a donated buffer still being read makes
      the dispatch wait); the plan and the numbers are the same. False:
      separate stages (``compute_grad_sync``, ``apply_grad``) to inspect one
      by one. With more micro-batches the stages are separate; True is then
      an error.
    grad_sync: where, with several micro-batches, the partial sums of the
      gradients are summed over the batch axes. ``"last"``: in the last
      micro-batch's gradient stage (``accumulate_grad_sync``), where XLA
      can overlap the all-reduce with that micro-batch's backward pass; the
      first micro-batch's stage (``compute_grad``) starts the sums, so two
      or three gradient modules are compiled. ``"apart"``: ``zero_grad``
      starts the sums, every micro-batch runs one module,
      ``accumulate_grad``, and a small stage of its own after the last,
      ``sync_grad``, sums them: one gradient module to compile (a cold
      first step about a third shorter), no reduction overlapping the
      backward pass, and a few more passes over the sums (zeroing them,
      adding the first micro-batch's gradient, reading them back), which
      the planner prices. None (default): a saved plan's
      (``ShardParallel(plan=...)``), else ``"apart"`` on CPU (whose
      collectives do not overlap computation), ``"last"`` on GPU and TPU.
      With one micro-batch the gradient stage syncs (``compute_grad_sync``)
      either way. A pipeline's stages (``PipeshardParallel`` with several)
      sync their own way and do not read it.
  """
  mesh: Mesh | AbstractMesh | None = None
  num_micro_batches: int | None = None
  remat: Any = dataclasses.field(default="none", kw_only=True)
  remat_loop: str | None = dataclasses.field(default=None, kw_only=True)
  grad_accumulation_dtype: str | None = dataclasses.field(default="float32",
                                                          kw_only=True)
  one_executable: bool | None = dataclasses.field(default=None, kw_only=True)
  grad_sync: str | None = dataclasses.field(default=None, kw_only=True)
  # Alpa's name for the mesh: a Mesh, or a sequence of devices (a 1-D
  # "data" mesh over them). Not a field: it sets `mesh`.
  devices: dataclasses.InitVar[Any] = dataclasses.field(default=None, kw_only=True)

  def __post_init__(self, devices=None):
    if devices is not None:
      if self.mesh is not None:
        raise InputError(f"{type(self).__name__}: both mesh= and devices= given; "
                         f"devices= is Alpa's name for the mesh. Fix: give one.")
      object.__setattr__(self, "mesh", _mesh_of_devices(devices, type(self).__name__))
    check_remat(self.remat, type(self).__name__)
    check_remat_loop(self.remat_loop, type(self).__name__)
    if self.grad_accumulation_dtype not in ("float32", None):
      raise InputError(f"{type(self).__name__}: grad_accumulation_dtype="
                       f"{self.grad_accumulation_dtype!r}; expected 'float32' or None "
                       f"(sum each gradient in its own dtype).")
    if self.grad_sync not in GRAD_SYNCS:
      raise InputError(f"{type(self).__name__}: grad_sync={self.grad_sync!r}; expected "
                       f"None (the platform's), 'last' or 'apart'.")
    n = self.num_micro_batches
    if n == "auto" and self.chooses_micro_batches:
      pass
    elif n is not None and (not isinstance(n, (int, np.integer)) or isinstance(n, bool)
                            or n < 1):
      also = " or 'auto' (the stage search picks it)" if self.chooses_micro_batches else ""
      raise InputError(f"{type(self).__name__}: num_micro_batches={n!r}; expected "
                       f"a positive int (or None for 1){also}.")
    if self.one_executable is not None and not isinstance(self.one_executable, bool):
      raise InputError(f"{type(self).__name__}: one_executable={self.one_executable!r}; "
                       f"expected None, True or False.")
    if self.one_executable and n not in (None, 1):
      raise InputError(f"{type(self).__name__}: one_executable=True with "
                       f"num_micro_batches={n}: the gradient and the update are one "
                       f"executable only with one micro-batch (with more, the "
                       f"gradient stage runs once per micro-batch). Fix: "
                       f"num_micro_batches=1, or one_executable=None.")
    m = self.mesh
    if m is not None and not isinstance(m, (Mesh, AbstractMesh)):
      raise MeshError(f"{type(self).__name__}: mesh must be a jax.sharding.Mesh "
                      f"(e.g. jax.make_mesh((2, 4), ('data', 'model'))) or an "
                      f"AbstractMesh, got {type(m).__name__}.")

  # Whether num_micro_batches="auto" is allowed: the pipeline's stage search
  # picks it (``planner/pipeline.py``); the method is then replaced by one
  # with the chosen int before anything reads ``micro_batches``.
  chooses_micro_batches = False

  @property
  def micro_batches(self) -> int:
    if self.num_micro_batches == "auto":
      raise InputError(f"{self.name}: num_micro_batches='auto' is chosen when the "
                       f"step is planned. Fix: read the plan's num_micro_batches.")
    return int(self.num_micro_batches or 1)

  @property
  def name(self) -> str:
    return type(self).__name__


@dataclasses.dataclass(frozen=True)
class DataParallel(ParallelMethod):
  """Data parallelism with gradient accumulation.

  Args:
    mesh, num_micro_batches: see :class:`ParallelMethod`.
    batch_axes: mesh axes to split the batch over (default: all of them of
      size > 1).

  Example::

      @autopar.parallelize(method=autopar.DataParallel(num_micro_batches=4))
      def train_step(state, batch): ...
  """
  batch_axes: tuple[str, ...] | str | None = dataclasses.field(
      default=None, kw_only=True)

  def __post_init__(self, devices=None):
    super().__post_init__(devices)
    if isinstance(self.batch_axes, str):
      object.__setattr__(self, "batch_axes", (self.batch_axes,))
    elif self.batch_axes is not None:
      object.__setattr__(self, "batch_axes", tuple(self.batch_axes))
    if self.mesh is not None and self.batch_axes is not None:
      check_axes(self.batch_axes, self.mesh, f"{self.name}(batch_axes=...)")


@dataclasses.dataclass(frozen=True)
class Zero2Parallel(DataParallel):
  """ZeRO-2: data parallel with reduce-scattered gradients and sharded optimizer state."""


@dataclasses.dataclass(frozen=True)
class Zero3Parallel(DataParallel):
  """ZeRO-3 / FSDP: as :class:`Zero2Parallel`, with the parameters sharded too.

  Each equation of the forward and backward pass that reads a parameter
  all-gathers it for itself, once its other operands are made, and the
  gathered copy is freed after it: the step holds one layer's gathered
  weights at a time, for one all-gather per reader per micro-batch (a
  dense kernel's forward and backward matmuls: two).
  """


@dataclasses.dataclass(frozen=True)
class ShardParallel(ParallelMethod):
  """Let autopar's planner choose every sharding.

  Args:
    mesh, num_micro_batches: see :class:`ParallelMethod`.
    option: the solver's knobs.
    plan: a saved :class:`autopar.Plan` to use instead of solving.

  Example::

      method = autopar.ShardParallel(mesh=jax.make_mesh((2, 4), ("data", "model")),
                                     num_micro_batches=4)
  """
  option: AutoShardingOption = dataclasses.field(
      default_factory=AutoShardingOption, kw_only=True)
  plan: Any = dataclasses.field(default=None, kw_only=True)
  # Alpa's name for `option`. Not a field: it sets `option`.
  auto_sharding_option: dataclasses.InitVar[Any] = dataclasses.field(
      default=None, kw_only=True)

  def __post_init__(self, devices=None, auto_sharding_option=None):
    super().__post_init__(devices)
    if auto_sharding_option is not None:
      if self.option != AutoShardingOption():
        raise InputError("ShardParallel: both option= and auto_sharding_option= "
                         "given; auto_sharding_option= is Alpa's name for option=. "
                         "Fix: give one.")
      object.__setattr__(self, "option", auto_sharding_option)
    if not isinstance(self.option, AutoShardingOption):
      raise InputError(f"ShardParallel: option must be an autopar.AutoShardingOption, "
                       f"got {type(self.option).__name__}.")
    if self.mesh is not None:
      check_option_axes(self.option, self.mesh)


@dataclasses.dataclass(frozen=True)
class PipeshardParallel(ParallelMethod):
  """Pipeline stages, each on its own submesh with its own sharding plan.

  The forward pass of the function given to ``autopar.value_and_grad`` is
  cut into layers, consecutive layers are grouped into stages, each stage
  gets a sub-block of the mesh and a plan of its own (the ILP), and
  micro-batches stream through the stages under ``schedule``. Gradients
  are accumulated on each stage's submesh and synchronised once, after the
  last micro-batch; each stage updates its own state. See
  ``docs/pipeline.md``.

  Args:
    mesh, num_micro_batches: see :class:`ParallelMethod`. Here
      ``num_micro_batches`` may also be ``"auto"``: the stages are planned
      for each divisor of the batch 1, 2, 4, ... (each at least twice the
      last, up to 64) and the number whose plan is fastest in the search's
      model and fits the memory budget is kept (``plan.micro_batch_search``
      and ``plan.summary()`` say what each took); not with ``num_stages=1``.
    num_stages: an int, or ``"auto"``: the stage search picks it (1, the
      whole mesh as one stage, when pipelining does not pay). Under
      ``"interleaved-1f1b"`` and ``"zb-v"``, the number of submeshes (an
      int), each running ``virtual_stages`` stages.
    stage_mesh_shapes: ``"auto"``, or one submesh shape per stage (each of
      the mesh's rank, e.g. ``[(1, 4), (1, 4)]`` of a ``(2, 4)`` mesh); they
      tile the mesh in row-major order.
    schedule: ``"1f1b"`` (stage ``s`` of ``S`` holds ``S - s`` micro-batches'
      activations), ``"gpipe"`` (all forwards, then all backwards) or
      ``"zb-h1"`` (zero bubble: each backward split into the cotangents of
      the stage's inputs and, later, its weights' gradient, which fills
      the bubble; every stage holds up to ``S`` micro-batches' activations,
      1F1B's most), or ``"auto"``: the stage search plans each of 1F1B and
      ZB-H1 (and, with the number of submeshes given, interleaved 1F1B with
      2 stages a submesh and ZB-V; else ZB-V on 2, 4, 8, ... submeshes, up
      to half the layers) and keeps the fastest in its model that fits the
      memory budget (``plan.summary()`` says what each would take), or
      ``"interleaved-1f1b"``: ``num_stages`` submeshes (alike) each running
      ``virtual_stages`` stages, the bubble divided by ``virtual_stages``
      for as many times the messages between stages, or ``"zb-v"``:
      ``num_stages`` submeshes (alike) each running 2 stages in a V
      (submesh ``d`` stages ``d`` and ``2 S - 1 - d``), the backwards split
      as under ZB-H1, the bubble half ZB-H1's up to 4 submeshes and below
      it beyond, holding 1F1B's most activations.
      Under a memory budget, each of a submesh's stages is held to an even
      share of it. See ``docs/pipeline.md``.
    virtual_stages: stages per submesh under ``"interleaved-1f1b"``; 2
      under ``"zb-v"`` (set if left at 1); 1 otherwise.
    layers: ``"auto"`` (the repeated blocks, else cuts of balanced flops) or
      ``"manual"`` (where the loss function calls
      ``autopar.mark_pipeline_boundary()``).
    option: the solver's knobs (:class:`AutoShardingOption`), for every stage.
    plan: a saved pipeline :class:`autopar.Plan` to run without solving.

  Example::

      method = autopar.PipeshardParallel(mesh=jax.make_mesh((2, 4), ("data", "model")),
                                         num_micro_batches=8, num_stages=2)
  """
  chooses_micro_batches = True

  num_stages: int | str = dataclasses.field(default="auto", kw_only=True)
  stage_mesh_shapes: Any = dataclasses.field(default="auto", kw_only=True)
  schedule: str = dataclasses.field(default="1f1b", kw_only=True)
  virtual_stages: int = dataclasses.field(default=1, kw_only=True)
  layers: str = dataclasses.field(default="auto", kw_only=True)
  option: AutoShardingOption = dataclasses.field(
      default_factory=AutoShardingOption, kw_only=True)
  plan: Any = dataclasses.field(default=None, kw_only=True)

  def __post_init__(self, devices=None):
    super().__post_init__(devices)
    name = "PipeshardParallel"
    if self.one_executable:
      raise InputError(f"{name}: one_executable=True; a pipeline runs each stage's "
                       f"passes as their own executables. Fix: leave it None, or use "
                       f"ShardParallel for one executable per step.")
    k = self.num_stages
    if k != "auto" and (not isinstance(k, (int, np.integer)) or isinstance(k, bool)
                        or k < 1):
      raise InputError(f"{name}: num_stages={k!r}; expected 'auto' or a positive int.")
    if self.num_micro_batches == "auto" and k == 1:
      raise InputError(f"{name}: num_micro_batches='auto' with num_stages=1: the "
                       f"stage search, which picks the micro-batches, does not run "
                       f"for one stage. Fix: give num_micro_batches as an int, or "
                       f"num_stages='auto' or 2 or more.")
    if self.schedule not in (*PIPELINE_SCHEDULES, "auto"):
      raise InputError(f"{name}: schedule={self.schedule!r}; expected one of "
                       f"{', '.join(map(repr, (*PIPELINE_SCHEDULES, 'auto')))}.")
    v = self.virtual_stages
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
      raise InputError(f"{name}: virtual_stages={v!r}; expected a positive int.")
    if self.schedule == "zb-v" and v not in (1, 2):
      raise InputError(f"{name}: schedule='zb-v' with virtual_stages={v}; it runs 2 "
                       f"stages on each submesh (a V). Fix: drop virtual_stages, or use "
                       f"schedule='interleaved-1f1b' for {v}.")
    if self.schedule == "zb-v":
      v = 2
    object.__setattr__(self, "virtual_stages", int(v))
    if self.schedule in VIRTUAL_SCHEDULES:
      what = repr(self.schedule)
      if v < 2:
        raise InputError(f"{name}: schedule={what} with virtual_stages={v}; "
                         f"it runs virtual_stages >= 2 stages on each submesh. Fix: "
                         f"virtual_stages=2 (or more), or schedule='1f1b'.")
      submeshes = self.num_submeshes
      if submeshes == "auto":
        raise InputError(f"{name}: schedule={what} needs the number of "
                         f"submeshes: num_stages (an int) or stage_mesh_shapes. Fix: "
                         f"give num_stages.")
      if submeshes < 2:
        raise InputError(f"{name}: schedule={what} on {submeshes} submesh; "
                         f"it spreads stages over 2 or more. Fix: num_stages=2 or "
                         f"more, or ShardParallel.")
      if (self.schedule == "interleaved-1f1b"
          and self.num_micro_batches not in (None, "auto")
          and self.num_micro_batches % submeshes):
        raise InputError(f"{name}: schedule='interleaved-1f1b' runs micro-batches in "
                         f"groups of the number of submeshes ({submeshes}); "
                         f"num_micro_batches={self.num_micro_batches} is not a multiple "
                         f"of it. Fix: use a multiple of {submeshes}.")
    elif v != 1:
      raise InputError(f"{name}: virtual_stages={v} with schedule={self.schedule!r}; "
                       f"only 'interleaved-1f1b' and 'zb-v' run several stages on a "
                       f"submesh. Fix: schedule='interleaved-1f1b', or drop "
                       f"virtual_stages.")
    if self.layers not in ("auto", "manual"):
      raise InputError(f"{name}: layers={self.layers!r}; expected 'auto' or 'manual' "
                       f"(boundaries marked with autopar.mark_pipeline_boundary()).")
    if not isinstance(self.option, AutoShardingOption):
      raise InputError(f"{name}: option must be an autopar.AutoShardingOption, got "
                       f"{type(self.option).__name__}.")
    shapes = self.stage_mesh_shapes
    if shapes != "auto":
      try:
        shapes = tuple(tuple(int(d) for d in s) for s in shapes)
      except TypeError:
        raise InputError(f"{name}: stage_mesh_shapes={self.stage_mesh_shapes!r}; "
                         f"expected 'auto' or one shape (a tuple of ints) per "
                         f"stage.") from None
      object.__setattr__(self, "stage_mesh_shapes", shapes)
      if k != "auto" and len(shapes) != k:
        raise InputError(f"{name}: num_stages={k} but {len(shapes)} "
                         f"stage_mesh_shapes given. Fix: give one shape per stage.")
      if self.mesh is not None:
        tile(tuple(axis_sizes_of(self.mesh).values()), shapes)
    if self.mesh is not None:
      check_option_axes(self.option, self.mesh)

  @property
  def num_submeshes(self) -> int | str:
    """The number of submeshes the stages are laid on: ``num_stages`` (an
    int, or "auto"), or the number of ``stage_mesh_shapes`` given. (Under
    interleaved 1F1B and ZB-V each runs ``virtual_stages`` stages.)"""
    shapes = self.stage_mesh_shapes
    return self.num_stages if shapes == "auto" else len(shapes)


def check_option_axes(option: AutoShardingOption, mesh) -> None:
  """Every mesh axis an option names exists (a typo is an error, never
  ignored)."""
  names = axis_names_of(mesh)
  for what, axes in (("mesh_alpha", [a for a, _ in option.mesh_alpha or ()]),
                     ("mesh_beta", [a for a, _ in option.mesh_beta or ()]),
                     ("force_batch_dim_to_mesh_dim", option.forced_batch_axes(mesh) or ())):
    for a in axes:
      if a not in names:
        raise MeshError(f"AutoShardingOption({what}=...): mesh axis {a!r} does not "
                        f"exist; the mesh has axes {names}. Fix: use one of {names}.")


def _mesh_of_devices(devices, where: str):
  """Alpa's ``devices=``: a mesh as it is, or a 1-D "data" mesh over a
  sequence of devices."""
  if isinstance(devices, (Mesh, AbstractMesh)):
    return devices
  try:
    devs = np.asarray(list(devices), dtype=object).reshape(-1)
  except TypeError:
    devs = None
  if devs is None or not len(devs) or not all(isinstance(d, jax.Device) for d in devs):
    raise MeshError(f"{where}: devices={devices!r}; expected a jax.sharding.Mesh or a "
                    f"sequence of jax devices (e.g. jax.devices()).")
  return Mesh(devs, ("data",), axis_types=(AxisType.Auto,))


def accumulation_dtype(dtype, setting: str | None):
  """The dtype a gradient of ``dtype`` is summed in over micro-batches and
  devices, under a method's ``grad_accumulation_dtype``."""
  dtype = np.dtype(dtype)
  if setting == "float32" and dtype in (np.dtype(jnp.bfloat16), np.dtype(np.float16)):
    return np.dtype(np.float32)
  return dtype


# -- meshes -------------------------------------------------------------------

def axis_names_of(mesh) -> tuple[str, ...]:
  return tuple(mesh.axis_names)


def axis_sizes_of(mesh) -> dict[str, int]:
  return dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))


def split_axes_of(mesh) -> tuple[str, ...]:
  """The mesh's axes of size > 1, in order: the only ones that split
  anything. The planners search over these alone, since an axis of size 1
  changes no plan (a mesh such as MaxText's, 12 axes of which 11 have size
  1, is planned as the mesh of its one other axis); plans stay on the
  user's mesh, and name an axis of size 1 only where the user did (hints,
  pins, batch axes)."""
  return tuple(a for a, s in axis_sizes_of(mesh).items() if s > 1)


def check_axes(axes, mesh, where: str) -> None:
  names = axis_names_of(mesh)
  for a in axes:
    if a not in names:
      raise MeshError(f"{where}: mesh axis {a!r} does not exist; the mesh has "
                      f"axes {names} with sizes {tuple(mesh.axis_sizes)}. Fix: "
                      f"use one of {names}.")


def resolve_mesh(method: ParallelMethod):
  """The method's mesh, or a 1-D ``"data"`` mesh over all devices."""
  if method.mesh is not None:
    return method.mesh
  devices = np.array(jax.devices())
  return Mesh(devices, ("data",), axis_types=(AxisType.Auto,))


def auto_mesh(mesh):
  """The same mesh with every axis of type Auto (what stages compute on).

  Stages are traced from pre-made jaxprs, so they run under XLA's automatic
  partitioner whatever axis types the user's mesh has; results are handed
  back on the user's own mesh.
  """
  if isinstance(mesh, AbstractMesh):
    return AbstractMesh(tuple(mesh.axis_sizes), tuple(mesh.axis_names),
                        axis_types=(AxisType.Auto,) * len(mesh.axis_names))
  if all(t == AxisType.Auto for t in mesh.axis_types):
    return mesh
  return Mesh(mesh.devices, mesh.axis_names,
              axis_types=(AxisType.Auto,) * len(mesh.axis_names))
