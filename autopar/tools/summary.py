"""``plan.summary()``: a plan on one screen.

One row per parameter group (repeated layers collapsed, see ``groups.py``)
with its gradient's and optimizer state's specs beside it; the other
inputs; collectives per stage with their predicted time; memory per device
by kind; the solver's statistics and the costs the plan assumed. For a
pipeline the stage table comes first. ``summary(full=True)`` is the table
of every leaf (``Plan.full_summary``).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Sequence

from autopar.costs.cost_model import MeshCost
from autopar.costs.schedule import (Task, Timeline, bubble, simulate, splits_backward,
                                    stage_tasks, stages_on)
from autopar.tools.groups import (Group, collapse, collapsed_name, other_rows, param_rows,
                                  params_prefix)
from autopar.text import axes_str, canonical_str, format_bytes, format_rows, same_spec

if TYPE_CHECKING:
  from autopar.plan import Plan

__all__ = ["summary", "solver_lines", "collective_rows", "memory_by_kind", "group_rows",
           "input_sizes", "batch_split", "stage_rows", "stage_lines", "timeline"]


def summary(plan: "Plan") -> str:
  """The plan on one screen (see the module docstring)."""
  sizes = plan.axis_sizes
  mesh = " x ".join(f"{n}={s}" for n, s in sizes.items())
  lines = stage_lines(plan) if plan.stages else []
  lines.append(f"autopar plan: {plan.method} on mesh ({mesh}), "
               f"{plan.num_micro_batches} micro-batch(es), batch split "
               f"{batch_split(plan)}; objective {plan.objective:.4g} s (estimated)")
  if plan.micro_batch_search:
    lines.append("num_micro_batches='auto': the stage search planned each number; its "
                 "best plan's step time in the search's model:")
    for k, t, why in plan.micro_batch_search:
      lines.append(f"  {k}: {why}" if t is None else f"  {k}: {t:.6g} s ({why})")
  rows = param_rows(plan)
  params, others = collapse(rows), collapse(other_rows(plan, rows))
  if params:
    lines.append("")
    lines += format_rows(group_rows(params, plan, params=True,
                                    prefix=params_prefix(rows)))
  if others:
    lines.append("")
    lines += format_rows(group_rows(others, plan, params=False))
  if plan.hints:
    lines.append("")
    lines.append(f"sharding hints kept: {len(plan.hints)} (summary(full=True) lists them)")
  lines.append("")
  coll = collective_rows(plan)
  if coll:
    lines.append("collectives per step (predicted time from the costs below):")
    lines += format_rows([("stage", "kind", "axes", "count", "bytes/device", "time")] +
                         [(r["stage"], r["kind"], axes_str(r["axes"]), str(r["count"]),
                           format_bytes(r["bytes"]), _seconds(r["seconds"]))
                          for r in coll])
  else:
    lines.append("collectives per step: none")
  lines.append("")
  memory = memory_by_kind(plan, rows)
  lines.append("memory per device: " + ", ".join(
      f"{k} {format_bytes(v)}" for k, v in memory.items()))
  lines += solver_lines(plan)
  return "\n".join(lines)


def batch_split(plan: "Plan") -> str:
  """Where the batch's rows are split: ``over (data)``; in a pipeline, each
  stage's (``stage 0 over (data), stage 1 over (data)``), or ``over
  (data) in every stage``."""
  if not plan.stages:
    return f"over {axes_str(plan.batch_axes)}"
  each = [axes_str(st.batch_axes) for st in plan.stages]
  if len(set(each)) == 1:
    return f"over {each[0]} in every stage"
  return ", ".join(f"stage {st.index} over {a}" for st, a in zip(plan.stages, each,
                                                                 strict=True))


def stage_rows(plan: "Plan") -> list[tuple[str, ...]]:
  """The pipeline's stage table: a header, then one row per stage: the
  layers it runs, the parameters they read (named short: ``Block_{0..1},
  Embed_0 (34 leaves)``), its submesh and batch axes, its predicted times,
  memory per device, micro-batches in flight and what it sends on."""
  S = len(plan.stages)
  params = param_rows(plan)
  prefix = params_prefix(params)
  rows = [("stage", "layers", "parameters", "submesh", "batch over", "t/micro-batch",
           "t/step", "memory/device", "in flight", "sends/micro-batch")]
  for st in plan.stages:
    own = [r for r in params if r.stage == st.index]
    tops = [r.name.split("/")[0] for r in own]
    names = [collapsed_name(pattern, members)
             for pattern, members in _by_pattern(tops).items()]
    held = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    shape = "x".join(map(str, st.submesh_shape))
    rows.append((str(st.index), f"{st.layers[0]}-{st.layers[1] - 1}",
                 f"{held or '-'} ({len(own)}{f' under {prefix}' if prefix else ''})",
                 f"{shape} from device {st.submesh_offset}", axes_str(st.batch_axes),
                 _seconds(st.time_per_micro_batch), _seconds(st.time_per_step),
                 format_bytes(st.memory_per_device), str(st.in_flight),
                 f"{format_bytes(st.bytes_to_next)} in {_seconds(st.send_seconds)}"
                 if st.index < S - 1 else "-"))
  return rows


def _by_pattern(names: Sequence[str]) -> dict[str, list[str]]:
  """``names`` by their pattern (numbers as ``#``), in order, each once."""
  out: dict[str, list[str]] = {}
  for n in dict.fromkeys(names):
    out.setdefault(re.sub(r"\d+", "#", n), []).append(n)
  return out


def timeline(plan: "Plan") -> tuple[list[list[Task]], Timeline]:
  """The pipeline's tasks per stage, in order, and the schedule replayed on
  the plan's predicted stage times (a forward a third of a micro-batch's
  time, a backward two thirds; where the schedule splits it, its B and its
  W a third each, as the stage search prices them)."""
  schedule = plan.schedule or "1f1b"
  v = plan.virtual_stages
  per_stage = stage_tasks(schedule, len(plan.stages) // v, plan.num_micro_batches, v)
  split = splits_backward(schedule)

  def duration(t: Task) -> float:
    tm = plan.stages[t.stage].time_per_micro_batch or 1.0
    return tm / 3 if t.kind == "F" or split else 2 * tm / 3
  return per_stage, simulate(per_stage, duration)


def stage_lines(plan: "Plan") -> list[str]:
  """The stage table as text, with what the step time is made of, and the
  schedule's tasks per stage."""
  n, S = plan.num_micro_batches, len(plan.stages)
  schedule = plan.schedule or "1f1b"
  split = splits_backward(schedule)
  v = plan.virtual_stages
  lines = [f"pipeline: {S} stage(s), schedule {schedule}, {n} micro-batch(es)",
           "each stage runs its layers' forward and backward passes for every "
           "micro-batch on its own submesh," if v == 1 else
           f"each stage runs its layers' forward and backward passes for every "
           f"micro-batch, {v} stages on each of {S // v} submeshes ("
           + (f"stage k on submesh k mod {S // v}" if schedule != "zb-v" else
              f"a V: stages k and {S - 1} - k on submesh k") + "),",
           "then sums its gradients over its batch axes and updates its parameters"]
  lines += format_rows(stage_rows(plan))
  zero = [str(st.index) for st in plan.stages if st.zero_state]
  if zero:
    lines.append(f"stage(s) {', '.join(zero)} keep their optimizer state split over "
                 f"their batch axes (ZeRO-2)")
  zero = [str(st.index) for st in plan.stages if st.zero_params]
  if zero:
    lines.append(f"stage(s) {', '.join(zero)} keep their parameters split over their "
                 f"batch axes too (ZeRO-3: each pass gathers them, for every "
                 f"micro-batch)")
  t = [st.time_per_micro_batch for st in plan.stages]
  per_stage, tl = timeline(plan) if S else ([], None)
  if t:
    f = [st.first_pass_seconds for st in plan.stages if st.first_pass_seconds]
    if schedule == "zb-v":
      lines.append(f"predicted step time: {plan.objective:.6g} s = the schedule's "
                   f"order replayed on the stage times (F, B and W a third of each), "
                   f"{tl.makespan:.3g} s, + sends and updates"
                   f"{' + the first pass' if f else ''}")
    elif split:
      lines.append(f"predicted step time: {plan.objective:.6g} s = {n} x slowest "
                   f"{max(t):.3g} s + a third of the other stages' times, "
                   f"{(sum(t) - max(t)) / 3:.3g} s (the weights' gradients fill the "
                   f"rest of the fill and drain) + sends and updates"
                   f"{' + the first pass' if f else ''}")
    elif v > 1:
      busy = [sum(on) for on in stages_on(schedule, S // v, t)]
      lines.append(f"predicted step time: {plan.objective:.6g} s = {n} x busiest submesh "
                   f"{max(busy):.3g} s + the other stages' times {sum(t) - max(busy):.3g} "
                   f"s / {v} + sends and updates{' + the first pass' if f else ''}")
    else:
      lines.append(f"predicted step time: {plan.objective:.6g} s = sum of stage times "
                   f"{sum(t):.3g} s + ({n} - 1) x slowest {max(t):.3g} s + sends and "
                   f"updates{' + the first pass' if f else ''}")
    if f:
      lines.append(
          f"first pass (the loss's gradient reads sums over the batch that depend on "
          f"the parameters): stage(s) 0-{len(f) - 1} run their forward passes alone "
          f"for every micro-batch before the schedule, predicted "
          f"{sum(f) + (n - 1) * max(f):.3g} s = {sum(f):.3g} s + ({n} - 1) x slowest "
          f"{max(f):.3g} s (a forward priced at a third of its stage's time per "
          f"micro-batch)")
  if S:
    kinds = ("B the cotangents of its inputs, W its weights' gradient" if split
             else "B backward")
    where = "stage" if v == 1 else "submesh"
    lines.append(f"schedule {schedule}, each {where}'s tasks in order (F forward, {kinds}"
                 f"; micro-batch number{', @stage' if v > 1 else ''}): bubble "
                 f"{tl.bubble:.1%} on the predicted stage times, "
                 f"{bubble(schedule, S // v, n, virtual_stages=v):.1%} in theory with "
                 f"every stage alike")
    for s_, tasks in enumerate(per_stage):
      lines.append(f"  {where} {s_}: " + " ".join(
          f"{t.kind}{t.micro_batch}" + (f"@{t.stage}" if v > 1 else "") for t in tasks))
  if plan.schedule_search:
    lines.append("schedule='auto': the stage search planned each schedule; its best plan's "
                 "predicted step time:")
    for name, t, why in plan.schedule_search:
      took = "no plan fits" if t is None else f"{t:.6g} s"
      lines.append(f"  {name}: {took} ({why})")
  lines.append("")
  return lines


def input_sizes(plan: "Plan") -> dict[str, dict[str, int]]:
  """Input name -> the axis sizes its spec is over: the mesh's, or in a
  pipeline the submesh of the stage that holds it."""
  names = plan.mesh_axis_names
  return {v.name: dict(zip(names, shape, strict=True))
          for v, (_, shape, _) in zip(plan.inputs, plan.placements(), strict=True)}


def solver_lines(plan: "Plan") -> list[str]:
  """How the plan was found, and the costs it assumed."""
  lines = []
  if plan.solver is not None:
    s = plan.solver
    lines.append(f"solver: {s.solver} ({s.status}) in {s.seconds:.3g} s; "
                 f"{s.num_variables} variables, {s.num_constraints} constraints, "
                 f"{s.num_equations} equations, {s.num_classes} classes")
    if s.timings:
      lines.append("planning time: " + ", ".join(f"{k} {v:.2f} s"
                                                 for k, v in s.timings.items()))
  if not plan.costs:
    lines.append("costs: not recorded in this plan (times above use the defaults)")
  else:
    c = plan.costs
    budget = c.get("memory_budget_per_device")
    # Per axis of size > 1: one of size 1 has no collectives.
    axes = [f"{a}: alpha {c['alpha'][a]:.3g} s, {1 / c['beta'][a] / 1e9:.3g} GB/s"
            for a, n in plan.axis_sizes.items() if n > 1 and c["beta"].get(a)]
    lines.append("costs assumed: " + "; ".join(
        [f"{c['seconds_per_flop']:.3g} s/flop"] +
        ([f"memory {1 / c['seconds_per_byte'] / 1e9:.3g} GB/s"]
         if c.get("seconds_per_byte") else []) + axes +
        ([f"memory budget {format_bytes(budget)}"] if budget else []) +
        [f"device kind {c['device_kind']}" if c.get("device_kind") else
         "no device kind: what was not given by hand is the defaults (1 TFLOP/s, "
         "50 GB/s memory, 1 us and 10 GB/s per collective step), not a real "
         "device's; name one with AutoShardingOption(device_kind=...)"]))
  if plan.predicted_time:
    t = plan.predicted_time
    lines.append("predicted time per step: " + "; ".join(
        f"{s} {t[s]['total'] * 1e6:.1f} us (flops {t[s]['flops'] * 1e6:.1f}, memory "
        f"{t[s]['memory'] * 1e6:.1f}, collectives {t[s]['collectives'] * 1e6:.1f})"
        for s in ("gradient", "apply") if s in t))
  return lines


def group_rows(groups: Sequence[Group], plan: "Plan", *, params: bool,
               prefix: str = "") -> list[tuple]:
  """The table rows of ``groups``: for parameters, the spec of each, its
  gradient's and its state's, and bytes per device (all copies)."""
  sizes = input_sizes(plan)

  def nbytes(v, holder) -> int:
    # A gradient lies where its parameter (``holder``) does: in a pipeline,
    # on the submesh of the parameter's stage.
    return v.bytes_per_device(sizes.get(v.name, sizes.get(holder.name, plan.axis_sizes)))
  first = f"parameter (under {prefix})" if prefix else "parameter"
  if params:
    header = (first, "n", "shape", "dtype", "spec", "grad", "state", "bytes/device")
  else:
    header = ("other input", "n", "shape", "dtype", "spec", "bytes/device")
  staged = bool(plan.stages)     # a pipeline: which stage holds the group
  rows = [header[:1] + ("stage",) + header[1:] if staged else header]
  for g in groups:
    r = g.first
    v = r.value
    b = sum(nbytes(x.value, x.value) + (nbytes(x.grad, x.value) if x.grad is not None
                                         else 0) +
            sum(nbytes(s, x.value) for _, s in x.state) for x in g.rows)
    where = (("-" if r.stage is None else str(r.stage)),) if staged else ()
    common = (g.name, *where, str(len(g)), str(tuple(v.shape)), v.dtype,
              canonical_str(v.spec))
    if params:
      grad = ("=" if r.grad is None or same_spec(r.grad.spec, v.spec) else
              canonical_str(r.grad.spec))
      rows.append(common + (grad, _state(r), format_bytes(b)))
    else:
      rows.append(common + (format_bytes(b),))
  return rows


def _state(row) -> str:
  if not row.state:
    return "-"
  if all(same_spec(s.spec, row.value.spec) for _, s in row.state):
    return ", ".join(r for r, _ in row.state) + " ="
  return ", ".join(f"{r} {canonical_str(s.spec)}" for r, s in row.state)


def collective_rows(plan: Plan) -> list[dict]:
  """Collectives per step, one row per (stage, kind, axes): how many, their
  bytes per device and predicted seconds (per step, micro-batches
  included)."""
  costs = plan.costs or {}
  meshes: dict[tuple, MeshCost] = {}      # a pipeline stage's: over its submesh

  def cost(submesh) -> MeshCost:
    if submesh not in meshes:
      sizes = (dict(zip(plan.mesh_axis_names, submesh, strict=True)) if submesh
               else plan.axis_sizes)
      meshes[submesh] = MeshCost(sizes, costs.get("alpha", {}), costs.get("beta", {}))
    return meshes[submesh]
  out: dict[tuple, dict] = {}
  for c in plan.collectives:
    key = (c.stage, c.kind, tuple(c.axes))
    r = out.setdefault(key, {"stage": c.stage, "kind": c.kind, "axes": tuple(c.axes),
                             "count": 0, "bytes": 0, "seconds": 0.0})
    r["count"] += c.per_step
    r["bytes"] += c.bytes * c.per_step
    r["seconds"] += cost(tuple(c.submesh)).collective(c.kind, c.bytes, c.axes) * c.per_step
  return list(out.values())


def memory_by_kind(plan: "Plan", params: Sequence | None = None) -> dict[str, int]:
  """Bytes per device: parameters and optimizer state, the reduced
  gradients, the batch and other inputs, and the rest of the plan's
  estimate: the pass at its peak (activations, the micro-batch's own
  gradients) and the partial sums carried between micro-batches. Where the
  pass's gradients are the step's (one micro-batch, the batch on one
  device) they are counted under "gradients" and the rest is that much
  smaller. For a pipeline, each stage's total (the devices of its submesh
  hold that stage alone; the stage table says what it holds); with several
  stages a submesh, each submesh's, the sum of its stages'."""
  if plan.stages and plan.virtual_stages > 1:
    D = len(plan.stages) // plan.virtual_stages
    on = stages_on(plan.schedule, D, plan.stages)
    return {f"submesh {d} (stages {', '.join(str(st.index) for st in on[d])})":
            sum(st.memory_per_device for st in on[d]) for d in range(D)}
  if plan.stages:
    return {f"stage {st.index}": st.memory_per_device for st in plan.stages}
  sizes = plan.axis_sizes
  params = param_rows(plan) if params is None else params
  state = sum(r.value.bytes_per_device(sizes) +
              sum(s.bytes_per_device(sizes) for _, s in r.state) for r in params)
  grads = sum(g.bytes_per_device(sizes) for g in plan.grads)
  other = sum(r.value.bytes_per_device(sizes) for r in other_rows(plan, params))
  rest = max(0, plan.memory_per_device - state - grads - other)
  return {"state": state, "gradients": grads, "batch and other inputs": other,
          "the pass at its peak and partial sums": rest, "total": plan.memory_per_device}


def _seconds(t: float) -> str:
  return f"{t * 1e3:.3g} ms" if t < 1 else f"{t:.3g} s"
