"""Gradients a scan makes stacked, accumulated and reduced inside that scan.

A model whose layers run as one loop makes the layers' gradients in the
backward loop, one layer per trip, as one stacked output ``[L, *shape]``:

* ``remat="layers"`` (``remat.py``): the stacked output is sliced into each
  layer's own leaf (``squeeze(slice(y, k))`` per layer), since the user's
  pytree keeps one leaf per layer;
* a model that scans over stacked weights (flax ``nn.scan``,
  ``autopar.nn.scan_layers``): the stacked output is the gradient leaf.

Evaluated as written, the gradient stages would hold that whole stack beside
the partial sums, then add it to them (one more copy of every layer's
gradient: remat then cost more memory than none), and the last micro-batch
would reduce each layer's gradient only after the loop, with all of them
unreduced at once. Instead the lowering (``lower._grad_stage``) folds the
accumulation into the scan: each trip adds its layer's gradient to the
stacked partial sums in place (or, in the last micro-batch's stage, reduces
that layer's total at once, so only its reduced share is kept). A stack of
sliced gradients stays one stacked partial sum between micro-batches and
one stacked input of ``apply_grad``, which slices it; the user's pytree is
unchanged at the step's boundary.

A group is found only where nothing else reads the stacked output or its
slices (no other equation, no output of the step), each slice is one whole
layer, every layer appears once, all the layers' gradients have one spec in
the plan, and (a stacked leaf) the plan does not scatter its layers over the
batch axes; anything else is evaluated as written.
"""

from __future__ import annotations

import collections
import dataclasses

from jax.extend.core import Jaxpr, Literal, Var
from jax.sharding import PartitionSpec

from autopar import jax_compat as jc

__all__ = ["GradStack", "find_grad_stacks", "folded_values", "slots"]


@dataclasses.dataclass(frozen=True)
class GradStack:
  """Gradients that one top-level scan of ``compute_grad`` makes stacked.

  Attributes:
    eqn: index of the scan among the top-level equations.
    out: index of the stacked output among the scan's outputs.
    grads: the gradient index of each layer, in layer order; with ``whole``
      the one gradient that is the stacked output itself.
    whole: the stacked output is one gradient (a model over stacked
      weights), not sliced into one gradient per layer.
  """
  eqn: int
  out: int
  grads: tuple[int, ...]
  whole: bool

  @property
  def slot(self):
    """Its key among ``slots``: the stack, or its one whole gradient."""
    return self.grads[0] if self.whole else self

  def spec(self, grad_specs) -> PartitionSpec:
    """The spec of the stacked value (its gradients' spec under a new
    leading, unsplit layer dimension when they are slices)."""
    spec = grad_specs[self.grads[0]]
    return spec if self.whole else PartitionSpec(None, *spec)


def find_grad_stacks(compute: Jaxpr, num_grads: int, grad_specs=None,
                     batch_axes=()) -> list[GradStack]:
  """The stacked gradients of ``compute`` (its first ``num_grads`` outputs
  are the gradients; ``grad_specs`` their specs in the plan, or None
  before there is one: every layer's spec is then taken to agree).

  A stacked gradient leaf whose plan scatters its layers over the batch
  axes is left as written: one trip's layer cannot be reduce-scattered
  over them."""
  readers = collections.defaultdict(list)
  for i, e in enumerate(compute.eqns):
    for v in e.invars:
      if not isinstance(v, Literal):
        readers[v].append(i)
  at = collections.defaultdict(list)
  for j, v in enumerate(compute.outvars):
    if not isinstance(v, Literal):
      at[v].append(j)

  def grad_index(v) -> int | None:
    """``v``'s gradient index when it is one gradient and nothing else."""
    pos = at.get(v, [])
    if len(pos) == 1 and pos[0] < num_grads and not readers.get(v):
      return pos[0]
    return None

  found = []
  for i, e in enumerate(compute.eqns):
    if e.primitive.name != "scan":
      continue
    length, (_, ncar) = e.params["length"], jc.scan_counts(e.params)
    for o in range(ncar, len(e.outvars)):
      y = e.outvars[o]
      whole = grad_index(y)
      if whole is not None and grad_specs is not None and any(
          a in batch_axes for a in _axes(tuple(grad_specs[whole])[:1])):
        continue
      if whole is not None:
        found.append(GradStack(i, o, (whole,), True))
        continue
      layers = _layer_slices(compute, readers, at, y, length, grad_index)
      if layers and (grad_specs is None or len({grad_specs[g] for g in layers}) == 1):
        found.append(GradStack(i, o, tuple(layers), False))
  return found


def _layer_slices(compute, readers, at, y, length, grad_index) -> list[int] | None:
  """Per layer ``k``, the gradient index of ``squeeze(slice(y, k))`` when
  those are all that reads ``y``, each layer once."""
  if not readers.get(y) or len(readers[y]) != length or at.get(y):
    return None
  layers: list[int | None] = [None] * length
  for i in readers[y]:
    e = compute.eqns[i]
    shape = y.aval.shape
    if e.primitive.name != "slice" or e.invars[0] is not y:
      return None
    start, limit = e.params["start_indices"], e.params["limit_indices"]
    strides = e.params["strides"]
    k = start[0]
    if (limit[0] != k + 1 or tuple(start[1:]) != (0,) * (len(shape) - 1) or
        tuple(limit[1:]) != tuple(shape[1:]) or
        (strides is not None and any(s != 1 for s in strides))):
      return None
    users = readers.get(e.outvars[0], [])
    if len(users) != 1 or at.get(e.outvars[0]):
      return None
    sq = compute.eqns[users[0]]
    if sq.primitive.name != "squeeze" or tuple(sq.params["dimensions"]) != (0,):
      return None
    g = grad_index(sq.outvars[0])
    if g is None or layers[k] is not None:
      return None
    layers[k] = g
  return layers if all(g is not None for g in layers) else None


def _axes(entries) -> list[str]:
  return [a for e in entries if e is not None
          for a in ((e,) if isinstance(e, str) else e)]


def folded_values(compute: Jaxpr, stacks: list[GradStack]) -> list:
  """The values of ``stacks`` that the gradient stages never hold whole:
  each stacked output, and its slices (the layers' gradients)."""
  out = []
  for s in stacks:
    y = compute.eqns[s.eqn].outvars[s.out]
    out.append(y)
    if s.whole:
      continue
    slices = {y}
    for e in compute.eqns[s.eqn + 1:]:
      x = e.invars[0] if e.invars else None
      if isinstance(x, Var) and x in slices:
        slices.update(e.outvars)
    out += sorted(slices - {y}, key=str)
  return out


def slots(num_grads: int, stacks: list[GradStack]) -> list:
  """The gradient stages' accumulators, in order: a gradient index, or a
  ``GradStack`` of sliced gradients (one stacked slot, at its first layer's
  place)."""
  owner = {}
  for s in stacks:
    if not s.whole:
      for g in s.grads:
        owner[g] = s
  out = []
  for g in range(num_grads):
    s = owner.get(g)
    if s is None:
      out.append(g)
    elif g == min(s.grads):
      out.append(s)
  return out
