"""``@autopar.parallelize``: the only module that sees every stage.

trace -> split -> plan -> lower -> execute, cached per input signature.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import math
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh

from autopar import jax_compat as jc
from autopar.planner import cache as plan_cache
from autopar.runtime import base as runtime
from autopar.errors import InputError, MarkerError, PlanError
from autopar.runtime.executor import Executable
from autopar.runtime import pipeline_build
from autopar.planner import pipeline as pipeline_compile
from autopar.runtime.pipeline import PipelineExecutable
from autopar.frontend.hints import check_hints
from autopar.frontend.loss import check_loss
from autopar.backend.lower import lower_step
from autopar.method import (ParallelMethod, PipeshardParallel, ShardParallel,
                            Zero2Parallel, Zero3Parallel, auto_mesh, axis_sizes_of,
                            resolve_mesh)
from autopar.costs.cost_model import dtype_name
from autopar.plan import Plan, ValuePlan
from autopar.frontend.pytrees import Partition
from autopar.costs.calibrate import measured_option
from autopar.costs.devices import dominant_float_dtype, hardware_option
from autopar.frontend.remat import remat_mode
from autopar.backend.hlo import compiled_peak
from autopar.planner.replan import Replanner
from autopar.planner.shard import Progress, batch_axes_for, keeps_batch_whole, plan_auto
from autopar.planner.preset import plan_preset
from autopar.frontend.split import (MIXED, OutputKind, SplitStep, apply_at, instantiate_split,
                            outputs_at, scale_at, split_step)
from autopar.frontend.trace import (ArgFlags, LeafInfo, TracedStep, abstract_leaves, arg_names,
                           batch_candidates, check_batch_leaves, classify_args,
                           state_args, trace_step, trace_step_any_batch)

__all__ = ["parallelize", "ParallelizedFunction", "StepSignature", "check_donation"]


def parallelize(fun: Callable | None = None, *, method: ParallelMethod | None = None,
                donate_argnums: int | Sequence[int] | str = "auto",
                batch_argnums: int | Sequence[int] | str = "auto",
                static_argnums: int | Sequence[int] | str = "auto",
                output_reductions: Mapping[str, str] | None = None):
  """Parallelizes a single-device training step over a device mesh.

  Use as ``@parallelize`` or ``@parallelize(method=..., ...)``.

  Args:
    fun: the step, e.g. ``train_step(state, batch) -> (new_state, loss)``. It
      computes its gradients with :func:`autopar.grad` or
      :func:`autopar.value_and_grad`, which marks where the step is split into
      the per-micro-batch gradient computation and the once-per-step update.
    method: how to parallelize (default ``ShardParallel()`` over all devices).
    donate_argnums: arguments whose buffers the step may reuse (the train
      state). ``"auto"`` donates a first argument that looks like a flax
      ``TrainState``.
    batch_argnums: arguments holding the batch; every leaf has a leading
      batch axis that is split into micro-batches and over devices.
      ``"auto"``: the arguments whose array leaves all share one leading
      size, other than the model and optimizer state (``step(state, batch)``,
      ``step(model, optimizer, batch)``, ``step(params, opt_state, x, y)``);
      an error names the candidates when that is ambiguous.
    static_argnums: arguments compiled in as constants. ``"auto"`` treats
      Python scalars, strings and None as static. Inside the other
      arguments, array leaves are traced and every other leaf (a function, a
      string) is static, as under ``equinox.filter_jit``.
    output_reductions: output path (as ``plan.outputs`` names it, or a glob)
      -> ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``: how to combine an
      output over micro-batches and devices where the program does not say
      (autopar derives it for sums, means, maxes and mins over the batch's
      rows and what is computed from them; see docs/gradient_accumulation.md).

  Returns:
    A :class:`ParallelizedFunction`: call it like ``fun``; results come back
    sharded per the plan.

  Example::

      @autopar.parallelize(method=autopar.DataParallel(num_micro_batches=4))
      def train_step(state, batch):
        def loss_fn(params):
          return jnp.mean((state.apply_fn(params, batch["x"]) - batch["y"]) ** 2)
        loss, grads = autopar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss
  """
  def wrap(f):
    return ParallelizedFunction(f, method=method or ShardParallel(),
                                donate_argnums=donate_argnums,
                                batch_argnums=batch_argnums,
                                static_argnums=static_argnums,
                                output_reductions=output_reductions)
  if fun is None:
    return wrap
  return wrap(fun)


@dataclasses.dataclass(frozen=True)
class _Prepared:
  flags: ArgFlags
  leaves: tuple[LeafInfo, ...]
  inputs: Partition            # of the tuple of non-static arguments
  values: list                 # their traced leaves
  key: Any
  names: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class StepSignature:
  """One call signature of a step, as a runtime needs it
  (:meth:`ParallelizedFunction.signature`).

  Attributes:
    plan: the step's plan for these arguments.
    static_argnums: the arguments passed as static Python values.
    traced: the traced step: its outputs (``traced.out_paths``,
      ``traced.outputs``) and the arguments it changes in place
      (``trace.split_updates`` writes them back).
  """
  plan: Plan
  static_argnums: tuple[int, ...]
  traced: TracedStep

  @property
  def num_outputs(self) -> int:
    return len(self.traced.out_paths)


class ParallelizedFunction:
  """A step wrapped by :func:`parallelize`.

  Calling it runs the step; :meth:`get_executable` returns the compiled
  stages and plan; :meth:`plan` plans without compiling.
  """

  def __init__(self, fun: Callable, *, method: ParallelMethod, donate_argnums,
               batch_argnums, static_argnums, output_reductions=None):
    if not isinstance(method, ParallelMethod):
      raise InputError(f"parallelize: method must be one of ShardParallel, "
                       f"DataParallel, Zero2Parallel, Zero3Parallel; got "
                       f"{type(method).__name__}.")
    for name, val in (("donate_argnums", donate_argnums),
                      ("static_argnums", static_argnums),
                      ("batch_argnums", batch_argnums)):
      if isinstance(val, str) and val != "auto":
        raise InputError(f"parallelize: {name}={val!r}; expected 'auto', an int "
                         f"or a tuple of ints.")
    self.fun = fun
    self.method = method
    self.donate_argnums = donate_argnums
    self.batch_argnums = batch_argnums
    self.static_argnums = static_argnums
    if output_reductions is not None and not isinstance(output_reductions, Mapping):
      raise InputError(f"parallelize: output_reductions must map output paths to "
                       f"'sum', 'mean', 'max' or 'min', got "
                       f"{type(output_reductions).__name__}.")
    self.output_reductions = dict(output_reductions or {})
    self._executables: dict[Any, Executable] = {}
    self._plans: dict[Any, tuple[Plan, int]] = {}    # key -> (plan, micro-batch size)
    self._splits: dict[Any, SplitStep] = {}
    self._pipelines: dict[Any, Any] = {}
    self._shard_delegate: ParallelizedFunction | None = None
    self._any_split: dict[Any, SplitStep | None] = {}   # symbolic-batch split
    # Without a symbolic split: one concrete trace to compare others with.
    self._reference: dict[Any, Any] = {}      # key -> TracedStep
    self._state: dict[Any, frozenset] = {}    # signature -> arguments holding state
    self._lock = threading.Lock()
    self._costs_resolved = False
    functools.update_wrapper(self, fun)

  @property
  def _name(self) -> str:
    return getattr(self.fun, "__name__", "step")

  # -- public ------------------------------------------------------------------

  def __call__(self, *args):
    # On the active runtime: this process, or the Ray cluster's host workers.
    return runtime.active().call(self, args)

  # -- for runtimes (runtime.py) ------------------------------------------------

  def run_here(self, *args) -> tuple[Any, TracedStep]:
    """Runs the step on this process's devices (a Ray host worker: on its
    part of the global mesh). Returns the step's whole result, with the
    values of the arguments it changed in place not yet written back, and
    the traced step that says how to write them back
    (``trace.split_updates``)."""
    prep = self._prepare(args)
    _check_not_donated(prep, self._name)
    check_donation(prep.leaves, prep.values, self._name)
    exe = self._executable(prep)
    traced = exe.split.traced
    return traced.outputs.merge(exe.run(exe.place(prep.values))), traced

  def check_donation(self, args: Sequence[Any]) -> None:
    """Raises if ``args`` pass one array as two donated leaves, or as a
    donated and a kept one (:func:`check_donation`)."""
    prep = self._prepare(args)
    check_donation(prep.leaves, prep.values, self._name)

  def signature(self, args: Sequence[Any]) -> StepSignature:
    """What a runtime needs before running a call on ``args`` (arrays or
    ``jax.ShapeDtypeStruct``s): the plan, and the step's outputs."""
    prep = self._prepare(args)
    plan, micro = self._plan(prep)
    if isinstance(self.method, PipeshardParallel) and self._one_stage(prep) is None:
      traced = self._pipeline(prep)[0].split.traced
    else:
      traced = self._traced(prep, micro).traced
    return StepSignature(plan=plan, static_argnums=tuple(prep.flags.static),
                         traced=traced)

  def with_method(self, method: ParallelMethod) -> "ParallelizedFunction":
    """The same step, with the same settings, under another method."""
    return ParallelizedFunction(self.fun, method=method,
                                donate_argnums=self.donate_argnums,
                                batch_argnums=self.batch_argnums,
                                static_argnums=self.static_argnums,
                                output_reductions=self.output_reductions)

  def get_executable(self, *args) -> Executable:
    """The compiled step for these arguments (compiled once per signature).

    Example::

        exe = train_step.get_executable(state, batch)
        print(exe.plan.summary()); print(exe.schedule)
    """
    return self._executable(self._prepare(args))

  def plan(self, *args) -> Plan:
    """Plans the step without compiling or touching devices.

    The arguments may be ``jax.ShapeDtypeStruct`` pytrees (e.g. from
    ``jax.eval_shape``) and the method's mesh an ``AbstractMesh``.
    """
    plan, _ = self._plan(self._prepare(runtime.active().abstractify(args)))
    if isinstance(self.method, ShardParallel) and self.method.plan is None:
      # (Shapes only: the plan must not keep the caller's arrays alive.)
      shapes = jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=jax.typeof(x).weak_type)
          if isinstance(x, jax.Array) else
          jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, np.ndarray) else x, args)
      # The solver's problems where the plan keeps them (a plan the solver made),
      # and a weak reference to the step for what that cannot answer.
      problems = plan.replan.problems if plan.replan is not None else ()
      plan = dataclasses.replace(plan, replan=Replanner(
          problems=problems, step_ref=weakref.ref(self), args=tuple(shapes),
          pins=self.method.option.pin_map))
    return plan

  # -- pipeline ----------------------------------------------------------------

  def _prepare(self, args: Sequence[Any]) -> _Prepared:
    names = arg_names(self.fun, len(args))
    flags = classify_args(args, static_argnums=self.static_argnums,
                          batch_argnums=self.batch_argnums,
                          donate_argnums=self.donate_argnums, fn_name=self._name,
                          names=names, not_batch=self._state_args(args, names))
    leaves, inputs, values = abstract_leaves(args, flags, names)
    statics = []
    for i in flags.static:
      try:
        hash(args[i])
      except TypeError as e:
        raise InputError(
            f"{self._name}: static argument {names[i]} (argument {i}) of type "
            f"{type(args[i]).__name__} is not hashable, so it cannot key the "
            f"compilation cache. Fix: make it hashable (e.g. a tuple or a frozen "
            f"dataclass), or pass it as arrays and set static_argnums.") from e
      statics.append((i, args[i]))
    key = (flags, tuple(statics), inputs.key,
           tuple((l.shape, l.dtype, l.weak_type) for l in leaves))
    return _Prepared(flags=flags, leaves=tuple(leaves), inputs=inputs,
                     values=values, key=key, names=tuple(names))

  def _state_args(self, args: Sequence[Any], names: Sequence[str]) -> frozenset[int]:
    """With ``batch_argnums="auto"`` and more than one argument it could take
    for the batch: the arguments that hold state instead, the step's own
    word on it (``trace.state_args``: what the gradient is taken of, what the
    update reads), from one trace of the step on the arguments as given,
    once per signature. ``step(w, x)`` with plain arrays then takes ``x``,
    whatever the two's leading sizes."""
    if self.batch_argnums != "auto":
      return frozenset()
    flags = classify_args(args, static_argnums=self.static_argnums, batch_argnums=(),
                          donate_argnums=(), fn_name=self._name, names=names)
    static = flags.static
    if len(batch_candidates(args, static)) < 2:
      return frozenset()
    leaves, inputs, _ = abstract_leaves(args, flags, names)
    key = (static, inputs.key, tuple((l.shape, l.dtype) for l in leaves),
           tuple((i, args[i]) for i in static))
    if key not in self._state:
      try:
        statics = {i: args[i] for i in static}
        traced = trace_step(self.fun, [statics.get(i) for i in range(len(args))], flags,
                            leaves, inputs, micro_batch_size=0,
                            mesh=auto_mesh(resolve_mesh(self.method)), names=names)
        self._state[key] = state_args(traced.jaxpr, leaves)
      except Exception:  # noqa: BLE001 - a step that fails says so when traced again
        self._state[key] = frozenset()
    return self._state[key]

  def _plan(self, prep: _Prepared) -> tuple[Plan, int]:
    """The plan for these arguments, and the micro-batch size (rows)."""
    if prep.key in self._plans:
      return self._plans[prep.key]
    with _gc_paused():
      self._plans[prep.key] = self._plan_uncached(prep)
    return self._plans[prep.key]

  def _pipeline(self, prep: _Prepared):
    """(prepared trace, plan, (cut, choices)) of a PipeshardParallel step."""
    if prep.key not in self._pipelines:
      self._resolve_costs(prep)
      method = self.method
      mesh = resolve_mesh(method)
      with _gc_paused():
        pre = pipeline_compile.prepare(self.fun, self._args_for_trace(prep), prep, method,
                                       name=self._name,
                                       output_reductions=self.output_reductions)
        plan, chosen = pipeline_compile.plan_pipeline(pre, method, mesh)
      self._pipelines[prep.key] = (pre, plan, chosen)
    return self._pipelines[prep.key]

  def _not_dearer_than_zero(self, prep: _Prepared, plan: Plan, micro: int,
                            batch_size: int) -> Plan:
    """ShardParallel's plan, or a ZeRO preset's layout where that is cheaper
    under the same costs. The ILP's space holds data parallelism's layout
    but not ZeRO's (an update on each device's shard of the state): ZeRO-2
    and ZeRO-3 are priced as their presets are (``preset.py``) with this
    method's option, and the cheapest plan is kept; the summary's solver
    line says when a preset's was. Not tried with pins, a forced batch
    split, all-gathers forbidden, or where the preset's memory is over the
    budget."""
    method = self.method
    option = method.option
    mesh = resolve_mesh(method)
    if (option.pins or option.force_data_parallel or not option.allow_all_gather
        or option.forced_batch_axes(mesh) is not None):
      return plan                     # (ZeRO gathers the state it splits)
    split = self._split(prep, micro)
    if keeps_batch_whole(split, method):
      return plan                      # a batch ZeRO cannot split
    sizes = axis_sizes_of(mesh)
    outputs = self._outputs(prep, split, batch_size)
    best, taken, prices = plan, None, {}
    for preset in (Zero2Parallel, Zero3Parallel):
      other = preset(mesh=method.mesh, num_micro_batches=method.num_micro_batches,
                     remat=method.remat,
                     grad_accumulation_dtype=method.grad_accumulation_dtype)
      if micro % math.prod(sizes[a] for a in batch_axes_for(other, mesh, split.hints)):
        return plan                    # a batch ZeRO cannot split
      try:
        candidate = plan_preset(split, other, mesh,
                                batch_size=batch_size, outputs=outputs,
                                trace_local=lambda rows: self._split(prep, rows),
                                option=option, price_cache=prices)
      except (InputError, PlanError):
        continue                       # the preset cannot split this batch
      budget = option.memory_budget_per_device
      if budget is not None and candidate.memory_per_device > budget:
        continue
      if candidate.objective < best.objective * (1 - 1e-3):
        best, taken = candidate, other.name
    if taken is None:
      return plan
    s = plan.solver
    note = (f"{s.status}; {taken}'s layout taken: it costs {best.objective:.4g} s, "
            f"the ILP's best {plan.objective:.4g} s")
    # The ILP's problems stay with the plan: explain and cost_if price the
    # ILP's alternatives to it (rows solved by the ILP; the taken layout is
    # not among them, which the solver line says).
    return dataclasses.replace(best, method=method.name, replan=plan.replan,
                               solver=dataclasses.replace(s, status=note))

  def _keep_plan(self, prep: _Prepared, exe: Executable, first: Plan) -> Executable:
    """``exe``, whose plan (made within a smaller planning budget than the
    method's) becomes this step's plan: for ``step.plan`` and in the plan
    cache under the method's own key, so the next process compiles it at
    once. Its fingerprint is the method's."""
    if exe.plan is first:
      return exe
    plan = dataclasses.replace(exe.plan, fingerprint=first.fingerprint)
    self._plans[prep.key] = (plan, self._plans[prep.key][1])
    if self.method.option.plan_cache and first.fingerprint:
      plan_cache.store(plan_cache.plan_key(dict(first.fingerprint)), plan)
    return dataclasses.replace(exe, plan=plan)

  def _one_stage(self, prep: _Prepared) -> "ParallelizedFunction | None":
    """For a PipeshardParallel step of one stage (num_stages=1, or the
    search found pipelining does not pay): the same step under
    ShardParallel on the whole mesh, which runs it."""
    method = self.method
    if not isinstance(method, PipeshardParallel):
      return None
    if method.num_stages != 1 and (method.plan is not None and
                                   len(method.plan.stages) > 1 or
                                   method.plan is None and
                                   len(self._pipeline(prep)[1].stages) > 1):
      return None
    if self._shard_delegate is None:
      self._shard_delegate = self.with_method(ShardParallel(
          mesh=method.mesh, num_micro_batches=method.num_micro_batches,
          remat=method.remat, grad_accumulation_dtype=method.grad_accumulation_dtype,
          option=method.option,
          plan=method.plan if method.plan is not None and not method.plan.stages
          else None))
    return self._shard_delegate

  def _resolve_costs(self, prep: _Prepared) -> None:
    """The method's option takes its costs from the hardware (once): the
    mesh's calibration with ``costs="measured"``, else the device kind's
    figures (``devices.py``) for axes and rates not given by hand."""
    option = getattr(self.method, "option", None)
    if option is None or self._costs_resolved:
      return
    mesh = resolve_mesh(self.method)
    if option.costs == "measured":
      option = measured_option(option, mesh)
    else:
      dtype = dominant_float_dtype([(dtype_name(l.dtype), math.prod(l.shape))
                                    for l in prep.leaves])
      option = hardware_option(option, mesh, dtype)
    self.method = dataclasses.replace(self.method, option=option)
    self._costs_resolved = True

  def _plan_uncached(self, prep: _Prepared) -> tuple[Plan, int]:
    self._resolve_costs(prep)
    method = self.method
    if isinstance(method, PipeshardParallel):
      one = self._one_stage(prep)
      if one is not None:
        return one._plan(prep)
      pre, plan, _ = self._pipeline(prep)
      return plan, pre.ctx.micro
    mesh = resolve_mesh(method)
    n = method.micro_batches
    sizes = axis_sizes_of(mesh)
    # The planner chooses ShardParallel's batch axes among those that divide
    # the micro-batch; the presets split over theirs, which must divide it.
    solving = isinstance(method, ShardParallel) and method.plan is None
    batch_size = check_batch_leaves(prep.leaves, num_micro_batches=n, data_axes=(),
                                    data_size=1, fn_name=self._name)
    progress = Progress(self._name, getattr(getattr(method, "option", None),
                                            "verbose", False))
    micro = batch_size // n if batch_size else 0
    t0 = time.perf_counter()
    # The ILP plans each choice of batch axes on the step at its rows per
    # device; of the step at the full micro-batch it needs only the outputs,
    # which the symbolic trace gives without writing the step out at that size.
    split = self._traced(prep, micro)
    progress.add("trace", time.perf_counter() - t0,
                 f"{len(split.traced.jaxpr.jaxpr.eqns)} equations")
    # The presets split over their batch axes (by default every axis that no
    # sharding hint needs elsewhere), which must divide the micro-batch.
    if not solving:
      batch_axes = batch_axes_for(method, mesh, split.hints)
      check_batch_leaves(prep.leaves, num_micro_batches=n, data_axes=batch_axes,
                         data_size=math.prod(sizes[a] for a in batch_axes),
                         fn_name=self._name)
    fingerprint = plan_cache.fingerprint(split, method, mesh, batch_size)
    if not split.has_marker and n > 1:
      raise MarkerError(
          f"{self._name}: num_micro_batches={n} but the step has no grad marker, "
          f"so autopar cannot tell which part to run per micro-batch. Fix: "
          f"compute the gradients with autopar.grad or autopar.value_and_grad "
          f"instead of jax.grad / jax.value_and_grad.")
    saved = method.plan if isinstance(method, ShardParallel) else None
    if saved is not None:
      plan = _bind_saved_plan(saved, split, mesh, fingerprint, self._name)
    elif isinstance(method, ShardParallel) and split.has_marker:
      key = plan_cache.plan_key(fingerprint) if method.option.plan_cache else None
      cached = plan_cache.load(key) if key else None
      if cached is not None and dict(cached.fingerprint) == fingerprint:
        plan = _bind_saved_plan(cached, split, mesh, fingerprint, self._name)
        progress.add("plan cache hit", 0.0, str(plan_cache.cache_dir() / key))
      else:
        plan = plan_auto(split, method, mesh, batch_size=batch_size,
                         trace_local=lambda rows: self._split(prep, rows),
                         outputs=self._outputs(prep, split, batch_size),
                         progress=progress, any_batch=self._any_split.get(prep.key))
        plan = self._not_dearer_than_zero(prep, plan, micro, batch_size)
        plan = dataclasses.replace(plan, fingerprint=tuple(fingerprint.items()))
        if key:
          plan_cache.store(key, plan)
    else:
      plan = plan_preset(self._split(prep, micro), method, mesh, batch_size=batch_size,
                         outputs=self._outputs(prep, split, batch_size),
                         trace_local=lambda rows: self._split(prep, rows))
      plan = dataclasses.replace(plan, fingerprint=tuple(fingerprint.items()))
    if not plan.hints and split.hints:
      plan = dataclasses.replace(plan, hints=tuple(
          ValuePlan(f"hint {h.part}/{h.path}", h.shape_at(micro), dtype_name(h.dtype),
                    h.spec) for h in split.hints if h.axes()))
    data_size = math.prod(sizes[a] for a in plan.batch_axes)
    if split.has_marker and n * data_size > 1:
      check_loss(split.loss, self._name,
                 f"{n} micro-batch(es) x {data_size} device(s) along {plan.batch_axes}")
      for j, (path, kind, aval) in enumerate(zip(
          split.traced.out_paths, split.out_kinds,
          self._outputs(prep, split, micro).avals, strict=True)):
        if kind is OutputKind.OTHER:
          why = split.why.get(j, "its shape depends on the batch size other than as "
                              "rows in one dimension")
          fix = ("" if why.startswith(MIXED) else
                 f" Fix: compute it from sums, means, maxes or mins over the batch's "
                 f"rows, return it per example, or say how to combine it: "
                 f"parallelize(..., output_reductions={{{path!r}: 'mean'}}) (or 'sum', "
                 f"'max', 'min').")
          raise InputError(
              f"{self._name}: output {path} (shape {tuple(aval.shape)} for a "
              f"micro-batch of {micro} rows) is computed from the batch before the "
              f"gradient marker, and autopar cannot tell how to combine it over {n} "
              f"micro-batch(es) x {data_size} device(s): {why}.{fix}")
    return plan, micro

  def _outputs(self, prep: _Prepared, split: SplitStep, rows: int):
    """The step's outputs and gradients at a batch of ``rows`` rows."""
    if jc.is_symbolic_dim(split.traced.micro_batch_size) or \
        split.traced.micro_batch_size == rows:
      return outputs_at(split, rows)
    return outputs_at(self._split(prep, rows), rows)

  def _traced(self, prep: _Prepared, micro_batch_size: int) -> SplitStep:
    """The step split at a symbolic batch size if it can be traced so, else
    at ``micro_batch_size`` rows."""
    any_split = self._symbolic(prep) if micro_batch_size else None
    return any_split if any_split is not None else self._split(prep, micro_batch_size)

  def _symbolic(self, prep: _Prepared) -> SplitStep | None:
    """The step traced once at a symbolic batch size and split (cached), or
    None if it cannot be traced so (see trace_step_any_batch)."""
    if prep.key not in self._any_split:
      with remat_mode(self.method.remat):
        traced = trace_step_any_batch(self.fun, self._args_for_trace(prep),
                                      prep.flags, prep.leaves, prep.inputs,
                                      mesh=auto_mesh(resolve_mesh(self.method)),
                                      names=prep.names)
      self._any_split[prep.key] = (None if traced is None else split_step(
          traced, fn_name=self._name, output_reductions=self.output_reductions,
          remat=self.method.remat))
    return self._any_split[prep.key]

  def _split(self, prep: _Prepared, micro_batch_size: int) -> SplitStep:
    """The step traced and split at ``micro_batch_size`` rows (cached).

    One symbolic trace, split once, serves every batch size; a step that
    needs a concrete size is traced at each.
    """
    key = (prep.key, micro_batch_size)
    if key not in self._splits:
      any_split = self._symbolic(prep) if micro_batch_size else None
      if any_split is not None:
        split = instantiate_split(any_split, micro_batch_size)
      else:
        split = self._concrete(prep, micro_batch_size)
      self._splits[key] = split
    return self._splits[key]

  def _concrete(self, prep: _Prepared, rows: int) -> SplitStep:
    """The step traced at ``rows`` rows and split; where the batch is split
    (over micro-batches or devices), which of its dimensions hold rows is
    read against a trace at another size (``rows.py``)."""
    traced = self._trace_at(prep, rows)
    mesh = resolve_mesh(self.method)
    reference = None
    if rows and (self.method.micro_batches > 1 or math.prod(mesh.axis_sizes) > 1):
      known = [self._reference.get(prep.key), *(
          s.raw for (k, _), s in self._splits.items() if k == prep.key)]
      reference = next((t for t in known
                        if t is not None and t.micro_batch_size != rows), None)
      if reference is None:
        reference = self._reference.setdefault(prep.key, self._trace_at(prep, 2 * rows))
    return split_step(traced, fn_name=self._name, reference=reference,
                      output_reductions=self.output_reductions, remat=self.method.remat)

  def _trace_at(self, prep: _Prepared, rows: int):
    """The step traced at ``rows`` rows (uncached)."""
    with remat_mode(self.method.remat):
      return trace_step(self.fun, self._args_for_trace(prep), prep.flags,
                        prep.leaves, prep.inputs, micro_batch_size=rows,
                        mesh=auto_mesh(resolve_mesh(self.method)), names=prep.names)

  def _args_for_trace(self, prep: _Prepared) -> list:
    statics = dict(prep.key[1])
    return [statics.get(i) for i in range(len(prep.names))]

  def _executable(self, prep: _Prepared) -> Executable:
    with self._lock:
      exe = self._executables.get(prep.key)
      if exe is not None:
        return exe
      if isinstance(self.method, PipeshardParallel):
        one = self._one_stage(prep)
        if one is not None:
          exe = one._executable(prep)
          self._executables[prep.key] = exe
          return exe
        pre, plan, (cut, choices, _) = self._pipeline(prep)
        with jax.set_mesh(None):
          step = pipeline_build.compile_pipeline(pre, self.method,
                                                 resolve_mesh(self.method), cut, choices)
        exe = PipelineExecutable(plan=plan, step=step, static_argnums=prep.flags.static)
        self._executables[prep.key] = exe
        return exe
      exe = self._within_budget(prep, self._compile(prep))
      self._executables[prep.key] = exe
      return exe

  def _compile(self, prep: _Prepared) -> Executable:
    """The step planned and compiled under ``self.method`` (SPMD methods)."""
    plan, micro = self._plan(prep)
    with _gc_paused():
      split = self._split(prep, micro)
    mesh = resolve_mesh(self.method)
    if isinstance(mesh, AbstractMesh):
      raise PlanError(
          f"{self._name}: the method's mesh is an AbstractMesh, which can be "
          f"planned for but not run on. Fix: use .plan(*args) to plan, and run "
          f"with a concrete mesh (jax.make_mesh or autopar.global_mesh).")
    split_local = split
    data_size = math.prod(plan.axis_sizes[a] for a in plan.batch_axes)
    if split.has_marker and data_size > 1:
      split_local = self._split(prep, split.traced.micro_batch_size // data_size)
    # apply_grad runs once per step, on the whole batch's shapes (an output
    # such as jnp.arange(batch.shape[0]) has the whole batch's length).
    whole = micro * plan.num_micro_batches
    if whole == micro:
      apply = split.apply
    elif self._symbolic(prep) is not None:
      apply = apply_at(self._symbolic(prep), whole)
    else:
      apply = self._split(prep, whole).apply
    # Each group (a device's rows of a micro-batch) seeds the loss with the
    # whole batch's cotangents (loss.py), computed at the whole batch's size.
    scale = None
    if split.loss is not None and plan.num_micro_batches * data_size > 1:
      if self._symbolic(prep) is not None:
        scale = scale_at(self._symbolic(prep), whole)
      else:
        local, at_whole = split_local.loss, self._split(prep, whole).loss
        check_loss(local, self._name, f"{plan.num_micro_batches} micro-batch(es) x "
                   f"{data_size} device(s) along {plan.batch_axes}")
        if (local.kinds, local.sum_ops) != (at_whole.kinds, at_whole.sum_ops):
          raise InputError(
              f"{self._name}: the loss of {local.name} is computed from other sums "
              f"at {split_local.traced.micro_batch_size} rows (a device's share of "
              f"a micro-batch) than at the whole batch's {whole} (its program "
              f"changes with the batch size, and the step cannot be traced at a "
              f"symbolic one), so autopar cannot give each device the whole "
              f"batch's gradient. Fix: keep the loss's program the same for every "
              f"batch size, or say how the loss combines with "
              f"parallelize(..., output_reductions={{'loss': 'mean'}}).")
        scale = at_whole.scale
    if scale is not None and split.loss.forward_sums:
      warnings.warn(
          f"autopar: the gradient of the loss of {split.loss.name} needs sums over "
          f"the rows that depend on the parameters (a ratio or a log of such sums, "
          f"or a parameter-dependent factor of one) over the whole batch; to give "
          f"each device the whole batch's gradient, a first pass runs the forward "
          f"pass once more per step (stage 'loss_sums').", stacklevel=3)
    # autopar's stages compute on meshes of their own: a mesh the caller
    # set (jax.set_mesh) applies to the step's own code, not to them.
    with jax.set_mesh(None):
      lowered = lower_step(dataclasses.replace(split, apply=apply), split_local,
                           plan, mesh, accumulate=self.method.grad_accumulation_dtype,
                           scale=scale)
    return Executable(plan=plan, lowered=lowered, split=split,
                      static_argnums=prep.flags.static)

  def _within_budget(self, prep: _Prepared, exe: Executable) -> Executable:
    """``exe``, if what its compiled stages hold per device (arguments,
    outputs not aliased, temporaries, and what the step keeps between
    stages: ``hlo.compiled_step_memory``) is within the method's
    ``memory_budget_per_device``. Else the step is planned again with the
    planning budget scaled down by how far the compiled peak missed (and,
    once a planning budget is infeasible, halfway between it and the last
    feasible one), up to ``_BUDGET_TRIES`` times; a ``PlanError`` names the
    smallest compiled peak found if no plan fits. The ILP's memory model is XLA's
    approximately; this holds the budget on what the devices hold."""
    method = self.method
    option = getattr(method, "option", None)
    budget = getattr(option, "memory_budget_per_device", None)
    if budget is None or not isinstance(method, ShardParallel) or method.plan is not None:
      return exe
    planning, tried = float(budget), []
    low = None                      # the largest planning budget found infeasible
    first = exe.plan
    peak = compiled_peak(exe.plan, exe.stages, exe.schedule)
    tried.append((planning, peak))
    for _ in range(_BUDGET_TRIES):
      if peak <= budget:
        return self._keep_plan(prep, exe, first)
      # Scaled down by the miss; between the last infeasible and the last
      # planned budget once the model has said no (a bisection).
      high = planning
      planning = high * budget / peak if low is None else (low + high) / 2
      retry = self.with_method(dataclasses.replace(method, option=dataclasses.replace(
          option, memory_budget_per_device=planning)))
      try:
        exe = retry._compile(prep)
      except PlanError as e:
        if "memory_budget_per_device" not in str(e):
          raise                     # not a budget the model cannot meet
        low, planning = planning, high
        continue
      peak = compiled_peak(exe.plan, exe.stages, exe.schedule)
      tried.append((planning, peak))
    if peak <= budget:
      return self._keep_plan(prep, exe, first)
    smallest = min(p for _, p in tried)
    raise PlanError(
        f"{self._name}: no plan found whose compiled step fits memory_budget_per_device="
        f"{budget:.0f} bytes on mesh {axis_sizes_of(resolve_mesh(method))}: "
        f"the compiled peaks per device were "
        f"{', '.join(f'{p:.0f}' for _, p in tried)} bytes (planned within "
        f"{', '.join(f'{b:.0f}' for b, _ in tried)}); the smallest is {smallest:.0f}. "
        f"Fix: raise memory_budget_per_device to at least {smallest:.0f}, use more "
        f"micro-batches, remat, or a larger mesh.")


# Plans tried again, with a smaller planning budget, when the compiled step
# holds more than memory_budget_per_device (ParallelizedFunction._within_budget).
_BUDGET_TRIES = 3


def _check_not_donated(prep: _Prepared, name: str) -> None:
  """A buffer donated to an earlier call is an autopar error, not JAX's
  "Array has been deleted"."""
  for leaf, x in zip(prep.leaves, prep.values, strict=True):
    if isinstance(x, jax.Array) and x.is_deleted():
      raise InputError(
          f"{name}: argument leaf {leaf.path} (shape {leaf.shape}) was donated to "
          f"an earlier call of this step, which reused its buffer for the state it "
          f"returned. Fix: pass the state that call returned (state, loss = "
          f"step(state, batch)), or keep the inputs with donate_argnums=().")


def check_donation(leaves: Sequence[LeafInfo], values: Sequence[Any], name: str) -> None:
  """One array passed as two donated leaves (tied weights built by reuse),
  or as a donated leaf and a kept one, is an error before anything runs: a
  donated buffer is overwritten by one result (plain ``jax.jit`` crashes
  the process on it)."""
  donated: dict[Any, LeafInfo] = {}
  for leaf, x in zip(leaves, values, strict=True):
    if leaf.is_donated and isinstance(x, jax.Array):
      first = donated.setdefault(_buffer_key(x), leaf)
      if first is not leaf:
        raise InputError(
            f"{name}: donated argument leaves {first.path} and {leaf.path} are the "
            f"same array (shape {leaf.shape}): tied weights built by passing one "
            f"array twice. A donated buffer holds one result after the step, so "
            f"this state cannot be donated. Fix: give each leaf its own array "
            f"(jnp.copy one of them; to tie weights, keep one leaf and read it "
            f"twice in the model), or keep the inputs: donate_argnums=().")
  for leaf, x in zip(leaves, values, strict=True):
    if not leaf.is_donated and isinstance(x, jax.Array) and _buffer_key(x) in donated:
      raise InputError(
          f"{name}: argument leaf {leaf.path} (shape {leaf.shape}) is the same array "
          f"as the donated leaf {donated[_buffer_key(x)].path}, whose buffer the step "
          f"overwrites with a result. Fix: pass a copy (jnp.copy), or keep the "
          f"inputs: donate_argnums=().")


def _buffer_key(x: jax.Array):
  """What tells two arrays' buffers apart: the object (a sharded array put
  again on its own sharding is the same object), or for an array on one
  device its buffer (``jax.device_put`` of it makes a new object on the same
  buffer)."""
  if isinstance(x.sharding, jax.sharding.SingleDeviceSharding):
    try:
      return ("buffer", x.unsafe_buffer_pointer())
    except RuntimeError:       # deleted (donated earlier): the donation check says so
      pass
  return id(x)


@contextlib.contextmanager
def _gc_paused():
  """Pauses CPython's cyclic garbage collector while a step is planned.

  Tracing and planning a large model make millions of objects that live
  until planning ends; the collector would walk them again and again (about
  a quarter of the planning time of a 96-layer model). Nothing planning makes
  is lost: the collector runs as usual once it is back on.
  """
  if not gc.isenabled():
    yield
    return
  gc.disable()
  try:
    yield
  finally:
    gc.enable()


def _bind_saved_plan(saved: Plan, split: SplitStep, mesh, fingerprint, name: str
                     ) -> Plan:
  """Checks a saved plan against this step and mesh (its fingerprint), and
  attaches both."""
  leaves = split.traced.leaves
  details = {}
  for v, l in zip(saved.inputs, leaves):
    if v.name != l.path or tuple(v.shape) != tuple(l.shape):
      details["arguments"] = (
          f"it does not match the arguments: it has input {v.name} with shape "
          f"{tuple(v.shape)} where the step has {l.path} with shape {tuple(l.shape)}")
      break
  else:
    if len(saved.inputs) != len(leaves):
      details["arguments"] = (f"it does not match the arguments: it has "
                              f"{len(saved.inputs)} inputs but the step has "
                              f"{len(leaves)}")
  plan_cache.check_fingerprint(saved, fingerprint, name, details)
  check_hints({h.path: h for h in split.hints}, tuple(mesh.axis_names),
              saved.batch_axes, f"the saved plan (batch axes {saved.batch_axes})")
  return dataclasses.replace(saved, in_tree=split.traced.inputs, mesh=mesh)
