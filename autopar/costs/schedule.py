"""Pipeline schedules: which stage runs which micro-batch's forward or
backward pass, and in what order (the runtime runs them; the stage search
counts what they hold and how long they take).

A schedule is a list of :class:`Task` per submesh (the order its devices
run them in); :func:`dispatch_order` interleaves them into one order that
respects the data dependencies, which is the order the driver dispatches
them in (dispatch is asynchronous, so stages on different submeshes run at
the same time). A task's ``stage`` is the pipeline's stage; every schedule
but the interleaved one and ZB-V runs stage ``s`` on submesh ``s``
(:func:`submesh_of`).

* ``"gpipe"``: every stage runs all forwards, then all backwards. Stage
  ``s`` holds the activations of all ``n`` micro-batches at its peak.
* ``"1f1b"`` (PipeDream-flush): stage ``s`` of ``S`` runs ``S - s - 1``
  warm-up forwards, then alternates one forward and one backward, then
  drains its backwards. It holds at most ``S - s`` micro-batches'
  activations.
* ``"zb-h1"`` (zero bubble, Qi et al., ICLR 2024): each backward is split
  into ``B``, the cotangents of the stage's inputs (what the stage before
  waits for), and ``W``, the gradient of the stage's parameters (which no
  other stage waits for). Stage ``s`` runs 1F1B's forwards and ``B``s, and
  each ``W`` ``s`` ``B``s late, the last ``s`` of them after its last ``B``:
  they fill the time it would wait at the end of the step for the stages
  before it. A micro-batch's activations are held until its ``W``, so every
  stage holds at most ``S`` micro-batches: 1F1B's most (stage 0's) on
  every stage. With ``W`` as long as ``B``, the bubble is a third of
  1F1B's: ``(S - 1) (F + B - W)`` of each stage's time against
  ``(S - 1) (F + B + W)``.
* ``"interleaved-1f1b"`` (Narayanan et al., SC 2021): the layers are cut
  into ``S v`` stages, and submesh ``d`` runs stages ``d, d + S, ...`` (its
  ``v`` virtual stages, each ``1/v`` of its layers): a micro-batch crosses
  every submesh ``v`` times. Megatron's order: submesh ``d`` runs
  ``2 (S - d - 1) + (v - 1) S`` warm-up forwards, then one forward and one
  backward in turn; micro-batches go in groups of ``S`` through each
  virtual stage in turn. The bubble is divided by ``v``,
  ``(S - 1) / (v n + S - 1)``, for ``v`` times the messages between
  stages; ``n`` must be a multiple of ``S``.
* ``"zb-v"`` (Qi et al., "Pipeline parallelism with controllable memory",
  2024): ``2 S`` stages in a V: submesh ``d`` runs stage ``d`` on the way
  down and stage ``2 S - 1 - d`` on the way back, so the last stage's
  output (the loss) and the first stage's input are on submesh 0 and the
  turn at submesh ``S - 1`` sends nothing between submeshes. Backwards are
  split as under ZB-H1. The order (:func:`_zb_v`) is built by running the
  schedule on equal task times: each submesh, whenever free, runs the
  oldest ``B`` it can, else a forward (the way back's first) while it holds
  fewer than ``2 S`` stage-micro-batches (1F1B's stage 0 holds ``S``
  micro-batches of twice the layers: the same memory), else its oldest
  ``W``. With ``F = B = W`` (one unit each) and ``n >= S``, a submesh
  waits ``S - 1`` units for ``S <= 4`` (the first micro-batch's way down:
  ``(S - 1) / (6 n + S - 1)`` of its time, half ZB-H1's ``2 (S - 1)``),
  and up to ``S - 4`` more for larger ``S`` (S = 8, n = 16: 7; n = 9: 11),
  always less than ZB-H1's. Any ``n`` works.

:func:`simulate` replays a schedule on task durations (measured or
modelled) and gives its step time and bubble, the fraction of stage time
spent idle; for equal stage times the bubble of 1F1B and GPipe is
``(S - 1) / (n + S - 1)`` (:func:`bubble`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

__all__ = ["Task", "stage_tasks", "dispatch_order", "in_flight", "held_at_most",
           "awaiting_weights", "awaiting_weights_at_most", "splits_backward", "simulate",
           "bubble", "submesh_of", "stages_on", "SCHEDULES", "AUTO_SCHEDULES",
           "VIRTUAL_SCHEDULES"]

# PipeshardParallel's schedules.
SCHEDULES = ("1f1b", "gpipe", "zb-h1", "interleaved-1f1b", "zb-v")
# The schedules that run several stages on each submesh (``virtual_stages``).
VIRTUAL_SCHEDULES = ("interleaved-1f1b", "zb-v")
# What ``schedule="auto"`` weighs: GPipe takes as long as 1F1B in the model
# and holds more, so it never wins.
AUTO_SCHEDULES = ("1f1b", "zb-h1")


def splits_backward(schedule: str) -> bool:
  """Whether ``schedule`` runs each backward as two tasks: ``B``, the
  cotangents of the stage's inputs, and ``W``, its parameters' gradient."""
  return schedule in ("zb-h1", "zb-v")


def submesh_of(schedule: str, num_submeshes: int, stage: int) -> int:
  """The submesh stage ``stage`` runs on."""
  if schedule == "interleaved-1f1b":
    return stage % num_submeshes
  if schedule == "zb-v" and stage >= num_submeshes:
    return 2 * num_submeshes - 1 - stage
  return stage


def stages_on(schedule: str, num_submeshes: int, per_stage: Sequence) -> list[list]:
  """Per submesh, the items of ``per_stage`` (one per stage, in stage
  order) of the stages it runs (:func:`submesh_of`)."""
  out: list[list] = [[] for _ in range(num_submeshes)]
  for k, x in enumerate(per_stage):
    out[submesh_of(schedule, num_submeshes, k)].append(x)
  return out


@dataclasses.dataclass(frozen=True)
class Task:
  """``kind`` of ``micro_batch`` on ``stage``: "F" (forward), "B" (backward;
  under a schedule that splits it, the cotangents of the stage's inputs
  alone) or "W" (the gradient of the stage's parameters)."""
  kind: str
  stage: int
  micro_batch: int

  def __str__(self) -> str:
    return f"{self.kind}{self.micro_batch}@{self.stage}"


def stage_tasks(schedule: str, num_stages: int, n: int,
                virtual_stages: int = 1) -> list[list[Task]]:
  """Per submesh, the tasks it runs, in its order (``num_stages``
  submeshes; ``virtual_stages`` stages on each under the interleaved
  schedule, 2 under ZB-V)."""
  if schedule == "interleaved-1f1b":
    return [_interleaved(num_stages, virtual_stages, n, d) for d in range(num_stages)]
  if schedule == "zb-v":
    if virtual_stages != 2:
      raise ValueError(f"zb-v with virtual_stages={virtual_stages}")
    return [list(tasks) for tasks in _zb_v(num_stages, n)]
  if virtual_stages != 1:
    raise ValueError(f"{schedule} with virtual_stages={virtual_stages}")
  out = []
  for s in range(num_stages):
    F = [Task("F", s, i) for i in range(n)]
    B = [Task("B", s, i) for i in range(n)]
    if schedule == "gpipe":
      out.append(F + B)
      continue
    if schedule not in ("1f1b", "zb-h1"):
      raise ValueError(schedule)
    # 1F1B: warm-up forwards, then one forward and one backward, then the
    # backwards left. ZB-H1: the same, each W ``lag`` backwards late.
    lag = s if schedule == "zb-h1" else None
    warm = min(num_stages - s - 1, n)
    order = F[:warm]
    f, b = warm, 0
    while b < n:
      if f < n:
        order.append(F[f])
        f += 1
      order.append(B[b])
      if lag is not None and b - lag >= 0:
        order.append(Task("W", s, b - lag))
      b += 1
    if lag is not None:
      order += [Task("W", s, i) for i in range(max(n - lag, 0), n)]
    out.append(order)
  return out


def _interleaved(S: int, v: int, n: int, d: int) -> list[Task]:
  """Submesh ``d``'s order under interleaved 1F1B (see the module
  docstring): its ``k``-th forward is of virtual stage ``(k // S) % v`` and
  micro-batch ``(k // (S v)) S + k % S``; its backwards take the virtual
  stages the other way round."""
  if n % S:
    raise ValueError(f"interleaved-1f1b needs n ({n}) a multiple of S ({S})")
  total = n * v

  def task(kind, k):
    chunk = (k // S) % v
    if kind == "B":
      chunk = v - 1 - chunk
    return Task(kind, chunk * S + d, (k // (S * v)) * S + k % S)
  warm = total if n == S else min(2 * (S - d - 1) + (v - 1) * S, total)
  order = [task("F", k) for k in range(warm)]
  for k in range(total - warm):
    order += [task("F", warm + k), task("B", k)]
  order += [task("B", k) for k in range(total - warm, total)]
  return order


@functools.lru_cache(maxsize=64)
def _zb_v(S: int, n: int) -> tuple[tuple[Task, ...], ...]:
  """The submeshes' orders under ZB-V (see the module docstring): the
  schedule run on tasks of one time unit each, every submesh choosing, at
  each unit, the oldest ``B`` whose inputs are there, else a forward (of
  its way-back stage first) while it holds under ``2 S`` stage-micro-
  batches, else its oldest ``W``."""
  L = 2 * S
  stages = [(L - 1 - d, d) for d in range(S)]          # the way back's first
  end: dict[Task, int] = {}
  order: list[list[Task]] = [[] for _ in range(S)]
  held = [0] * S
  next_f, next_b = [0] * L, [0] * L
  awaiting: list[list[Task]] = [[] for _ in range(S)]  # B run, W not
  left = 3 * L * n
  t = 0

  def done(task: Task) -> bool:
    return end.get(task, t + 1) <= t

  while left:
    for d in range(S):
      pick = None
      ready = [(next_b[k], -k) for k in stages[d]
               if next_b[k] < n and done(Task("F", k, next_b[k]))
               and (k == L - 1 or done(Task("B", k + 1, next_b[k])))]
      if ready:
        i, k = min(ready)
        pick = Task("B", -k, i)
        next_b[-k] += 1
        awaiting[d].append(pick)
      if pick is None and held[d] < L:
        for k in stages[d]:
          if next_f[k] < n and (k == 0 or done(Task("F", k - 1, next_f[k]))):
            pick = Task("F", k, next_f[k])
            next_f[k] += 1
            held[d] += 1
            break
      if pick is None and awaiting[d] and done(awaiting[d][0]):
        b = awaiting[d].pop(0)
        pick = Task("W", b.stage, b.micro_batch)
        held[d] -= 1
      if pick is not None:
        order[d].append(pick)
        end[pick] = t + 1
        left -= 1
    t += 1
    if t > 6 * L * n + L:      # (every task runs by then unless the rule is stuck)
      raise RuntimeError(f"zb-v order for {S} submeshes and {n} micro-batches is stuck")
  return tuple(tuple(o) for o in order)


def _deps(t: Task, num_stages: int) -> list[Task]:
  if t.kind == "F":
    return [Task("F", t.stage - 1, t.micro_batch)] if t.stage > 0 else []
  if t.kind == "W":
    return [Task("B", t.stage, t.micro_batch)]
  deps = [Task("F", t.stage, t.micro_batch)]
  if t.stage < num_stages - 1:
    deps.append(Task("B", t.stage + 1, t.micro_batch))
  return deps


def _num_stages(per_submesh: Sequence[Sequence[Task]]) -> int:
  return 1 + max((t.stage for p in per_submesh for t in p), default=-1)


def dispatch_order(per_submesh: Sequence[Sequence[Task]]) -> list[Task]:
  """One order of all tasks that keeps each submesh's order and runs every
  task after those it reads (a micro-batch's forward on the stage before,
  its backward on the stage after and its own forward; a ``W`` after its
  ``B``). Submeshes take turns, so work for every one is queued early."""
  S = _num_stages(per_submesh)
  pos = [0] * len(per_submesh)
  done: set[Task] = set()
  order: list[Task] = []
  total = sum(len(p) for p in per_submesh)
  while len(order) < total:
    progressed = False
    for s, tasks in enumerate(per_submesh):
      if pos[s] < len(tasks):
        t = tasks[pos[s]]
        if all(d in done for d in _deps(t, S)):
          order.append(t)
          done.add(t)
          pos[s] += 1
          progressed = True
    if not progressed:
      raise RuntimeError("pipeline schedule deadlocks: " +
                         ", ".join(str(p[i]) for p, i in zip(per_submesh, pos)
                                   if i < len(p)))
  return order


def in_flight(order: Sequence[Task], num_stages: int) -> list[int]:
  """Per stage, the most micro-batches whose forward it has run and whose
  backward (its ``W``, where the schedule splits it) it has not: the
  activations it holds, in ``order``."""
  release = "W" if any(t.kind == "W" for t in order) else "B"
  held = [0] * num_stages
  peak = [0] * num_stages
  for t in order:
    if t.kind == "F":
      held[t.stage] += 1
    elif t.kind == release:
      held[t.stage] -= 1
    peak[t.stage] = max(peak[t.stage], held[t.stage])
  return peak


def held_at_most(schedule: str, num_stages: int, n: int,
                 virtual_stages: int = 1) -> list[int]:
  """Per stage, the most micro-batches whose activations ``schedule`` holds
  at once (from a forward to its backward, or to its ``W``); ``num_stages``
  submeshes (``virtual_stages`` stages each under the interleaved schedule
  and ZB-V)."""
  if schedule == "gpipe":
    return [n] * num_stages
  if schedule == "zb-h1":
    return [min(n, num_stages)] * num_stages
  if schedule == "1f1b":
    return [min(n, num_stages - s) for s in range(num_stages)]
  if schedule in VIRTUAL_SCHEDULES:
    return in_flight(dispatch_order(stage_tasks(schedule, num_stages, n, virtual_stages)),
                     num_stages * virtual_stages)
  raise ValueError(schedule)


def awaiting_weights(order: Sequence[Task], num_stages: int) -> list[int]:
  """Per stage, the most micro-batches whose ``B`` it has run and whose
  ``W`` it has not (counted while the ``W`` runs), in ``order``."""
  held = [0] * num_stages
  peak = [0] * num_stages
  if not any(t.kind == "W" for t in order):
    return peak
  for t in order:
    if t.kind == "B":
      held[t.stage] += 1
    peak[t.stage] = max(peak[t.stage], held[t.stage])
    if t.kind == "W":
      held[t.stage] -= 1
  return peak


def awaiting_weights_at_most(schedule: str, num_submeshes: int, n: int,
                             virtual_stages: int = 1) -> list[int]:
  """Per stage, the most micro-batches whose ``B`` has run and whose ``W``
  has not (what the ``B`` computed for its ``W`` held meanwhile); 0 where
  the schedule does not split the backward."""
  if schedule == "zb-h1":
    return [min(s + 1, n) for s in range(num_submeshes)]
  if schedule == "zb-v":
    return awaiting_weights(dispatch_order(stage_tasks(schedule, num_submeshes, n, 2)),
                            2 * num_submeshes)
  return [0] * (num_submeshes * virtual_stages)


def bubble(schedule: str, num_stages: int, n: int, forward: float = 1.0,
           backward: float = 2.0, weight_share: float = 0.5,
           virtual_stages: int = 1) -> float:
  """The bubble of ``schedule`` with every stage alike (a forward takes
  ``forward``, a backward ``backward``, of which ``weight_share`` is its
  ``W`` where the schedule splits it), in theory: each submesh works
  ``n (F + B + W)`` and waits ``(S - 1) (F + B + W)`` under 1F1B and GPipe,
  ``(S - 1) (F + B - W)`` under ZB-H1 (at least 0), ``(S - 1) (F + B + W)
  / v`` interleaved; ZB-V's order replayed on such tasks (``S`` submeshes,
  each stage half of one's layers)."""
  if schedule == "zb-v":
    w = backward * weight_share
    took = {"F": forward / 2, "B": (backward - w) / 2, "W": w / 2}
    return simulate(stage_tasks(schedule, num_stages, n, 2),
                    lambda t: took[t.kind]).bubble
  work = n * (forward + backward)
  if splits_backward(schedule):
    w = backward * weight_share
    wait = (num_stages - 1) * max(forward + backward - 2 * w, 0.0)
  else:
    wait = (num_stages - 1) * (forward + backward)
  if schedule == "interleaved-1f1b":
    wait /= virtual_stages
  return wait / (work + wait) if work + wait > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class Timeline:
  """A schedule replayed: per task its start and end (seconds), and per
  stage its submesh."""
  start: dict
  end: dict
  num_submeshes: int
  submesh: dict = dataclasses.field(default_factory=dict)

  @property
  def makespan(self) -> float:
    return max(self.end.values(), default=0.0)

  def busy(self, d: int) -> float:
    """Seconds submesh ``d`` works."""
    return sum(self.end[t] - self.start[t] for t in self.end
               if self.submesh.get(t.stage, t.stage) == d)

  @property
  def bubble(self) -> float:
    """Fraction of the submeshes' time spent waiting."""
    span = self.makespan
    if span <= 0:
      return 0.0
    return 1.0 - sum(self.busy(d) for d in range(self.num_submeshes)) / (
        self.num_submeshes * span)


def simulate(per_submesh: Sequence[Sequence[Task]], duration: Callable[[Task], float],
             transfer: Callable[[Task], float] = lambda t: 0.0) -> Timeline:
  """Replays the schedule: each submesh runs its tasks in order, each as
  soon as the submesh is free and its inputs have arrived (``transfer(t)``:
  the time to send what ``t`` makes to the stage that reads it)."""
  S = _num_stages(per_submesh)
  submesh = {t.stage: d for d, tasks in enumerate(per_submesh) for t in tasks}
  start, end = {}, {}
  free = [0.0] * len(per_submesh)
  for t in dispatch_order(per_submesh):
    d = submesh[t.stage]
    ready = free[d]
    for dep in _deps(t, S):
      ready = max(ready, end[dep] + (transfer(dep) if dep.stage != t.stage else 0.0))
    start[t] = ready
    end[t] = ready + duration(t)
    free[d] = end[t]
  return Timeline(start, end, len(per_submesh), submesh)
