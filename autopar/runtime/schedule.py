"""Pipeline schedules: which stage runs which micro-batch's forward or
backward pass, and in what order.

A schedule is a list of :class:`Task` per stage (the order that stage runs
them in); :func:`dispatch_order` interleaves them into one order that
respects the data dependencies, which is the order the driver dispatches
them in (dispatch is asynchronous, so stages on different submeshes run at
the same time).

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

:func:`simulate` replays a schedule on task durations (measured or
modelled) and gives its step time and bubble, the fraction of stage time
spent idle; for equal stage times the bubble of 1F1B and GPipe is
``(S - 1) / (n + S - 1)`` (:func:`bubble`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from autopar.method import (PIPELINE_SCHEDULES, awaiting_weights_at_most, held_at_most,
                            splits_backward)

__all__ = ["Task", "stage_tasks", "dispatch_order", "in_flight", "held_at_most",
           "awaiting_weights", "awaiting_weights_at_most", "splits_backward", "simulate",
           "bubble", "SCHEDULES"]

SCHEDULES = PIPELINE_SCHEDULES


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


def stage_tasks(schedule: str, num_stages: int, n: int) -> list[list[Task]]:
  """Per stage, the tasks it runs, in its order."""
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


def _deps(t: Task, num_stages: int) -> list[Task]:
  if t.kind == "F":
    return [Task("F", t.stage - 1, t.micro_batch)] if t.stage > 0 else []
  if t.kind == "W":
    return [Task("B", t.stage, t.micro_batch)]
  deps = [Task("F", t.stage, t.micro_batch)]
  if t.stage < num_stages - 1:
    deps.append(Task("B", t.stage + 1, t.micro_batch))
  return deps


def dispatch_order(per_stage: Sequence[Sequence[Task]]) -> list[Task]:
  """One order of all tasks that keeps each stage's order and runs every
  task after those it reads (a micro-batch's forward on the stage before,
  its backward on the stage after and its own forward; a ``W`` after its
  ``B``). Stages take turns, so work for every stage is queued early."""
  S = len(per_stage)
  pos = [0] * S
  done: set[Task] = set()
  order: list[Task] = []
  total = sum(len(p) for p in per_stage)
  while len(order) < total:
    progressed = False
    for s in range(S):
      if pos[s] < len(per_stage[s]):
        t = per_stage[s][pos[s]]
        if all(d in done for d in _deps(t, S)):
          order.append(t)
          done.add(t)
          pos[s] += 1
          progressed = True
    if not progressed:
      raise RuntimeError("pipeline schedule deadlocks: " +
                         ", ".join(str(p[i]) for p, i in zip(per_stage, pos)
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


def bubble(schedule: str, num_stages: int, n: int, forward: float = 1.0,
           backward: float = 2.0, weight_share: float = 0.5) -> float:
  """The bubble of ``schedule`` with every stage alike (a forward takes
  ``forward``, a backward ``backward``, of which ``weight_share`` is its
  ``W`` where the schedule splits it), in theory: each stage works
  ``n (F + B + W)`` and waits ``(S - 1) (F + B + W)`` under 1F1B and GPipe,
  ``(S - 1) (F + B - W)`` under ZB-H1 (at least 0)."""
  work = n * (forward + backward)
  if splits_backward(schedule):
    w = backward * weight_share
    wait = (num_stages - 1) * max(forward + backward - 2 * w, 0.0)
  else:
    wait = (num_stages - 1) * (forward + backward)
  return wait / (work + wait) if work + wait > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class Timeline:
  """A schedule replayed: per task its start and end (seconds)."""
  start: dict
  end: dict
  num_stages: int

  @property
  def makespan(self) -> float:
    return max(self.end.values(), default=0.0)

  def busy(self, s: int) -> float:
    return sum(self.end[t] - self.start[t] for t in self.end if t.stage == s)

  @property
  def bubble(self) -> float:
    """Fraction of the stages' time spent waiting."""
    span = self.makespan
    if span <= 0:
      return 0.0
    return 1.0 - sum(self.busy(s) for s in range(self.num_stages)) / (
        self.num_stages * span)


def simulate(per_stage: Sequence[Sequence[Task]], duration: Callable[[Task], float],
             transfer: Callable[[Task], float] = lambda t: 0.0) -> Timeline:
  """Replays the schedule: each stage runs its tasks in order, each as soon
  as the stage is free and its inputs have arrived (``transfer(t)``: the
  time to send what ``t`` makes to the stage that reads it)."""
  S = len(per_stage)
  start, end = {}, {}
  free = [0.0] * S
  for t in dispatch_order(per_stage):
    ready = free[t.stage]
    for d in _deps(t, S):
      ready = max(ready, end[d] + (transfer(d) if d.stage != t.stage else 0.0))
    start[t] = ready
    end[t] = ready + duration(t)
    free[t.stage] = end[t]
  return Timeline(start, end, S)
