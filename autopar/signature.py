"""One input signature of a step: what autopar makes for it, made once.

A :class:`Signature` belongs to one ``ParallelizedFunction`` and one key of
its arguments (their tree, shapes, dtypes, static values and flags,
``api.py``'s ``_prepare``). It holds the method with the costs resolved for
these arguments, the step traced and split (at a symbolic batch size, else
at each size needed), the plan, and the compiled executable, each made on
first use under the signature's lock; a step's calls look it up by key.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import time
import warnings
import weakref
from typing import Any, Callable

import jax
from jax.sharding import AbstractMesh

from autopar.gc_pause import gc_paused
from autopar import jax_compat as jc
from autopar.backend.hlo import compiled_peak
from autopar.backend import saved_stages
from autopar.backend.lower import compiler_options, lower_step
from autopar.costs.calibrate import measured_option
from autopar.costs.cost_model import dtype_name
from autopar.costs.devices import dominant_float_dtype, hardware_option, platform_of
from autopar.costs.liveness import fusions_shared
from autopar.errors import InputError, MarkerError, PlanError
from autopar.frontend.align import first_difference
from autopar.frontend.hints import check_hints
from autopar.frontend.loss import check_loss
from autopar.frontend.remat import NoLayersWarning, layer_loop, remat_mode
from autopar.frontend.split import (MIXED, OutputKind, SplitStep, apply_at, disagreement,
                                    instantiate_split, outputs_at, scale_at, split_step)
from autopar.frontend.trace import check_batch_leaves, trace_step, trace_step_any_batch
from autopar.method import (ParallelMethod, PipeshardParallel, ShardParallel,
                            Zero2Parallel, Zero3Parallel, auto_mesh, axis_sizes_of,
                            grad_sync_for, resolve_mesh)
from autopar.plan import Plan, ValuePlan
from autopar.planner import cache as plan_cache
from autopar.planner import pipeline as pipeline_compile
from autopar.planner.preset import plan_preset, preset_option
from autopar.planner.stage_search import BubbleWarning
from autopar.planner.shard import (LayoutPrices, Progress, batch_axes_for, keeps_batch_whole,
                                   plan_auto)

from autopar.runtime.base import active as active_runtime
from autopar.runtime.executor import Executable
from autopar.runtime.pipeline import PipelineExecutable, compile_pipeline

__all__ = ["Signature", "BUDGET_TRIES", "bind_saved_plan"]

_UNSET = object()


def _platform(method: ParallelMethod) -> str:
  """The platform ``method`` compiles for: its mesh's devices'; for an
  AbstractMesh its option's device kind's, else the active runtime's (a Ray
  cluster's workers'), else CPU."""
  mesh = resolve_mesh(method)
  if not isinstance(mesh, AbstractMesh):
    return mesh.devices.flat[0].platform
  kind = getattr(getattr(method, "option", None), "device_kind", None)
  if kind is not None:
    return platform_of(kind)
  return active_runtime().platform or "cpu"


# num_micro_batches="auto" stops planning larger numbers once the modelled
# step time rose this many times in a row.
STOP_AFTER_RISES = 2


class Signature:
  """What autopar makes for one input signature of a step (see the module
  docstring).

  Attributes:
    fun, name, output_reductions: the step's function, name and setting.
    method: its method with the costs resolved for these arguments.
    lock: held while the plan or the executable is made.
  """

  def __init__(self, step: Any, prep):
    # The step's function and settings, and a weak reference to the step
    # itself (it holds this signature: a plan must not keep it alive).
    self.fun, self.name = step.fun, step.name
    self.output_reductions = step.output_reductions
    self._step = weakref.ref(step)
    self.method = self._resolved(step.method, prep)
    self.lock = threading.RLock()
    self._plan: tuple[Plan, int] | None = None
    self._fingerprint: dict | None = None     # the plan's (plan_uncached)
    self._pipeline = None
    self._executable: Executable | None = None
    self._splits: dict[int, SplitStep] = {}
    self._any_split: Any = _UNSET             # the symbolic-batch split, or None
    # Without a symbolic split: one concrete trace to compare others with.
    self._reference = None
    self._delegate = None                      # a one-stage pipeline's ShardParallel step

  @property
  def remat_loop(self) -> str:
    """The loop its remat's layers run in (``_resolved``; "scan" without remat)."""
    return self.method.remat_loop or "scan"

  def _resolved(self, method: ParallelMethod, prep) -> ParallelMethod:
    """``method`` with its option's costs from the hardware, for this
    signature: the mesh's calibration with ``costs="measured"``, else the
    device kind's figures (``devices.py``) for axes and rates not given by
    hand, rates of the float dtype holding most of these arguments' bytes;
    a saved plan's number of micro-batches for ``"auto"``;
    under remat, the loop its layers run in on the platform it compiles for
    (``remat.layer_loop``: in the plan's fingerprint, and what a Ray
    cluster's workers are sent); where the gradients are synced, a saved
    plan's or else the platform's (``method.grad_sync_for``), likewise."""
    saved = getattr(method, "plan", None)
    if method.num_micro_batches == "auto" and isinstance(saved, Plan):
      # (a saved plan's number of micro-batches is its own; what is not a
      # Plan is refused where the plan is read)
      method = dataclasses.replace(method, num_micro_batches=saved.num_micro_batches)
    if method.remat != "none" and method.remat_loop is None:
      method = dataclasses.replace(method, remat_loop=layer_loop(
          None, _platform(method), gathers=isinstance(method, Zero3Parallel)))
    if method.grad_sync is None:
      method = dataclasses.replace(method, grad_sync=getattr(
          saved, "grad_sync", None) or grad_sync_for(_platform(method)))
    option = getattr(method, "option", None)
    if option is None:
      return method
    mesh = resolve_mesh(method)
    if option.costs == "measured":
      option = measured_option(option, mesh)
    else:
      dtype = dominant_float_dtype([(dtype_name(l.dtype), math.prod(l.shape))
                                    for l in prep.leaves])
      option = hardware_option(option, mesh, dtype)
    return dataclasses.replace(method, option=option)

  def with_method(self, method: ParallelMethod):
    """The step under another method (a ParallelizedFunction)."""
    step = self._step()
    if step is None:
      raise PlanError(f"{self.name}: the step this signature belongs to is gone. Fix: "
                      f"keep the parallelized step alive while it is planned.")
    return step.with_method(method)

  @property
  def planned_pipeline(self):
    """A PipeshardParallel step's (prepared trace, plan, (cut, choices,
    search result)) once planned, else None."""
    return self._pipeline

  def plan(self, prep) -> tuple[Plan, int]:
    """The plan for these arguments, and the micro-batch size (rows)."""
    with self.lock:
      if self._plan is None:
        with gc_paused():
          self._plan = self.plan_uncached(prep)
      return self._plan

  def pipeline(self, prep):
    """(prepared trace, plan, (cut, choices)) of a PipeshardParallel step.
    Under ``num_micro_batches="auto"`` the signature's method becomes the
    one with the number chosen."""
    with self.lock:
      if self._pipeline is None:
        method = self.method
        mesh = resolve_mesh(method)
        with gc_paused():
          if method.num_micro_batches == "auto":
            self._pipeline, self.method = self._auto_micro_batches(prep, method, mesh)
          else:
            self._pipeline = self._prepared_plan(prep, method, mesh)
      return self._pipeline

  def _prepared_plan(self, prep, method: PipeshardParallel, mesh):
    pre = pipeline_compile.prepare(self.fun, self.args_for_trace(prep), prep, method,
                                   name=self.name, output_reductions=self.output_reductions)
    plan, chosen = self._plan_pipeline(pre, method, mesh)
    return pre, plan, chosen

  def _auto_micro_batches(self, prep, method: PipeshardParallel, mesh):
    """``num_micro_batches="auto"``: the step planned for each number
    ``micro_batch_candidates`` gives, in order, until the modelled step time
    rose ``STOP_AFTER_RISES`` times in a row (the bubble shrinks with more
    micro-batches while their tasks' fixed costs add up: the time falls,
    then rises); the plan that takes least in the model kept (the first of
    equals: the fewest micro-batches), with what each took in its plan's
    ``micro_batch_search``; and the method with the number chosen. (A saved
    plan's number is its own: ``_resolved``.) Warnings about the bubble
    (``BubbleWarning``) are dropped: the summary says why a number was
    chosen. Where every number is refused for the input (``InputError``),
    the first refusal is raised as it is."""
    batch = check_batch_leaves(prep.leaves, num_micro_batches=1, data_axes=(),
                               data_size=1, fn_name=self.name)
    # (Interleaved 1F1B runs micro-batches in groups of its submeshes.)
    group = method.num_submeshes if method.schedule == "interleaved-1f1b" else 1
    best, weighed, errors = None, [], []
    last, rising = None, 0  # the last plan's time; plans in a row slower than the last
    for n in pipeline_compile.micro_batch_candidates(batch, multiple_of=group) or [1]:
      if rising == STOP_AFTER_RISES:
        weighed.append((n, None, f"not planned: the step time rose over the "
                                 f"{STOP_AFTER_RISES} numbers before it"))
        continue
      m = dataclasses.replace(method, num_micro_batches=n)
      with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=BubbleWarning)
        try:
          got = self._prepared_plan(prep, m, mesh)
        except (PlanError, InputError) as e:
          errors.append(e)
          weighed.append((n, None, str(e).split(". Fix:")[0]))
          continue
      t = got[1].objective
      rising = rising + 1 if last is not None and t > last else 0
      last = t
      if best is None or t < best[0]:     # (the prepared trace of one number kept)
        best = (t, n, got, m)
      weighed.append((n, t, ""))
    if best is None:
      if all(isinstance(e, InputError) for e in errors):
        raise errors[0]
      raise PlanError("; and ".join(f"with {n} micro-batch(es): {why}"
                                    for n, _, why in weighed) +
                      ". Fix: raise the budget, use more stages, or remat.") from errors[-1]
    _, n, (pre, plan, chosen), m = best
    plan = dataclasses.replace(plan, micro_batch_search=pipeline_compile.weighed_against(
        weighed, n, plan.objective))
    return (pre, plan, chosen), m

  def _plan_pipeline(self, pre, method: PipeshardParallel, mesh):
    """``plan_pipeline``'s plan and (cut, choices, search result), through
    the plan cache: a plan found there is run as a saved plan (its stages
    cut again, nothing searched; no search result). A plan of one stage
    (the search found pipelining does not pay) holds no stages to cut: the
    step runs under ShardParallel (``one_stage``)."""
    if method.plan is not None:
      return pipeline_compile.plan_pipeline(pre, method, mesh)
    # (The fingerprint is the plan's, cached or not: a plan saved from it
    # is followed exactly by the same step.)
    fingerprint = plan_cache.fingerprint(pre.split, method, mesh, pre.batch)
    key = plan_cache.plan_key(fingerprint) if method.option.plan_cache else None
    cached = plan_cache.load(key) if key else None
    if cached is not None and dict(cached.fingerprint) == fingerprint:
      if not cached.stages:
        return dataclasses.replace(cached, in_tree=pre.split.traced.inputs,
                                   mesh=mesh), (None, None, None)
      return pipeline_compile.plan_pipeline(pre, dataclasses.replace(method, plan=cached),
                                            mesh, now=fingerprint)
    plan, chosen = pipeline_compile.plan_pipeline(pre, method, mesh)
    plan = dataclasses.replace(plan, fingerprint=tuple(fingerprint.items()))
    if key:
      plan_cache.store(key, plan)
    return plan, chosen

  def not_dearer_than_zero(self, prep, plan: Plan, micro: int,
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
    split = self.split(prep, micro)
    if keeps_batch_whole(split, method):
      return plan                      # a batch ZeRO cannot split
    sizes = axis_sizes_of(mesh)
    outputs = self.outputs(prep, split, batch_size)
    # (Priced on the ILP's problem over every axis where planning built one.)
    prices = LayoutPrices(p.problem for p in plan.replan.problems) \
        if plan.replan is not None else LayoutPrices()
    best, taken = plan, None
    for preset in (Zero2Parallel, Zero3Parallel):
      other = preset(mesh=method.mesh, num_micro_batches=method.num_micro_batches,
                     remat=method.remat, remat_loop=method.remat_loop,
                     grad_accumulation_dtype=method.grad_accumulation_dtype,
                     grad_sync=method.grad_sync)
      if micro % math.prod(sizes[a] for a in batch_axes_for(other, mesh, split.hints)):
        return plan                    # a batch ZeRO cannot split
      try:
        candidate = plan_preset(split, other, mesh,
                                batch_size=batch_size, outputs=outputs,
                                trace_local=lambda rows: self.split(prep, rows),
                                option=option, price_cache=prices,
                                cheaper_than=best.objective * (1 - 1e-3))
      except (InputError, PlanError):
        continue                       # the preset cannot split this batch
      if candidate is None:
        continue                       # not cheaper
      budget = option.memory_budget_per_device
      if budget is not None and candidate.memory_per_device > budget:
        continue
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

  def keep_plan(self, prep, exe: Executable, first: Plan | None, micro: int,
                traced_alike: bool = True) -> Executable:
    """``exe``, whose plan (made within a smaller planning budget than the
    method's, or a ZeRO layout) becomes this step's plan: for ``step.plan``
    and in the plan cache under the method's own key, so the next process
    compiles it at once. Its fingerprint is the method's (``first``, the
    plan made within the method's budget; None where there was none).
    ``traced_alike`` False: ``exe`` is the step traced otherwise (under
    remat): its plan keeps its own fingerprint, so a saved copy given back
    to the method fails its check rather than run without remat, and it
    stays out of the cache."""
    if exe.plan is first:
      return exe
    plan = exe.plan if first is None or not traced_alike else dataclasses.replace(
        exe.plan, fingerprint=first.fingerprint)
    self._plan = (plan, micro)
    if (traced_alike and self.method.option.plan_cache and first is not None
        and first.fingerprint):
      plan_cache.store(plan_cache.plan_key(dict(first.fingerprint)), plan)
    return dataclasses.replace(exe, plan=plan)

  def one_stage(self, prep) -> Any:
    """For a PipeshardParallel step of one stage (num_stages=1, or the
    search found pipelining does not pay): the same step under
    ShardParallel on the whole mesh, which runs it."""
    method = self.method
    if not isinstance(method, PipeshardParallel):
      return None
    if method.num_stages != 1 and (method.plan is not None and
                                   len(method.plan.stages) > 1 or
                                   method.plan is None and
                                   len(self.pipeline(prep)[1].stages) > 1):
      return None
    with self.lock:
      # (self.method, which planning may have given its micro-batches)
      return self._one_stage_delegate(self.method)

  def _one_stage_delegate(self, method):
    if self._delegate is None:
      self._delegate = self.with_method(ShardParallel(
          mesh=method.mesh, num_micro_batches=method.num_micro_batches,
          remat=method.remat, remat_loop=method.remat_loop,
          grad_accumulation_dtype=method.grad_accumulation_dtype,
          one_executable=method.one_executable, grad_sync=method.grad_sync,
          option=method.option,
          plan=method.plan if method.plan is not None and not method.plan.stages
          else None))
    return self._delegate

  def _searched(self, plan: Plan) -> Plan:
    """A one-stage pipeline's ShardParallel ``plan`` with the number of
    micro-batches the stage search chose, and why (``micro_batch_search``),
    where it chose it."""
    search = self._pipeline[1].micro_batch_search if self._pipeline else ()
    return dataclasses.replace(plan, micro_batch_search=search) if search else plan

  def plan_uncached(self, prep) -> tuple[Plan, int]:
    method = self.method
    if isinstance(method, PipeshardParallel):
      one = self.one_stage(prep)
      if one is not None:
        plan, micro = one.signature_of(prep).plan(prep)
        return self._searched(plan), micro
      pre, plan, _ = self.pipeline(prep)
      return plan, pre.ctx.micro
    mesh = resolve_mesh(method)
    n = method.micro_batches
    sizes = axis_sizes_of(mesh)
    # The planner chooses ShardParallel's batch axes among those that divide
    # the micro-batch; the presets split over theirs, which must divide it.
    solving = isinstance(method, ShardParallel) and method.plan is None
    batch_size = check_batch_leaves(prep.leaves, num_micro_batches=n, data_axes=(),
                                    data_size=1, fn_name=self.name)
    progress = Progress(self.name, getattr(getattr(method, "option", None),
                                            "verbose", False))
    micro = batch_size // n if batch_size else 0
    t0 = time.perf_counter()
    # The ILP plans each choice of batch axes on the step at its rows per
    # device; of the step at the full micro-batch it needs only the outputs,
    # which the symbolic trace gives without writing the step out at that size.
    split = self.traced(prep, micro)
    progress.add("trace", time.perf_counter() - t0,
                 f"{len(split.traced.jaxpr.jaxpr.eqns)} equations")
    # The presets split over their batch axes (by default every axis that no
    # sharding hint needs elsewhere), which must divide the micro-batch.
    if not solving:
      batch_axes = batch_axes_for(method, mesh, split.hints)
      check_batch_leaves(prep.leaves, num_micro_batches=n, data_axes=batch_axes,
                         data_size=math.prod(sizes[a] for a in batch_axes),
                         fn_name=self.name)
    fingerprint = self._fingerprint = plan_cache.fingerprint(split, method, mesh, batch_size)
    if not split.has_marker and n > 1:
      raise MarkerError(
          f"{self.name}: num_micro_batches={n} but the step has no grad marker, "
          f"so autopar cannot tell which part to run per micro-batch. Fix: "
          f"compute the gradients with autopar.grad or autopar.value_and_grad "
          f"instead of jax.grad / jax.value_and_grad.")
    saved = method.plan if isinstance(method, ShardParallel) else None
    if saved is not None:
      plan = bind_saved_plan(saved, split, mesh, fingerprint, self.name)
      if n > 1 and plan.grad_sync != method.grad_sync:
        raise PlanError(
            f"{self.name}: the saved plan syncs the gradients with "
            f"grad_sync={plan.grad_sync!r} (its stages and collectives are named so) "
            f"but the method has grad_sync={method.grad_sync!r}. Fix: give the method "
            f"grad_sync={plan.grad_sync!r}, or make the plan again under this method.")
    elif isinstance(method, ShardParallel) and split.has_marker:
      @fusions_shared()
      def solved() -> Plan:
        plan = plan_auto(split, method, mesh, batch_size=batch_size,
                         trace_local=lambda rows: self.split(prep, rows),
                         outputs=self.outputs(prep, split, batch_size),
                         progress=progress, any_batch=None if self._any_split is _UNSET
                         else self._any_split)
        return self.not_dearer_than_zero(prep, plan, micro, batch_size)
      key = plan_cache.plan_key(fingerprint) if method.option.plan_cache else None
      plan = self._cached(key, fingerprint, split, mesh, solved, progress)
    else:
      # A preset's plan is priced with the costs of the mesh's devices
      # (preset_option), which its fingerprint does not hold: its key does.
      option = getattr(method, "option", None)
      key = None
      if option is None or option.plan_cache:
        costs = repr(preset_option(mesh, split.traced.leaves))
        key = plan_cache.plan_key({**fingerprint, "preset costs": costs})
      plan = self._cached(key, fingerprint, split, mesh, lambda: plan_preset(
          self.split(prep, micro), method, mesh, batch_size=batch_size,
          outputs=self.outputs(prep, split, batch_size),
          trace_local=lambda rows: self.split(prep, rows)))
    if not plan.hints and split.hints:
      plan = dataclasses.replace(plan, hints=tuple(
          ValuePlan(f"hint {h.part}/{h.path}", h.shape_at(micro), dtype_name(h.dtype),
                    h.spec) for h in split.hints if h.axes()))
    data_size = math.prod(sizes[a] for a in plan.batch_axes)
    if split.has_marker and n * data_size > 1:
      check_loss(split.loss, self.name,
                 f"{n} micro-batch(es) x {data_size} device(s) along {plan.batch_axes}")
      for j, (path, kind, aval) in enumerate(zip(
          split.traced.out_paths, split.out_kinds,
          self.outputs(prep, split, micro).avals, strict=True)):
        if kind is OutputKind.OTHER:
          why = split.why.get(j, "its shape depends on the batch size other than as "
                              "rows in one dimension")
          fix = ("" if why.startswith(MIXED) else
                 f" Fix: compute it from sums, means, maxes or mins over the batch's "
                 f"rows, return it per example, or say how to combine it: "
                 f"parallelize(..., output_reductions={{{path!r}: 'mean'}}) (or 'sum', "
                 f"'max', 'min').")
          raise InputError(
              f"{self.name}: output {path} (shape {tuple(aval.shape)} for a "
              f"micro-batch of {micro} rows) is computed from the batch before the "
              f"gradient marker, and autopar cannot tell how to combine it over {n} "
              f"micro-batch(es) x {data_size} device(s): {why}.{fix}")
    return plan, micro

  def _cached(self, key: str | None, fingerprint: dict, split: SplitStep, mesh,
              make: Callable[[], Plan], progress: Progress | None = None) -> Plan:
    """The plan the plan cache holds under ``key`` where it was made for
    ``fingerprint``; else ``make()``'s, given the fingerprint and stored
    there (``key`` None: no cache)."""
    cached = plan_cache.load(key) if key else None
    if cached is not None and dict(cached.fingerprint) == fingerprint:
      if progress is not None:
        progress.add("plan cache hit", 0.0, str(plan_cache.cache_dir() / key))
      return bind_saved_plan(cached, split, mesh, fingerprint, self.name)
    plan = dataclasses.replace(make(), fingerprint=tuple(fingerprint.items()))
    if key:
      plan_cache.store(key, plan)
    return plan

  def outputs(self, prep, split: SplitStep, rows: int):
    """The step's outputs and gradients at a batch of ``rows`` rows."""
    if jc.is_symbolic_dim(split.traced.micro_batch_size) or \
        split.traced.micro_batch_size == rows:
      return outputs_at(split, rows)
    return outputs_at(self.split(prep, rows), rows)

  def traced(self, prep, micro_batch_size: int) -> SplitStep:
    """The step split at a symbolic batch size if it can be traced so, else
    at ``micro_batch_size`` rows."""
    any_split = self.symbolic(prep) if micro_batch_size else None
    return any_split if any_split is not None else self.split(prep, micro_batch_size)

  def symbolic(self, prep) -> SplitStep | None:
    """The step traced once at a symbolic batch size and split (cached), or
    None if it cannot be traced so (see trace_step_any_batch)."""
    with self.lock:
      return self._symbolic(prep)

  def _symbolic(self, prep) -> SplitStep | None:
    if self._any_split is _UNSET:
      with remat_mode(self.method.remat, self.remat_loop):
        traced = trace_step_any_batch(self.fun, self.args_for_trace(prep),
                                      prep.flags, prep.leaves, prep.inputs,
                                      mesh=auto_mesh(resolve_mesh(self.method)),
                                      names=prep.names)
      self._any_split = (None if traced is None else split_step(
          traced, fn_name=self.name, output_reductions=self.output_reductions,
          remat=self.method.remat,
          remat_loop=self.remat_loop))
    return self._any_split

  def split(self, prep, micro_batch_size: int) -> SplitStep:
    """The step traced and split at ``micro_batch_size`` rows (cached).

    One symbolic trace, split once, serves every batch size; a step that
    needs a concrete size is traced at each.
    """
    with self.lock:
      if micro_batch_size not in self._splits:
        any_split = self.symbolic(prep) if micro_batch_size else None
        if any_split is not None:
          split = instantiate_split(any_split, micro_batch_size)
        else:
          split = self.concrete(prep, micro_batch_size)
          self.check_alike(split)
        self._splits[micro_batch_size] = split
      return self._splits[micro_batch_size]

  def check_alike(self, split: SplitStep) -> None:
    """Raises an InputError if ``split`` (traced at a concrete size) is not
    split as this signature's other concrete splits are: the stages are
    built from splits at several sizes (``split.disagreement``)."""
    rows = split.traced.micro_batch_size
    other = next((s for s in self._splits.values() if s.traced.micro_batch_size), None)
    why = disagreement(split, other) if rows and other is not None else ""
    if not why:
      return
    where = first_difference(split.raw.jaxpr.jaxpr, other.raw.jaxpr.jaxpr)
    raise InputError(
        f"{self.name}: the step cannot be traced at a symbolic batch size, so "
        f"autopar traces it at each size it runs (a device's rows of a "
        f"micro-batch, a micro-batch, the whole batch), and its programs at "
        f"{rows} and {other.traced.micro_batch_size} rows disagree: {why}"
        f"{f' (their operations first differ at {where})' if where else ''}. "
        f"Its program changes with the batch size (a Python branch on it, or "
        f"JAX writing some operations only where a dimension is not 1), so "
        f"autopar cannot give each device the whole batch's results. Fix: keep "
        f"the batch size out of the step's Python logic (jnp.mean rather than "
        f"dividing by x.shape[0]) so that it traces at a symbolic size; or give "
        f"each device more rows of each micro-batch (fewer micro-batches, a "
        f"larger batch, or fewer devices along the batch axes); or say how its "
        f"outputs combine, each device's and micro-batch's averaged: "
        f"parallelize(..., output_reductions={{'loss': 'mean'}}).")

  def concrete(self, prep, rows: int) -> SplitStep:
    """The step traced at ``rows`` rows and split; where the batch is split
    (over micro-batches or devices), which of its dimensions hold rows is
    read against a trace at another size (``rows.py``)."""
    # (The trace made for reference is reused: at two micro-batches it is
    # the whole batch's, which the update runs at.)
    ref = self._reference
    traced = (ref if ref is not None and ref.micro_batch_size == rows
              else self.trace_at(prep, rows))
    mesh = resolve_mesh(self.method)
    reference = None
    if rows and (self.method.micro_batches > 1 or math.prod(mesh.axis_sizes) > 1):
      known = [self._reference, *(s.raw for s in self._splits.values())]
      reference = next((t for t in known
                        if t is not None and t.micro_batch_size != rows), None)
      if reference is None:
        # The whole batch's program, which jax.jit runs (and the update
        # here); beside the whole batch, a size the batch split runs at.
        whole = next(l.shape[0] for l in prep.leaves if l.is_batch)
        other = whole if whole != rows else rows // 2 if rows % 2 == 0 else 2 * rows
        reference = self._reference = self.trace_at(prep, other)
    return split_step(traced, fn_name=self.name, reference=reference,
                      output_reductions=self.output_reductions, remat=self.method.remat,
          remat_loop=self.remat_loop)

  def trace_at(self, prep, rows: int):
    """The step traced at ``rows`` rows (uncached)."""
    with remat_mode(self.method.remat, self.remat_loop):
      return trace_step(self.fun, self.args_for_trace(prep), prep.flags,
                        prep.leaves, prep.inputs, micro_batch_size=rows,
                        mesh=auto_mesh(resolve_mesh(self.method)), names=prep.names)

  def args_for_trace(self, prep) -> list:
    statics = dict(prep.key[1])
    return [statics.get(i) for i in range(len(prep.names))]

  def executable(self, prep) -> Executable:
    """The step compiled for these arguments (once)."""
    with self.lock:
      if self._executable is None:
        self._executable = self.build(prep)
      return self._executable

  def build(self, prep) -> Executable:
    """The step planned and compiled (uncached): a pipeline's stages, or the
    SPMD stages within the memory budget."""
    if isinstance(self.method, PipeshardParallel):
      one = self.one_stage(prep)
      if one is not None:
        exe = one.signature_of(prep).executable(prep)
        plan = self._searched(exe.plan)
        return exe if plan is exe.plan else dataclasses.replace(exe, plan=plan)
      pre, plan, (cut, choices, _) = self.pipeline(prep)
      with jax.set_mesh(None), gc_paused():
        step = compile_pipeline(pre, self.method, resolve_mesh(self.method), cut,
                                choices, plan.schedule, plan.virtual_stages)
      return PipelineExecutable(plan=plan, step=step, static_argnums=prep.flags.static)
    try:
      exe = self.compile(prep)
    except PlanError as e:
      if not self.budgeted() or "memory_budget_per_device" not in str(e):
        raise
      # No plan of the ILP's within the budget: ZeRO's layouts may fit.
      return self.within_budget(prep, None, e)
    return self.within_budget(prep, exe)

  def compile(self, prep) -> Executable:
    """The step planned and compiled under ``self.method`` (SPMD methods).
    (Its stages' traces and lowering make as many long-lived objects as
    planning does: ``gc_paused`` says why.)"""
    with gc_paused():
      return self._compile(prep)

  def _compile(self, prep) -> Executable:
    mesh = resolve_mesh(self.method)
    # The stages kept for this step last time start loading while it is
    # traced and its plan read (used only if its key is theirs).
    hint = self.hint_key(prep, mesh)
    prefetched = saved_stages.prefetch(hint, mesh)
    plan, micro = self.plan(prep)
    split = self.split(prep, micro)
    if isinstance(mesh, AbstractMesh):
      raise PlanError(
          f"{self.name}: the method's mesh is an AbstractMesh, which can be "
          f"planned for but not run on. Fix: use .plan(*args) to plan, and run "
          f"with a concrete mesh (jax.make_mesh or autopar.global_mesh).")
    split_local = split
    data_size = math.prod(plan.axis_sizes[a] for a in plan.batch_axes)
    if split.has_marker and data_size > 1:
      split_local = self.split(prep, split.traced.micro_batch_size // data_size)
    # apply_grad runs once per step, on the whole batch's shapes (an output
    # such as jnp.arange(batch.shape[0]) has the whole batch's length).
    whole = micro * plan.num_micro_batches
    if whole == micro:
      apply = split.apply
    elif self.symbolic(prep) is not None:
      apply = apply_at(self.symbolic(prep), whole)
    else:
      apply = self.split(prep, whole).apply
    # Each group (a device's rows of a micro-batch) seeds the loss with the
    # whole batch's cotangents (loss.py), computed at the whole batch's size.
    scale = None
    if split.loss is not None and plan.num_micro_batches * data_size > 1:
      if self.symbolic(prep) is not None:
        scale = scale_at(self.symbolic(prep), whole)
      else:
        # (Split alike at every size: check_alike.)
        check_loss(split_local.loss, self.name, f"{plan.num_micro_batches} "
                   f"micro-batch(es) x {data_size} device(s) along {plan.batch_axes}")
        scale = self.split(prep, whole).loss.scale
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
      one_executable = self.method.one_executable is not False
      keep = self.stage_key(plan, mesh, whole, data_size, scale is not None,
                            one_executable)
      lower = functools.partial(
          lower_step, dataclasses.replace(split, apply=apply), split_local, plan, mesh,
          accumulate=self.method.grad_accumulation_dtype, scale=scale,
          one_executable=one_executable)
      lowered = lower(keep=keep, hint=hint, prefetched=prefetched)

    def recompile():
      # (Loaded stages that failed to run: compiled here, not kept again.)
      with jax.set_mesh(None), gc_paused():
        return lower()
    return Executable(plan=plan, lowered=lowered, split=split,
                      static_argnums=prep.flags.static,
                      recompile=recompile if lowered.loaded_from is not None else None)

  def stage_key(self, plan: Plan, mesh, whole: int, data_size: int, scaled: bool,
                one_executable: bool) -> str | None:
    """The key the compiled stages are kept on disk under
    (``saved_stages``), or None where they are not kept: a step traced at
    concrete batch sizes only (each size's program is its own, and only one
    is in the plan's fingerprint), or one holding a primitive lowered by a
    rule that is not JAX's or autopar's (Python the key does not read)."""
    if (self._any_split is _UNSET or self._any_split is None or self._fingerprint is None
        or not saved_stages.keeps() or not jc.lowered_by_jax(self._any_split.traced.jaxpr)):
      return None
    lowering = (whole, data_size, scaled, one_executable,
                self.method.grad_accumulation_dtype, self.remat_loop,
                repr(self.output_reductions), compiler_options(mesh))
    return saved_stages.stage_key(self._fingerprint, plan, mesh,
                                  saved_stages.consts_digest(self._any_split.traced.jaxpr),
                                  lowering)

  def hint_key(self, prep, mesh) -> str | None:
    """The key of what is known of the step before it is traced (its
    function's name, arguments, method and mesh): a guess at which kept
    stages it will load (``saved_stages.prefetch``)."""
    if isinstance(mesh, AbstractMesh):
      return None
    fun = getattr(self.fun, "__wrapped__", self.fun)
    known = (getattr(fun, "__module__", None), getattr(fun, "__qualname__", self.name),
             repr(prep.key), repr(self.method), repr(self.output_reductions))
    return saved_stages.hint_key(known, mesh)

  def budgeted(self) -> bool:
    """Whether the step is a ShardParallel step the planner plans within a
    ``memory_budget_per_device`` (not a saved plan)."""
    method = self.method
    return (isinstance(method, ShardParallel) and method.plan is None and
            method.option.memory_budget_per_device is not None)

  def within_budget(self, prep, exe: Executable | None,
                    error: PlanError | None = None) -> Executable:
    """``exe``, if what its compiled stages hold per device (arguments,
    outputs not aliased, temporaries, and what the step keeps between
    stages: ``hlo.compiled_step_memory``) is within the method's
    ``memory_budget_per_device``. Else the cheapest, by its objective, of
    these plans whose compiled step is within it:

    * ZeRO-3's and ZeRO-2's layouts (``zero_layouts``), which the ILP's
      space does not hold: their update runs on each device's shard of
      the state;
    * unless one of those fits and costs no more than ``exe``'s plan (the
      ILP held to a smaller budget costs no less), the step planned again
      within the last plan's estimate scaled down by how far its compiled
      peak missed (and, once a planning budget is infeasible, halfway
      between it and the last feasible one), up to ``BUDGET_TRIES`` times,
      until one fits or one is a plan found before (``replanned``);
    * if none of those fits and the method has no remat, ZeRO-3's layout
      under ``remat="layers"``: the step traced again with its repeated
      layers recomputed in the backward pass (the same numbers, more
      compute). Such a plan is not kept in the plan cache, whose plans do
      not say remat: the next process plans again.

    ``exe`` None: the ILP found no plan within the budget (``error``); the
    ZeRO layouts are tried, and ``error`` raised if none can be. A
    ``PlanError`` names every compiled peak found if no plan fits. The
    memory model is XLA's approximately; this holds the budget on what the
    devices hold."""
    if not self.budgeted():
      return exe
    method = self.method
    budget = method.option.memory_budget_per_device
    first = exe.plan if exe is not None else None
    tried: list[_Compiled] = []
    if exe is not None:
      tried.append(_Compiled.of("the ILP's plan", budget, self, exe))
      if tried[0].peak <= budget:
        return exe
    tried += self.layouts(prep, self.zero_layouts())
    if exe is not None and not any(t.peak <= budget and t.objective <= first.objective
                                   for t in tried):
      tried += self.replanned(prep, tried[0])
    if method.remat == "none" and not any(t.peak <= budget for t in tried):
      # (The trace's warnings were given once already; a step without
      # repeated layers has nothing to recompute: the same plan again.)
      with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rematted = self.layouts(prep, self.zero_layouts(remat="layers")[:1])
      if not any(issubclass(w.category, NoLayersWarning) for w in caught):
        tried += rematted
    if not tried:
      raise error
    fitting = [t for t in tried if t.peak <= budget]
    if fitting:
      best = min(fitting, key=lambda t: t.objective)
      plan = best.exe.plan
      if plan.method != method.name:
        s = plan.solver or (first.solver if first else None)
        note = f"{best.what} taken: its compiled step is within the budget"
        plan = dataclasses.replace(
            plan, method=method.name, replan=first.replan if first else None,
            solver=s and dataclasses.replace(s, status=f"{s.status}; {note}"))
      if best.remat != method.remat:
        warnings.warn(
            f"{self.name}: no plan without remat fits memory_budget_per_device="
            f"{budget:.0f} bytes; {best.what} does ({best.peak:.0f} bytes per device "
            f"compiled): its layers are recomputed in the backward pass. To plan so "
            f"from the start, pass remat={best.remat!r} to {method.name}.",
            stacklevel=2)
      return self.keep_plan(prep, dataclasses.replace(best.exe, plan=plan), first,
                            best.micro, traced_alike=best.remat == method.remat)
    smallest = min(t.peak for t in tried)
    raise PlanError(
        f"{self.name}: no plan found whose compiled step fits memory_budget_per_device="
        f"{budget:.0f} bytes on mesh {axis_sizes_of(resolve_mesh(method))}"
        + (": the ILP's model finds none within it" if exe is None else "")
        + "; the compiled peaks per device were " + ", ".join(
            f"{t.peak:.0f} ({t.what}"
            + (f" planned within {t.planning:.0f})" if t.planning else ")")
            for t in tried)
        + f"; the smallest is {smallest:.0f}. Fix: raise memory_budget_per_device to "
        f"at least {smallest:.0f}, use more micro-batches, remat, or a larger mesh.")

  def replanned(self, prep, first: "_Compiled") -> list["_Compiled"]:
    """The step planned again by the ILP within smaller planning budgets
    (see ``within_budget``), after ``first``, planned within the method's
    budget, compiled over it: each compiled, until one fits or one
    compiles to a peak already found (the same plan again)."""
    method = self.method
    option = method.option
    budget = option.memory_budget_per_device
    planning, low = float(budget), None   # (the largest infeasible planning budget)
    last, out, seen = first, [], {first.peak}
    for _ in range(BUDGET_TRIES):
      # The last plan's own estimate scaled down by its miss (the estimate,
      # not the planning budget: a plan may use less than it was allowed);
      # between the last infeasible and the last planned budget once the
      # model has said no (a bisection).
      high = planning
      planning = (min(high, last.exe.plan.memory_per_device) * budget / last.peak
                  if low is None else (low + high) / 2)
      sig = self.with_method(dataclasses.replace(method, option=dataclasses.replace(
          option, memory_budget_per_device=planning))).signature_of(prep)
      try:
        out.append(_Compiled.of("the ILP's plan", planning, sig, sig.compile(prep)))
      except PlanError as e:
        if "memory_budget_per_device" not in str(e):
          raise                     # not a budget the model cannot meet
        low, planning = planning, high
        continue
      last = out[-1]
      if last.peak <= budget or last.peak in seen:
        break                       # fits, or the same plan again
      seen.add(last.peak)
    return out

  def layouts(self, prep, presets) -> list["_Compiled"]:
    """Each of ``presets`` (``zero_layouts``) compiled for this step, but
    those that cannot split its batch."""
    out = []
    for preset in presets:
      sig = self.with_method(preset).signature_of(prep)
      what = f"{preset.name}'s layout" + (
          f" with remat={preset.remat!r}" if preset.remat != self.method.remat else "")
      try:
        out.append(_Compiled.of(what, None, sig, sig.compile(prep)))
      except (InputError, PlanError):
        continue
    return out

  def zero_layouts(self, remat: Any = None) -> list:
    """ZeRO-3 and ZeRO-2 under this ShardParallel step's mesh, micro-batches
    and remat (or ``remat``), where ``not_dearer_than_zero`` would consider
    them."""
    method = self.method
    option = method.option
    mesh = resolve_mesh(method)
    if (option.pins or option.force_data_parallel or not option.allow_all_gather
        or option.forced_batch_axes(mesh) is not None):
      return []
    # (ZeRO-3 runs remat's layers in its own loop: layer_loop's gathers.)
    return [preset(mesh=method.mesh, num_micro_batches=method.num_micro_batches,
                   remat=method.remat if remat is None else remat,
                   remat_loop=None if preset is Zero3Parallel else method.remat_loop,
                   grad_accumulation_dtype=method.grad_accumulation_dtype,
                   one_executable=method.one_executable, grad_sync=method.grad_sync)
            for preset in (Zero3Parallel, Zero2Parallel)]


# Plans tried again, with a smaller planning budget, when the compiled step
# holds more than memory_budget_per_device (Signature.within_budget).
BUDGET_TRIES = 3


@dataclasses.dataclass(frozen=True)
class _Compiled:
  """A plan tried for a memory budget (``Signature.within_budget``)."""
  what: str                     # "the ILP's plan", "Zero3Parallel's layout"
  planning: float | None        # the budget the ILP planned within
  exe: Executable
  micro: int                    # rows per micro-batch
  peak: int                     # compiled bytes per device
  remat: Any                    # the remat it was traced under

  @property
  def objective(self) -> float:
    return self.exe.plan.objective

  @classmethod
  def of(cls, what: str, planning, sig, exe: Executable) -> "_Compiled":
    return cls(what, planning, exe, sig._plan[1],
               compiled_peak(exe.plan, exe.stages, exe.schedule), sig.method.remat)


def bind_saved_plan(saved: Plan, split: SplitStep, mesh, fingerprint, name: str
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
  check_hints({h.path: h for h in split.hints}, axis_sizes_of(mesh),
              saved.batch_axes, f"the saved plan (batch axes {saved.batch_axes})")
  return dataclasses.replace(saved, in_tree=split.traced.inputs, mesh=mesh)
