"""``apply_grad`` cut per stage: each stage updates its own state.

The update (``split.SplitStep.apply``) reads the state, the gradients and
the accumulated reductions, and every one of those lives on one stage's
submesh (its *home*). :func:`partition_apply` gives each equation of the
update a stage, and groups the equations into :class:`Segment`\\ s, each one
executable on one submesh:

* an equation that reads values of one stage runs there (a parameter's
  update runs where the parameter lives);
* one that reads values of several (a global gradient norm summing the
  stages' partial norms) runs on the stage whose inputs are largest, and the
  others' values are sent to it;
* a *free* equation reads no stage's values (a step counter ``count + 1``,
  a learning-rate schedule): every segment that needs it computes it;
* a state leaf that only the update reads (an optimizer moment) lives on the
  stage of the first equation that needs it.

Segments run in *phases*: an equation that reads a value made on another
stage runs at least one phase after the equation that made it, so a global
gradient norm becomes: each stage's partial sums (phase 0), their sum on one
stage (phase 1), each stage's clipped update (phase 2), with only scalars
crossing between submeshes. Before / after, for ``clip_by_global_norm``
with two stages::

    apply: n = sqrt(sum(g0**2) + sum(g1**2)); w0' = w0 - g0/n; w1' = ...
    ->  (stage 0, phase 0): s0 = sum(g0**2)
        (stage 1, phase 0): s1 = sum(g1**2)
        (stage 1, phase 1): n = sqrt(s0 + s1)          # s0 sent to stage 1
        (stage 0, phase 2): w0' = w0 - g0/n             # n sent to stage 0
        (stage 1, phase 1): w1' = w1 - g1/n
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

from jax.extend.core import Jaxpr, Literal, Var


__all__ = ["Segment", "ApplyPartition", "partition_apply"]


@dataclasses.dataclass(frozen=True)
class Segment:
  """Equations of the update that run together on one stage.

  ``jaxpr``'s invars are ``inputs`` and its outvars ``outputs``, all
  variables of the update's jaxpr.
  """
  stage: int
  phase: int
  jaxpr: Jaxpr
  inputs: tuple[Var, ...]
  outputs: tuple[Var, ...]


@dataclasses.dataclass(frozen=True)
class ApplyPartition:
  """The update, cut into segments (run in order).

  Attributes:
    segments: in an order that runs every segment after those it reads.
    home: variable of the update's inputs (a leaf, gradient or reduction)
      -> the stage it lives on.
    out_home: per output of the update, the stage it is made on (or handed
      back from, for an output that is an input).
  """
  segments: tuple[Segment, ...]
  home: dict
  out_home: tuple[int, ...]

  def of_stage(self, s: int) -> list[Segment]:
    return [g for g in self.segments if g.stage == s]


def _bytes(v) -> int:
  shape = getattr(v.aval, "shape", ())
  if not all(isinstance(d, int) for d in shape):
    return 0
  return math.prod(shape) * int(v.aval.dtype.itemsize)


def partition_apply(jaxpr: Jaxpr, homes: Mapping[Var, int], num_stages: int,
                    donated: Mapping[int, Var] | None = None) -> ApplyPartition:
  """Cuts the update ``jaxpr`` into segments (see the module docstring).

  ``homes``: the stage of every input whose stage is known (the leaves the
  forward pass reads, the gradients, the reductions); the other inputs get
  one here. ``donated``: output index -> the input leaf it replaces.
  """
  eqns = jaxpr.eqns
  owner: dict = dict(homes)
  eqn_owner: dict[int, int] = {}
  free: set[int] = set()
  for i, e in enumerate(eqns):
    by_stage: dict[int, int] = {}
    for v in e.invars:
      if isinstance(v, Var) and v in owner:
        by_stage[owner[v]] = by_stage.get(owner[v], 0) + _bytes(v) + 1
    if not by_stage:
      free.add(i)
      continue
    s = max(sorted(by_stage), key=lambda t: by_stage[t])
    eqn_owner[i] = s
    for v in e.outvars:
      owner[v] = s
  producer = {v: i for i, e in enumerate(eqns) for v in e.outvars}

  def free_inputs(v, acc: set, seen: set):
    """Inputs of the update that ``v`` reads through free equations."""
    if not isinstance(v, Var) or v in seen:
      return
    seen.add(v)
    p = producer.get(v)
    if p is None:
      acc.add(v)
    elif p in free:
      for a in eqns[p].invars:
        free_inputs(a, acc, seen)

  # Inputs only free equations read live where their first user runs.
  home = {v: owner[v] for v in jaxpr.invars if v in owner}
  for i, e in enumerate(eqns):
    if i in free:
      continue
    acc: set = set()
    for a in e.invars:
      if isinstance(a, Var) and producer.get(a) in free:
        free_inputs(a, acc, set())
    for v in acc:
      home.setdefault(v, eqn_owner[i])
  for v in jaxpr.invars:
    home.setdefault(v, 0)

  # Where each output is made.
  out_home = []
  donated = dict(donated or {})
  for j, v in enumerate(jaxpr.outvars):
    if isinstance(v, Literal):
      out_home.append(0)
    elif v in home:
      out_home.append(home[v])
    elif producer[v] in free:
      leaf = donated.get(j)
      acc = set()
      free_inputs(v, acc, set())
      out_home.append(home[leaf] if leaf is not None and leaf in home else
                      min((home[a] for a in acc), default=0))
    else:
      out_home.append(eqn_owner[producer[v]])

  # Phases: one more than a producer on another stage.
  phase: dict[int, int] = {}
  for i in sorted(eqn_owner):
    p = 0
    for a in eqns[i].invars:
      q = producer.get(a) if isinstance(a, Var) else None
      if q is not None and q in eqn_owner:
        p = max(p, phase[q] + (eqn_owner[q] != eqn_owner[i]))
    phase[i] = p
  groups: dict[tuple[int, int], list[int]] = {}
  for i in sorted(eqn_owner):
    groups.setdefault((phase[i], eqn_owner[i]), []).append(i)
  last_phase = {s: max((p for p, t in groups if t == s), default=0)
                for s in range(num_stages)}
  # Outputs made by free equations: in their stage's last segment.
  free_outs: dict[int, list[Var]] = {}
  for j, v in enumerate(jaxpr.outvars):
    if isinstance(v, Var) and v not in home and producer[v] in free:
      free_outs.setdefault(out_home[j], []).append(v)
  for s in free_outs:
    groups.setdefault((last_phase[s], s), [])

  # Who reads what: a segment's outputs are what other segments, or the
  # update's outputs homed on its stage, read of it.
  readers: dict = {}
  for (p, s), idx in groups.items():
    for i in idx:
      for a in eqns[i].invars:
        if isinstance(a, Var):
          readers.setdefault(a, set()).add((p, s))
  outputs_at: dict = {}
  for j, v in enumerate(jaxpr.outvars):
    if isinstance(v, Var):
      outputs_at.setdefault(v, set()).add(out_home[j])

  segments = []
  for (p, s) in sorted(groups):
    own = list(groups[(p, s)])
    needed: set[int] = set()
    stack = [a for i in own for a in eqns[i].invars]
    stack += free_outs.get(s, []) if p == last_phase[s] else []
    while stack:
      a = stack.pop()
      q = producer.get(a) if isinstance(a, Var) else None
      if q is not None and q in free and q not in needed:
        needed.add(q)
        stack.extend(eqns[q].invars)
    order = sorted(set(own) | needed)
    made = {v for i in order for v in eqns[i].outvars}
    inputs = list(dict.fromkeys(a for i in order for a in eqns[i].invars
                                if isinstance(a, Var) and a not in made))
    for v in (free_outs.get(s, []) if p == last_phase[s] else []):
      if v not in made and v not in inputs:
        inputs.append(v)
    outs = []
    for i in own:
      for v in eqns[i].outvars:
        if any(r != (p, s) for r in readers.get(v, ())) or s in outputs_at.get(v, ()):
          outs.append(v)
    if p == last_phase[s]:
      outs.extend(v for v in free_outs.get(s, []) if v not in outs)
    seg = Jaxpr([], inputs, outs, [eqns[i] for i in order], jaxpr.effects,
                jaxpr.debug_info)
    segments.append(Segment(stage=s, phase=p, jaxpr=seg, inputs=tuple(inputs),
                            outputs=tuple(outs)))
  return ApplyPartition(segments=tuple(segments), home=home, out_home=tuple(out_home))
