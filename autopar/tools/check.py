"""A plan's predictions against what XLA compiled (``plan.check(exe)``).

The planner predicts the collectives of a step (kind, mesh axes, bytes per
device) and its peak memory per device. Here both are read back from the
compiled stages:

* collectives from ``Compiled.as_text()`` (``autopar.backend.hlo``): each
  instruction's mesh axes from its device groups, and the bytes each device
  sends by the ring formulas, times the trips of the loops around it and
  the runs of its stage in the schedule;
* memory from ``memory_analysis()``: the largest, over the stages, of
  what the stage allocates (arguments, outputs not aliased to them,
  temporaries) plus what the step holds while the stage runs without
  passing it in (the rest of the state, the partial sums carried from the
  previous stage).

* time, per stage ("gradient": every gradient stage of the schedule;
  "apply"), as the roofline of the compiled modules: flops and bytes
  accessed (``hlo.module_cost``: XLA's ``cost_analysis()``, loops counted
  their trips) over the plan's seconds per flop and memory bandwidth, the
  larger of the two, plus every collective of the HLO priced by the
  plan's α-β (``MeshCost``), against the plan's ``predicted_time``.

A pipeline's plan (``PipeshardParallel``) is compared for memory alone,
per stage (:func:`pipeline_stage_memory`), once its first call has
compiled its stages.

Collectives are compared per (phase, kind, axes), where the phase is "per
micro-batch" (every gradient stage), "apply" (``apply_grad``) or "step"
(a step with no gradient marker, or one micro-batch's gradient and update
compiled as one executable, ``grad_and_apply``, whose time is compared as
one too): XLA fuses and splits collectives, so single instructions are not
matched.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Sequence

from autopar.backend import hlo
from autopar.costs.schedule import awaiting_weights_at_most, stages_on
from autopar.backend.lower import ONE_STAGE
from autopar.costs.cost_model import MeshCost, dtype_flop_seconds, ring_bytes_sent
from autopar.errors import PlanError
from autopar.text import axes_str, format_bytes, format_rows

if TYPE_CHECKING:
  from autopar.plan import Plan

__all__ = ["CollectiveCheck", "PlanCheck", "check", "compiled_flop_seconds", "compiled_times"]


@dataclasses.dataclass(frozen=True)
class CollectiveCheck:
  """Bytes each device sends per step for one (phase, kind, axes)."""
  phase: str
  kind: str
  axes: tuple[str, ...]
  predicted: float
  compiled: float

  def off_by(self) -> float:
    """|compiled - predicted| / predicted (inf where none was predicted)."""
    if self.predicted == 0:
      return 0.0 if self.compiled == 0 else math.inf
    return abs(self.compiled - self.predicted) / self.predicted


@dataclasses.dataclass(frozen=True)
class PlanCheck:
  """What ``plan.check(executable)`` found.

  Attributes:
    collectives: one row per (phase, kind, axes) predicted or compiled.
    predicted_memory, compiled_memory: peak bytes per device.
    stage_memory: per stage, the compiled peak bytes per device the step
      holds while it runs.
  """
  collectives: tuple[CollectiveCheck, ...]
  predicted_memory: int
  compiled_memory: int
  stage_memory: tuple[tuple[str, int], ...] = ()
  # (stage, predicted seconds, compiled seconds) per step: "gradient", "apply"
  times: tuple[tuple[str, float, float], ...] = ()

  @property
  def predicted_time(self) -> float:
    return sum(p for _, p, _ in self.times)

  @property
  def compiled_time(self) -> float:
    return sum(c for _, _, c in self.times)

  @property
  def time_ratio(self) -> float:
    """Compiled / predicted seconds per step (1.0 where not predicted)."""
    if not self.times or self.predicted_time == 0:
      return 1.0
    return self.compiled_time / self.predicted_time

  @property
  def predicted_bytes(self) -> float:
    return sum(c.predicted for c in self.collectives)

  @property
  def compiled_bytes(self) -> float:
    return sum(c.compiled for c in self.collectives)

  @property
  def bytes_ratio(self) -> float:
    """Compiled / predicted bytes sent per step (1.0 where both are 0)."""
    if self.predicted_bytes == 0:
      return 1.0 if self.compiled_bytes == 0 else math.inf
    return self.compiled_bytes / self.predicted_bytes

  @property
  def memory_ratio(self) -> float:
    """Compiled / predicted peak memory per device."""
    return self.compiled_memory / max(self.predicted_memory, 1)

  def differences(self, bytes_tolerance: float = 0.10, memory_tolerance: float = 0.15,
                  min_bytes: float = 4096, time_tolerance: float | None = None
                  ) -> list[str]:
    """What is off by more than the tolerances: each (phase, kind, axes)
    whose bytes differ by more than ``bytes_tolerance`` of the step's
    predicted bytes (rows under ``min_bytes`` both ways are ignored: the
    loss riding along), the total, and the memory."""
    out = []
    scale = max(self.predicted_bytes, self.compiled_bytes)
    for c in self.collectives:
      if max(c.predicted, c.compiled) < min_bytes:
        continue
      if abs(c.compiled - c.predicted) > bytes_tolerance * scale:
        out.append(f"{c.kind} over {axes_str(c.axes)} ({c.phase}): predicted "
                   f"{format_bytes(c.predicted)}, compiled {format_bytes(c.compiled)}")
    if scale >= min_bytes and abs(self.bytes_ratio - 1) > bytes_tolerance:
      out.append(f"bytes sent per step: predicted {format_bytes(self.predicted_bytes)}, "
                 f"compiled {format_bytes(self.compiled_bytes)} "
                 f"(x{self.bytes_ratio:.2f})")
    if time_tolerance is not None and abs(self.time_ratio - 1) > time_tolerance:
      out.append(f"time per step: predicted {self.predicted_time * 1e6:.1f} us, "
                 f"compiled {self.compiled_time * 1e6:.1f} us (x{self.time_ratio:.2f}): "
                 + ", ".join(f"{s} {p * 1e6:.1f} / {c * 1e6:.1f} us"
                             for s, p, c in self.times))
    if abs(self.memory_ratio - 1) > memory_tolerance:
      out.append(f"peak memory per device: predicted "
                 f"{format_bytes(self.predicted_memory)}, compiled "
                 f"{format_bytes(self.compiled_memory)} (x{self.memory_ratio:.2f})")
    return out

  def ok(self, bytes_tolerance: float = 0.10, memory_tolerance: float = 0.15) -> bool:
    return not self.differences(bytes_tolerance, memory_tolerance)

  def __str__(self) -> str:
    rows = [("phase", "kind", "axes", "predicted", "compiled", "off by")]
    for c in self.collectives:
      off = c.off_by()
      rows.append((c.phase, c.kind, axes_str(c.axes), format_bytes(c.predicted),
                   format_bytes(c.compiled), "new" if off == math.inf else f"{off:.0%}"))
    lines = ["collectives, bytes each device sends per step:", *format_rows(rows),
             f"total: predicted {format_bytes(self.predicted_bytes)}, compiled "
             f"{format_bytes(self.compiled_bytes)} (x{self.bytes_ratio:.2f})",
             f"peak memory per device: predicted {format_bytes(self.predicted_memory)}, "
             f"compiled {format_bytes(self.compiled_memory)} (x{self.memory_ratio:.2f})"]
    if self.stage_memory:
      lines.append("  by stage: " + ", ".join(f"{s} {format_bytes(b)}"
                                             for s, b in self.stage_memory))
    if self.times:
      lines.append(f"time per step: predicted {self.predicted_time * 1e6:.1f} us, "
                   f"compiled roofline {self.compiled_time * 1e6:.1f} us "
                   f"(x{self.time_ratio:.2f})")
      lines.append("  by stage: " + ", ".join(f"{s} {p * 1e6:.1f} / {c * 1e6:.1f} us"
                                             for s, p, c in self.times))
    return "\n".join(lines)


def _phase(stage: str) -> str:
  if stage == "apply_grad":
    return "apply"
  if stage in ("step", ONE_STAGE):
    return "step"
  return "per micro-batch"


def check(plan: "Plan", executable: Any) -> PlanCheck:
  """Compares ``plan``'s predictions with ``executable``'s compiled stages
  (see the module docstring)."""
  if plan.stages:
    return check_pipeline(plan, executable)
  stages = getattr(executable, "stages", None)
  schedule = getattr(executable, "schedule", None)
  if not stages or not schedule:
    raise PlanError(f"plan.check: expected the step's executable (step.get_executable("
                    f"*args)), got {type(executable).__name__}.")
  # One executable for the gradient and the update: compared as one phase.
  fused = ONE_STAGE in schedule
  names, shape = plan.mesh_axis_names, plan.mesh_shape
  sizes = plan.axis_sizes

  predicted: dict[tuple[str, str, tuple[str, ...]], float] = {}
  for c in plan.collectives:
    p = math.prod(sizes[a] for a in c.axes)
    key = ("step" if fused else _phase(c.stage), c.kind,
           tuple(sorted(c.axes, key=names.index)))
    predicted[key] = predicted.get(key, 0.0) + ring_bytes_sent(c.kind, c.bytes, p) * c.per_step

  compiled: dict[tuple[str, str, tuple[str, ...]], float] = {}
  runs = {s: schedule.count(s) for s in schedule}
  for stage, times in runs.items():
    for c in hlo.collectives(stages[stage]):
      if c.group_size <= 1:
        continue
      axes = c.mesh_axes(names, shape)
      key = (_phase(stage), c.kind, axes if axes is not None else ("?",))
      compiled[key] = compiled.get(key, 0.0) + c.bytes_sent * c.count * times

  rows = tuple(CollectiveCheck(*k, predicted.get(k, 0.0), compiled.get(k, 0.0))
               for k in sorted(set(predicted) | set(compiled)))
  held = sum(v.bytes_per_device(sizes) for v in plan.inputs)
  by_stage = hlo.compiled_step_memory(stages, schedule, held)
  times = ()
  if plan.predicted_time:
    compiled_t = compiled_times(plan, stages, schedule)
    times = tuple((s, float(plan.predicted_time[s]["total"]), compiled_t.get(s, 0.0))
                  for s in ("gradient", "apply") if s in plan.predicted_time)
    if fused:
      times = (("step", sum(p for _, p, _ in times), compiled_t.get("step", 0.0)),)
  return PlanCheck(collectives=rows, predicted_memory=int(plan.memory_per_device),
                   compiled_memory=max((b for _, b in by_stage), default=0),
                   stage_memory=by_stage, times=times)


def compiled_times(plan: "Plan", stages, schedule: Sequence[str]) -> dict[str, float]:
  """Seconds per step of the compiled stages by the plan's own constants:
  per stage run, max(flops x seconds per flop, bytes accessed x seconds
  per byte) plus its collectives by α-β; "gradient" sums the gradient
  stages, "apply" is ``apply_grad``, "step" is ``grad_and_apply`` (one
  micro-batch's gradient and update in one executable)."""
  c = plan.costs
  spb = float(c.get("seconds_per_byte", 0.0))
  cost = MeshCost(plan.axis_sizes, c.get("alpha", {}), c.get("beta", {}))
  names, shape = plan.mesh_axis_names, plan.mesh_shape
  out: dict[str, float] = {}
  for stage in schedule:
    t = max(compiled_flop_seconds(c, stages[stage]), hlo.module_cost(stages[stage])[1] * spb)
    for coll in hlo.collectives(stages[stage]):
      if coll.group_size > 1:
        axes = coll.mesh_axes(names, shape) or names
        t += cost.collective(coll.kind, coll.operand_bytes, axes) * coll.count
    key = {"apply_grad": "apply", ONE_STAGE: "step"}.get(stage, "gradient")
    out[key] = out.get(key, 0.0) + t
  return out


def compiled_flop_seconds(costs: dict, compiled) -> float:
  """Seconds for one run's flops of ``compiled`` at the rates in ``costs``
  (a plan's): its matmuls and convolutions at their dtype's rate
  (``hlo.matmul_flops``), the rest at float32's, as the planner prices
  them (``RuleContext.flop_seconds``)."""
  spf = float(costs.get("seconds_per_flop", 1e-12))
  rates = dict(costs.get("seconds_per_flop_by_dtype") or {})
  rate = lambda dtype: dtype_flop_seconds(rates, dtype, spf)   # noqa: E731
  total = hlo.module_cost(compiled)[0]
  matmuls = hlo.matmul_flops(compiled)
  rest = max(total - sum(matmuls.values()), 0.0)
  return rest * rate("float32") + sum(f * rate(d) for d, f in matmuls.items())


def check_pipeline(plan: "Plan", executable: Any) -> PlanCheck:
  """A pipeline's (``PipeshardParallel``) peak memory per device: per
  stage, predicted (``StagePlan.memory_per_device``) against
  :func:`pipeline_stage_memory`, and the largest of each; its
  collectives and time are not compared (no rows)."""
  stages = getattr(executable, "stages", None)
  if not stages:
    raise PlanError("plan.check: a pipeline's stages are compiled as its first call "
                    "runs them: call the step once (step(*args)), then check "
                    "step.get_executable(*args).")
  compiled = pipeline_stage_memory(plan, stages)
  most = max(b for _, b in compiled)
  if plan.virtual_stages > 1:
    # Several stages a submesh: it holds them together; the sum of their
    # peaks bounds its own (their executables do not run at once).
    D = len(plan.stages) // plan.virtual_stages
    most = max(sum(on) for on in stages_on(plan.schedule, D, [b for _, b in compiled]))
  return PlanCheck(collectives=(), predicted_memory=int(plan.memory_per_device),
                   compiled_memory=most, stage_memory=compiled)


def pipeline_stage_memory(plan: "Plan", stages) -> tuple[tuple[str, int], ...]:
  """Per pipeline stage, the most bytes per device its submesh holds while
  one of its executables runs (``stage<s>/forward``, ``backward``,
  ``sync``, ``apply<k>``): what the executable allocates (outputs not
  aliased, temporaries) beside its arguments or, if more, what the stage
  holds meanwhile whether passed in or not: its leaves
  (``StagePlan.inputs``), its gradient sums (the ``sync``'s arguments),
  and, beside a forward or backward pass, the micro-batch it makes or
  reads. The other ``in_flight - 1`` micro-batches the schedule keeps for
  their backward passes (each the forward's outputs and the activations
  the stage before sent), and under ZB-H1 and ZB-V what each B keeps for its W
  (``backward_input``'s outputs; ``backward_weight`` too runs beside them),
  are held beside a forward or backward pass."""
  out = []
  for st in plan.stages:
    sizes = dict(zip(plan.mesh_axis_names, st.submesh_shape))
    leaves = sum(v.bytes_per_device(sizes) for v in st.inputs)
    mine = {name.split("/", 1)[1]: c.memory_analysis() for name, c in stages.items()
            if name.split("/", 1)[0] == f"stage{st.index}"}
    sync, forward = mine.get("sync"), mine.get("forward")
    sums = sync.argument_size_in_bytes if sync else 0
    before = [p for p in plan.stages if p.index == st.index - 1]
    arriving = before[0].bytes_to_next / math.prod(st.submesh_shape) if before else 0
    micro = (forward.output_size_in_bytes if forward else 0) + arriving
    others = max(st.in_flight - 1, 0) * micro
    # Under ZB-H1, what each B keeps for its W, for the micro-batches
    # between the two (``awaiting_weights_at_most``).
    b_pass = mine.get("backward_input")
    if b_pass is not None:
      waiting = awaiting_weights_at_most(plan.schedule,
                                         len(plan.stages) // plan.virtual_stages,
                                         plan.num_micro_batches, plan.virtual_stages)
      others += waiting[st.index] * b_pass.output_size_in_bytes
    peak = 0
    for kind, m in mine.items():
      passes = kind in ("forward", "backward", "backward_input", "backward_weight")
      held = leaves + sums + (micro + others if passes else 0)
      args = m.argument_size_in_bytes + (others if passes else 0)
      peak = max(peak, max(args, held) + m.output_size_in_bytes
                 - m.alias_size_in_bytes + m.temp_size_in_bytes)
    out.append((f"stage{st.index}", int(peak)))
  return tuple(out)
