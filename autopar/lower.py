"""Lower a plan and a split step to compiled XLA executables.

Stage 7 of the pipeline: (:class:`~autopar.split.SplitStep`,
:class:`~autopar.plan.Plan`, mesh) -> :class:`LoweredStep`, a dict of
``jax.stages.Compiled`` plus what the executor needs to call them.

Gradient stages (one per micro-batch position, see
``planner.grad_stage_names``) run the ``compute_grad`` jaxpr inside
``jax.shard_map`` over the plan's batch axes, which are *manual* there; all
other mesh axes stay under XLA's automatic partitioner. Each device thus
computes the gradient of its own slice of the micro-batch and adds it to its
own partial sum, and no gradient bytes cross devices. The partial sums are
stored with a leading stacked axis, one slot per device along the batch axes
(global shape ``[D, *grad.shape]``, spec ``P(batch_axes, ...)``), which keeps
them ordinary, honestly typed arrays that can be donated from one micro-batch
to the next and updated in place. Only the last micro-batch's stage
(``*_sync``) reduces them: ``psum`` (all-reduce) for replicated gradients,
``psum_scatter`` (reduce-scatter) for sharded ones. ``docs/design.md`` says
why this was chosen over JAX's ``unreduced`` shardings.

Inside a gradient stage, device ``d`` along the batch axes holds rows
``[d*n*m, (d+1)*n*m)`` of the batch (``m`` = rows per device per micro-batch)
and micro-batch ``i`` is its local rows ``[i*m, (i+1)*m)``: selecting a
micro-batch moves no data. Per-example outputs are written back to the same
rows, so they come out in the original batch order.

``apply_grad`` runs the ``apply_grad`` jaxpr under plain ``jax.jit`` with the
plan's in/out shardings; the donated state is aliased to the new state.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core as jax_core
from jax.extend.core import Literal
from jax.sharding import NamedSharding, PartitionSpec

from autopar.method import auto_mesh
from autopar.plan import Plan
from autopar.errors import PlanError
from autopar.planner import grad_stage_names, leaves_read_by_compute, sub_jaxprs
from autopar.split import OutputKind, SplitStep

__all__ = ["LoweredStep", "lower_step"]


@dataclasses.dataclass(frozen=True)
class LoweredStep:
  """Compiled stages of one step and how to call them.

  Stage calling conventions (``leaves`` = all non-static argument leaves,
  ``donated``/``kept`` = the non-batch ones that are / are not donated):

  * ``compute_grad(leaves) -> acc``
  * ``accumulate_grad(leaves, i, acc) -> acc`` (acc donated)
  * ``compute_grad_sync(leaves) -> (grads, micro_outs)``
  * ``accumulate_grad_sync(leaves, i, acc) -> (grads, micro_outs)``
  * ``apply_grad(donated, kept, grads) -> apply_outs`` (donated donated)
  * ``step(donated, kept, batch) -> outs`` (a step without a grad marker)
  """
  stages: dict[str, Any]
  schedule: tuple[str, ...]
  in_shardings: tuple[NamedSharding, ...]
  micro_batch_index: tuple[Any, ...]
  donated: tuple[int, ...]
  kept: tuple[int, ...]
  batch: tuple[int, ...]


# -- specs --------------------------------------------------------------------

def _entry_axes(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def _make_entry(axes: Sequence[str]):
  axes = tuple(axes)
  return None if not axes else axes[0] if len(axes) == 1 else axes


def _restrict(spec: PartitionSpec, keep) -> PartitionSpec:
  """``spec`` with only the mesh axes for which ``keep(axis)`` holds."""
  return PartitionSpec(*(_make_entry([a for a in _entry_axes(e) if keep(a)])
                         for e in spec))


def _manual(spec, manual):
  return _restrict(spec, lambda a: a in manual)


def _auto(spec, manual):
  return _restrict(spec, lambda a: a not in manual)


def _stacked(spec: PartitionSpec, manual: Sequence[str]) -> PartitionSpec:
  """Spec of a ``[D, *shape]`` stack of per-device partial sums."""
  return PartitionSpec(_make_entry(manual), *_auto(spec, manual))


# -- collectives inside the manual region --------------------------------------

def _gather_manual(x, spec: PartitionSpec, manual: Sequence[str]):
  """All-gathers the manual-axis sharding of a leaf (ZeRO-3 parameters)."""
  for d, entry in enumerate(spec):
    axes = [a for a in _entry_axes(entry) if a in manual]
    if axes:
      x = lax.all_gather(x, tuple(axes), axis=d, tiled=True)
  return x


def _reduce_manual(x, spec: PartitionSpec, manual: Sequence[str]):
  """Sums ``x`` over the manual axes, scattering where ``spec`` shards it."""
  scattered = set()
  for d, entry in enumerate(spec):
    axes = tuple(a for a in _entry_axes(entry) if a in manual)
    if axes:
      x = lax.psum_scatter(x, axes, scatter_dimension=d, tiled=True)
      scattered.update(axes)
  rest = tuple(a for a in manual if a not in scattered)
  return lax.psum(x, rest) if rest else x


# -- evaluating a jaxpr under the plan's constraints ----------------------------

def _constraints(plan: Plan, part: str) -> dict[str, dict]:
  """Equation path -> {output index or "in<k>" for operand k: spec}.

  Plan intermediates are named ``<part>/<equation>/<output>`` (the spec an
  output is produced in) or ``<part>/<equation>/in<k>`` (the spec operand
  ``k`` is resharded to before the equation). An equation inside control
  flow has a path: ``12.0.5`` is equation 5 of sub-jaxpr 0 of equation 12.
  """
  out: dict[str, dict] = {}
  for v in plan.intermediates:
    prefix, i, j = v.name.split("/")
    if prefix == part:
      out.setdefault(i, {})[j if j.startswith("in") else int(j)] = v.spec
  return out


def _check_pins(constraints: dict[str, dict], jaxpr, part: str) -> None:
  """Every pin of the plan names a value of ``jaxpr`` of the spec's rank.

  The plan's fingerprint already ties it to this program; this catches a
  plan that disagrees with it anyway, so that no pin is dropped silently.
  """
  for path, pins in constraints.items():
    eqn, where = None, jaxpr
    for depth, idx in enumerate(path.split(".")):
      if depth % 2 == 0:
        eqns = where.eqns
        eqn = eqns[int(idx)] if int(idx) < len(eqns) else None
      else:
        subs = sub_jaxprs(eqn) if eqn is not None else []
        where = subs[int(idx)] if int(idx) < len(subs) else None
      if eqn is None or where is None:
        break
    for j, spec in pins.items():
      values = (eqn.invars if isinstance(j, str) else eqn.outvars) if eqn else ()
      k = int(j[2:]) if isinstance(j, str) else j
      value = values[k] if k < len(values) else None
      if value is None or len(spec) > len(getattr(value.aval, "shape", ())):
        raise PlanError(
            f"autopar: the plan pins {part}/{path}/{j} to {spec}, but this "
            f"program has no such value of rank >= {len(spec)}: the plan was made "
            f"for another program. Fix: plan again for this step.")


def _inside(constraints: dict[str, dict], prefix: str) -> dict[str, dict]:
  """The constraints of one sub-jaxpr, with ``prefix`` taken off their paths."""
  n = len(prefix)
  return {k[n:]: v for k, v in constraints.items() if k.startswith(prefix)}


def _eval_jaxpr(jaxpr, consts, args, constraints, constrain, constvals=()):
  """``eval_jaxpr`` that pins the values the plan decided to their specs,
  inside scan / while / cond / checkpoint bodies too."""
  if not constraints:
    return jax_core.eval_jaxpr(jaxpr, constvals, *consts, *args)
  env = {}

  def read(a):
    return a.val if isinstance(a, Literal) else env[a]

  for v, x in zip(jaxpr.constvars, constvals, strict=True):
    env[v] = x
  for v, x in zip(jaxpr.invars, [*consts, *args], strict=True):
    env[v] = x
  for i, eqn in enumerate(jaxpr.eqns):
    pinned = constraints.get(str(i), {})
    args = [read(a) for a in eqn.invars]
    args = [constrain(x, pinned[f"in{k}"]) if f"in{k}" in pinned else x
            for k, x in enumerate(args)]
    inner = _inside(constraints, f"{i}.")
    if inner and eqn.primitive.name in _REGION_EVAL:
      outs = _REGION_EVAL[eqn.primitive.name](eqn, args, inner, constrain)
    else:
      params = eqn.primitive.get_bind_params(eqn.params)
      with eqn.ctx.manager:
        ans = eqn.primitive.bind(*args, **params)
      outs = ans if eqn.primitive.multiple_results else [ans]
    if pinned:
      outs = [constrain(x, pinned[j]) if j in pinned else x
              for j, x in enumerate(outs)]
    for v, x in zip(eqn.outvars, outs, strict=True):
      env[v] = x
  return [read(a) for a in jaxpr.outvars]


def _eval_closed(closed, args, constraints, constrain):
  return _eval_jaxpr(closed.jaxpr, (), args, constraints, constrain,
                     constvals=closed.consts)


def _scan(eqn, args, constraints, constrain):
  p = eqn.params
  nc, ncar = p["num_consts"], p["num_carry"]
  consts, init, xs = args[:nc], args[nc:nc + ncar], args[nc + ncar:]
  body = _inside(constraints, "0.")

  def step(carry, x):
    outs = _eval_closed(p["jaxpr"], [*consts, *carry, *x], body, constrain)
    return outs[:ncar], outs[ncar:]
  carry, ys = lax.scan(step, list(init), list(xs), length=p["length"],
                       reverse=p["reverse"], unroll=p["unroll"])
  return [*carry, *ys]


def _while(eqn, args, constraints, constrain):
  p = eqn.params
  cn, bn = p["cond_nconsts"], p["body_nconsts"]
  cconsts, bconsts, init = args[:cn], args[cn:cn + bn], args[cn + bn:]
  body = _inside(constraints, "1.")

  def cond(carry):
    return jax_core.eval_jaxpr(p["cond_jaxpr"].jaxpr, p["cond_jaxpr"].consts,
                               *cconsts, *carry)[0]

  def step(carry):
    return _eval_closed(p["body_jaxpr"], [*bconsts, *carry], body, constrain)
  return list(lax.while_loop(cond, step, list(init)))


def _cond(eqn, args, constraints, constrain):
  index, ops = args[0], args[1:]
  def branch(b, closed):
    inner = _inside(constraints, f"{b}.")
    return lambda *xs: _eval_closed(closed, list(xs), inner, constrain)
  return list(lax.switch(index, [branch(b, c) for b, c in
                                 enumerate(eqn.params["branches"])], *ops))


def _checkpoint(eqn, args, constraints, constrain):
  """The remat body under the plan's constraints, re-bound as the same
  ``checkpoint`` primitive (same policy, same ``differentiated`` flag)."""
  from jax._src.interpreters import partial_eval as pe
  body = _inside(constraints, "0.")
  jaxpr = eqn.params["jaxpr"]
  closed = jax.make_jaxpr(lambda *xs: _eval_jaxpr(jaxpr, (), xs, body, constrain))(
      *[jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in jaxpr.invars])
  new = pe.convert_constvars_jaxpr(closed.jaxpr)
  params = dict(eqn.params, jaxpr=new)
  with eqn.ctx.manager:
    return eqn.primitive.bind(*closed.consts, *args, **params)


_REGION_EVAL = {"scan": _scan, "while": _while, "cond": _cond,
                "remat2": _checkpoint}        # remat2: jax.checkpoint


# -- stages -------------------------------------------------------------------

def _grad_stage(split: SplitStep, plan: Plan, amesh, user_mesh, *, first: bool,
                sync: bool, micro_rows: int):
  """A jitted gradient stage (see LoweredStep for its signature)."""
  manual = tuple(plan.batch_axes)
  sizes = plan.axis_sizes
  groups = plan.num_micro_batches * math.prod(sizes[a] for a in manual)
  leaves = split.traced.leaves
  num_grads = split.num_grads
  compute = split.compute.jaxpr
  consts = split.consts
  read = leaves_read_by_compute(split)
  kinds = [k for k in split.out_kinds if k is not OutputKind.APPLY]
  in_specs = [v.spec for v in plan.inputs]
  grad_specs = [g.spec for g in plan.grads]
  batch_entry = _make_entry(manual)
  micro_out_specs = [plan.outputs[j].spec for j, k in enumerate(split.out_kinds)
                     if k is not OutputKind.APPLY]
  # The plan's constraints name only the automatic axes. Inside shard_map a
  # bare spec refers to its (partially manual) mesh.
  auto_axes = [a for a in plan.mesh_axis_names if a not in manual]
  constraints = _constraints(plan, "compute") if auto_axes else {}
  _check_pins(constraints, compute, "compute")
  if manual:
    pin = lambda x, spec: lax.with_sharding_constraint(x, spec)
  else:
    pin = lambda x, spec: lax.with_sharding_constraint(x, NamedSharding(amesh, spec))

  def body(leaf_vals, i, acc):
    args = []
    for k, (leaf, x) in enumerate(zip(leaves, leaf_vals, strict=True)):
      if leaf.is_batch:
        x = lax.dynamic_slice_in_dim(x, i * micro_rows, micro_rows, axis=0)
      elif k in read:
        x = _gather_manual(x, in_specs[k], manual)
      args.append(x)
    outs = _eval_jaxpr(compute, consts, args, constraints, pin)
    grads, micro = outs[:num_grads], outs[num_grads:]
    if first:
      acc_g = [g[None] for g in grads]
    else:
      acc_g = [a + g[None] for a, g in zip(acc[0], grads, strict=True)]
    acc_m = []
    for j, (kind, val) in enumerate(zip(kinds, micro, strict=True)):
      if kind is OutputKind.CONCAT:
        if plan.num_micro_batches == 1:
          acc_m.append(val)
          continue
        buf = (jnp.zeros((plan.num_micro_batches * micro_rows, *val.shape[1:]),
                         val.dtype) if first else acc[1][j])
        acc_m.append(lax.dynamic_update_slice_in_dim(buf, val, i * micro_rows, 0))
      elif kind in (OutputKind.MEAN, OutputKind.SUM):
        acc_m.append(val[None] if first else acc[1][j] + val[None])
      else:  # OTHER: only possible with one micro-batch on one device
        acc_m.append(val)
    if not sync:
      return acc_g, acc_m
    red_g = [_reduce_manual(a[0], s, manual) / groups
             for a, s in zip(acc_g, grad_specs, strict=True)]
    red_m = []
    for kind, a in zip(kinds, acc_m, strict=True):
      if kind is OutputKind.MEAN:
        red_m.append(lax.psum(a[0], manual) / groups if manual else a[0] / groups)
      elif kind is OutputKind.SUM:
        red_m.append(lax.psum(a[0], manual) if manual else a[0])
      else:
        red_m.append(a)
    return red_g, red_m

  def local_spec(kind):
    return (PartitionSpec(batch_entry) if kind in (OutputKind.CONCAT, OutputKind.MEAN,
                                                   OutputKind.SUM)
            else PartitionSpec())

  leaf_specs_manual = [PartitionSpec(batch_entry) if l.is_batch else
                       _manual(s, manual) for l, s in zip(leaves, in_specs)]
  acc_specs = ([PartitionSpec(batch_entry)] * num_grads, [local_spec(k) for k in kinds])
  if sync:
    out_specs = ([_manual(s, manual) for s in grad_specs],
                 [PartitionSpec(batch_entry) if k is OutputKind.CONCAT else
                  PartitionSpec() for k in kinds])
  else:
    out_specs = acc_specs

  def manual_over_batch_axes(f, in_specs):
    # No batch axes: nothing is manual (an empty `axis_names` would mean all).
    if not manual:
      return f
    return jax.shard_map(f, mesh=amesh, in_specs=in_specs, out_specs=out_specs,
                         axis_names=set(manual), check_vma=False)

  if first:
    def fn(leaf_vals):
      return manual_over_batch_axes(lambda lv: body(lv, 0, None),
                                    (leaf_specs_manual,))(leaf_vals)
  else:
    def fn(leaf_vals, i, acc):
      return manual_over_batch_axes(
          body, (leaf_specs_manual, PartitionSpec(), acc_specs))(leaf_vals, i, acc)

  ns = lambda s, m=amesh: NamedSharding(m, s)
  leaf_shardings = [ns(s) for s in in_specs]
  acc_shardings = ([ns(_stacked(s, manual)) for s in grad_specs],
                   [ns(PartitionSpec(batch_entry)) if k is not OutputKind.OTHER
                    else ns(PartitionSpec()) for k in kinds])
  if sync:
    out_shardings = ([ns(s) for s in grad_specs],
                     [ns(s, user_mesh) for s in micro_out_specs])
  else:
    out_shardings = acc_shardings
  if first:
    return jax.jit(fn, in_shardings=(leaf_shardings,), out_shardings=out_shardings)
  return jax.jit(fn, in_shardings=(leaf_shardings, ns(PartitionSpec()), acc_shardings),
                 out_shardings=out_shardings, donate_argnums=(2,))


def _apply_stage(split: SplitStep, plan: Plan, amesh, user_mesh,
                 donated: Sequence[int], kept: Sequence[int]):
  leaves = split.traced.leaves
  jaxpr = split.apply.jaxpr
  consts = split.consts
  apply_specs = [plan.outputs[j].spec for j, k in enumerate(split.out_kinds)
                 if k is OutputKind.APPLY]
  constraints = _constraints(plan, "apply")
  _check_pins(constraints, jaxpr, "apply")
  if plan.batch_axes:
    # The plan fixes only the planned axes here; dims it leaves unsplit stay
    # free for XLA to keep state split over the batch axes (ZeRO/FSDP).
    constraints = {i: {j: _unconstrained_where_unsplit(sp) for j, sp in outs.items()}
                   for i, outs in constraints.items()}
  pin = lambda x, spec: lax.with_sharding_constraint(x, NamedSharding(amesh, spec))

  def fn(donated_vals, kept_vals, grads):
    vals: list[Any] = [None] * len(leaves)   # batch leaves are never read here
    for k, x in zip(donated, donated_vals, strict=True):
      vals[k] = x
    for k, x in zip(kept, kept_vals, strict=True):
      vals[k] = x
    return _eval_jaxpr(jaxpr, consts, [*vals, *grads], constraints, pin)

  ns = lambda s, m=amesh: NamedSharding(m, s)
  in_shardings = ([ns(plan.inputs[k].spec) for k in donated],
                  [ns(plan.inputs[k].spec) for k in kept],
                  [ns(g.spec) for g in plan.grads])
  out_shardings = [ns(s, user_mesh) for s in apply_specs]
  return jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings,
                 donate_argnums=(0,) if donated else ())


def _unconstrained_where_unsplit(spec: PartitionSpec) -> PartitionSpec:
  return PartitionSpec(*(PartitionSpec.UNCONSTRAINED if e is None else e
                         for e in spec))


def _whole_step(split: SplitStep, plan: Plan, amesh, user_mesh,
                donated: Sequence[int], kept: Sequence[int], batch: Sequence[int]):
  leaves = split.traced.leaves
  jaxpr = split.apply.jaxpr
  consts = split.consts

  def fn(donated_vals, kept_vals, batch_vals):
    vals: list[Any] = [None] * len(leaves)
    for idx, group in ((donated, donated_vals), (kept, kept_vals), (batch, batch_vals)):
      for k, x in zip(idx, group, strict=True):
        vals[k] = x
    return jax_core.eval_jaxpr(jaxpr, (), *consts, *vals)

  ns = lambda s, m=amesh: NamedSharding(m, s)
  in_shardings = tuple([ns(plan.inputs[k].spec) for k in idx]
                       for idx in (donated, kept, batch))
  out_shardings = [ns(v.spec, user_mesh) for v in plan.outputs]
  return jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings,
                 donate_argnums=(0,) if donated else ())


# -- compile ------------------------------------------------------------------

def _abstract(shape, dtype, weak=False):
  return jax.ShapeDtypeStruct(tuple(shape), dtype, weak_type=weak)


# XLA options that let collectives run asynchronously and overlap compute on
# GPUs: the latency-hiding scheduler issues each collective's start as early
# as its operands allow (a gradient's reduce-scatter while the backward pass
# of the layers below is still running) and its done as late as possible;
# the pipelining options move the collectives of a loop (scanned layers)
# across iterations. Used for GPU compiles only, and only the options the
# user has not set in XLA_FLAGS. XLA renames and retires these between
# releases; options the installed XLA does not know are left out (see
# _known_option).
GPU_OVERLAP_OPTIONS = {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_gpu_enable_pipelined_all_gather": True,
    "xla_gpu_enable_pipelined_reduce_scatter": True,
    "xla_gpu_enable_pipelined_all_reduce": True,
    "xla_gpu_enable_while_loop_double_buffering": True,
    "xla_gpu_enable_highest_priority_async_stream": True,
}
_KNOWN: dict[tuple[str, str], bool] = {}


def compiler_options(mesh, xla_flags: str | None = None,
                     known: Callable[[str, Any], bool] | None = None) -> dict[str, Any]:
  """Per-executable XLA options for stages compiled on ``mesh``'s devices.

  Empty on CPUs (autopar never changes their flags); on GPUs the overlap
  options above that the installed XLA knows, minus any the user set in
  ``XLA_FLAGS`` (``xla_flags`` and ``known`` stand in for the variable and
  the check in tests).
  """
  devices = list(np.asarray(mesh.devices).flat)
  if not {d.platform for d in devices} & {"gpu", "cuda", "rocm"}:
    return {}
  user = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
  known = known or (lambda k, v: _known_option(k, v, devices[0]))
  return {k: v for k, v in GPU_OVERLAP_OPTIONS.items()
          if f"--{k}" not in user and known(k, v)}


def _known_option(name: str, value: Any, device) -> bool:
  """Whether this XLA accepts compiler option ``name`` (a tiny compile, cached)."""
  key = (device.platform, name)
  if key not in _KNOWN:
    try:
      x = jax.ShapeDtypeStruct((), np.float32,
                               sharding=jax.sharding.SingleDeviceSharding(device))
      jax.jit(lambda x: x + 1).lower(x).compile({name: value})
      _KNOWN[key] = True
    except Exception:  # noqa: BLE001 - "No such compile option", or a bad value
      _KNOWN[key] = False
  return _KNOWN[key]


def lower_step(split: SplitStep, split_local: SplitStep, plan: Plan, mesh
               ) -> LoweredStep:
  """Compiles every stage of ``split`` under ``plan`` on the concrete ``mesh``.

  ``split`` is the step traced at the global micro-batch size; ``split_local``
  the same step traced at the rows one device holds of a micro-batch (they
  are the same object when the batch axes hold one device).
  """
  amesh = auto_mesh(mesh)
  leaves = split.traced.leaves
  donated = tuple(k for k, l in enumerate(leaves) if l.is_donated)
  kept = tuple(k for k, l in enumerate(leaves) if not l.is_donated and not l.is_batch)
  batch = tuple(k for k, l in enumerate(leaves) if l.is_batch)
  in_shardings = tuple(NamedSharding(amesh, v.spec) for v in plan.inputs)
  leaf_avals = [l.abstract() for l in leaves]
  n = plan.num_micro_batches
  stages: dict[str, Any] = {}
  index = ()
  options = compiler_options(mesh) or None

  with warnings.catch_warnings():
    # The last gradient stage donates its partial sums although the reduced
    # gradients have another shape: the buffers are freed, not reused.
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    if not split.has_marker:
      fn = _whole_step(split, plan, amesh, mesh, donated, kept, batch)
      stages["step"] = fn.lower([leaf_avals[k] for k in donated],
                                [leaf_avals[k] for k in kept],
                                [leaf_avals[k] for k in batch]).compile(options)
      schedule = ("step",)
    else:
      rows = split_local.traced.micro_batch_size
      names = grad_stage_names(n)
      acc_avals = _acc_avals(split, plan)
      for pos, name in enumerate(names):
        if name in stages:
          continue
        first, sync = pos == 0, pos == n - 1
        fn = _grad_stage(split_local, plan, amesh, mesh, first=first, sync=sync,
                         micro_rows=rows)
        if first:
          lowered = fn.lower(leaf_avals)
        else:
          lowered = fn.lower(leaf_avals, _abstract((), np.int32), acc_avals)
        stages[name] = lowered.compile(options)
      fn = _apply_stage(split, plan, amesh, mesh, donated, kept)
      grad_avals = [_abstract(a.shape, a.dtype) for a in split.grad_avals]
      stages["apply_grad"] = fn.lower([leaf_avals[k] for k in donated],
                                      [leaf_avals[k] for k in kept],
                                      grad_avals).compile(options)
      schedule = (*names, "apply_grad")
      replicated = NamedSharding(amesh, PartitionSpec())
      index = tuple(jax.device_put(np.int32(i), replicated) for i in range(n))
  return LoweredStep(stages=stages, schedule=schedule, in_shardings=in_shardings,
                     micro_batch_index=index, donated=donated, kept=kept, batch=batch)


def _acc_avals(split: SplitStep, plan: Plan):
  sizes = plan.axis_sizes
  d = math.prod(sizes[a] for a in plan.batch_axes)
  grads = [_abstract((d, *a.shape), a.dtype) for a in split.grad_avals]
  micro = []
  outvars = split.traced.jaxpr.jaxpr.outvars
  batch_size = split.traced.micro_batch_size * plan.num_micro_batches
  for kind, v in zip(split.out_kinds, outvars, strict=True):
    if kind is OutputKind.APPLY:
      continue
    if kind is OutputKind.CONCAT:
      micro.append(_abstract((batch_size, *v.aval.shape[1:]), v.aval.dtype))
    elif kind in (OutputKind.MEAN, OutputKind.SUM):
      micro.append(_abstract((d,), v.aval.dtype))
    else:
      micro.append(_abstract(v.aval.shape, v.aval.dtype))
  return grads, micro
