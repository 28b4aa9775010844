"""Run a compiled step: the micro-batch loop.

Part of the runtime (``runtime/``). For ``n`` micro-batches one call runs::

    sums = loss_sums(leaves)                      # only if the loss needs them
    acc = compute_grad(used, sums)                # micro-batch 0 (used: the leaves it reads)
    acc = accumulate_grad(used, i, acc, sums)     # micro-batches 1 .. n-2, in place
    grads, outs = accumulate_grad_sync(used, n-1, acc, sums)     # reduce once
    new_state, ... = apply_grad(state, other, grads)       # state donated

(with the plan's ``grad_sync="apart"``: ``acc = zero_grad()``, then
``accumulate_grad`` for every micro-batch, then ``grads, outs =
sync_grad(acc)``; ``compute_grad_sync`` alone when ``n == 1``; there, unless
``one_executable=False``, one ``grad_and_apply(donated, kept, batch)``
doing all of it). ``used``: the leaves the gradient reads. ``loss_sums`` is the first pass
over the batch for the sums the loss's gradient is scaled by, such as the
token count of a mean over a padding mask (``loss.py``). Every check that can fail runs
before the first stage, and the state is donated only to the last stage, so
a call that raises leaves the caller's arrays usable.
"""

from __future__ import annotations

import dataclasses
import operator
import threading
import warnings
from typing import Any, Callable, Sequence

import jax

from autopar.errors import InputError, KeptStagesError
from autopar.backend import saved_stages
from autopar.backend.lower import ONE_STAGE, SUMS_STAGE, LoweredStep
from autopar.plan import SYNC_STAGE, ZERO_STAGE, Plan
from autopar.frontend.pytrees import partition
from autopar.frontend.trace import split_updates
from autopar.frontend.split import OutputKind, SplitStep

__all__ = ["Executable", "picker", "deleted"]


@dataclasses.dataclass(frozen=True, eq=False)
class Executable:
  """A step compiled for one input signature.

  Attributes:
    plan: the :class:`autopar.Plan` it was compiled from.
    stages: stage name -> ``jax.stages.Compiled``.
    schedule: the stage names one call runs, in order.

  ``recompile``: where the stages were loaded from disk
  (``lowered.loaded_from``), what compiles them instead should they fail
  on their first run (:meth:`_first_run`); None once they have run.
  """
  plan: Plan
  lowered: LoweredStep
  split: SplitStep
  static_argnums: tuple[int, ...]
  recompile: Callable[[], LoweredStep] | None = dataclasses.field(
      default=None, repr=False, compare=False)
  # (id of an array's sharding, leaf position) -> (that sharding, whether it
  # is the leaf's planned one): the outputs of one step share a few sharding
  # objects, so a steady-state call compares each once.
  _placed: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
  # number of the update's outputs -> picker of the step's outputs (_outputs)
  _out_pickers: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
  # held by the first run of loaded stages (_first_run)
  _first: threading.Lock = dataclasses.field(default_factory=threading.Lock, init=False,
                                             repr=False, compare=False)

  @property
  def stages(self) -> dict[str, jax.stages.Compiled]:
    return dict(self.lowered.stages)

  @property
  def schedule(self) -> list[str]:
    return list(self.lowered.schedule)

  @property
  def in_shardings(self) -> Any:
    return self.plan.input_shardings

  def memory_analysis(self) -> dict[str, Any]:
    """``Compiled.memory_analysis()`` of every stage."""
    return {name: c.memory_analysis() for name, c in self.lowered.stages.items()}

  def as_text(self) -> dict[str, str]:
    """Optimized HLO of every stage."""
    return {name: c.as_text() for name, c in self.lowered.stages.items()}

  # -- running -----------------------------------------------------------------

  def place(self, leaves: Sequence[Any]) -> list[Any]:
    """Puts each leaf on the devices with its planned sharding."""
    out = []
    placed = self._placed
    for k, (x, s) in enumerate(zip(leaves, self.lowered.in_shardings, strict=True)):
      if isinstance(x, jax.Array):
        xs = x.sharding
        if xs is s:
          out.append(x)
          continue
        seen = placed.get((id(xs), k))
        if seen is None or seen[0] is not xs:
          if len(placed) > 4 * len(leaves) + 64:
            placed.clear()
          seen = placed[(id(xs), k)] = (xs, _same_placement(x, s))
        if seen[1]:
          out.append(x)
          continue
      out.append(jax.device_put(x, s))
    return out

  @property
  def one_call(self) -> bool:
    """Whether a step is one executable taking its leaves by role
    (:meth:`run_by_role`): a step without a grad marker, or
    ``grad_and_apply``."""
    return not self.split.has_marker or self.lowered.schedule[0] == ONE_STAGE

  def run_by_role(self, donated: list, kept: list, batch: list) -> list[Any]:
    """A :attr:`one_call` step on its donated, kept and batch leaves (in
    ``lowered``'s order); returns the flat outputs. Leaves not yet on their
    planned shardings make the executable raise before it runs."""
    if not self.split.has_marker:
      return list(self.lowered.stages["step"](donated, kept, batch))
    return self._outputs(*self.lowered.stages[ONE_STAGE](donated, kept, batch))

  def run(self, leaves: Sequence[Any], *, placed: bool = True) -> list[Any]:
    """Runs one step; returns the flat outputs.

    ``placed``: the leaves are where the plan puts them (:meth:`place`).
    Else they are the caller's (a direct call, ``api._Direct``): the batch
    is placed here once for every stage, and each executable checks the
    other leaves, raising before it runs on one it does not take
    (``TypeError``, ``ValueError``); the update's leaves, refused once the
    gradient stages have run, are then placed and the update called again,
    so that the gradient is not computed twice.
    """
    if self.recompile is not None:
      return self._first_run(leaves, placed)
    return self._run(leaves, placed)

  def _first_run(self, leaves: Sequence[Any], placed: bool) -> list[Any]:
    """The first run of stages loaded from disk, waited for: an executable
    XLA cannot run (kept without some of its code: ``saved_stages``) fails
    only once its outputs are read. The stages are then compiled again and
    run where the arrays the step donates are still there, and the file
    removed once that run succeeds (an error the compiled stages raise as
    well is the step's, not the file's); where the failed run used the
    donated arrays up, the file is removed and ``KeptStagesError`` raised.
    Running out of memory and refused arguments are the step's errors."""
    with self._first:
      if self.recompile is None:          # (another thread's first run ended)
        return self._run(leaves, placed)
      key = self.lowered.loaded_from
      try:
        outs = self._run(leaves, placed)
        jax.block_until_ready(outs)
      except jax.errors.JaxRuntimeError as e:
        if str(e).startswith(("RESOURCE_EXHAUSTED", "INVALID_ARGUMENT")):
          raise
        object.__setattr__(self, "lowered", self.recompile())
        object.__setattr__(self, "recompile", None)
        what = (f"autopar: the step's compiled stages that autopar loaded from its "
                f"cache ({saved_stages.path(key)}) failed on their first run "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
        if any(deleted(leaves[k]) for k in self.lowered.donated):
          saved_stages.forget(key)
          raise KeptStagesError(
              f"{what}; the file is removed and the stages compiled again. The failed "
              f"run used up the arrays the step donates (the state passed in). Fix: "
              f"restore the state (from a checkpoint, or make it again) and call the "
              f"step again: it runs on the stages compiled now.") from e
        outs = self._run(leaves, placed)
        jax.block_until_ready(outs)
        saved_stages.forget(key)
        warnings.warn(f"{what}; they were compiled again and ran, and the file is "
                      f"removed.", stacklevel=6)
        return outs
      object.__setattr__(self, "recompile", None)
      return outs

  def run_placing(self, values: Sequence[Any]) -> list[Any]:
    """:meth:`run` on ``values`` placed (:meth:`place`). Where stages loaded
    from disk failed on their first run after using up copies of the
    donated leaves that placing made, not the caller's own arrays, they are
    placed again and run on the stages compiled since."""
    try:
      return self.run(self.place(values))
    except KeptStagesError:
      if any(deleted(values[k]) for k in self.lowered.donated):
        raise
      return self.run(self.place(values))

  def _run(self, leaves: Sequence[Any], placed: bool) -> list[Any]:
    lw = self.lowered
    stages = lw.stages
    if self.one_call:
      return self.run_by_role([leaves[k] for k in lw.donated], [leaves[k] for k in lw.kept],
                              [leaves[k] for k in lw.batch])
    if not placed:
      leaves = self._place_batch(leaves)
    sums = []
    acc = None
    i = 0                                 # the micro-batch
    used = [leaves[k] for k in lw.grad_leaves]
    for name in lw.schedule[:-1]:
      if name == SUMS_STAGE:
        sums = stages[name](leaves)
      elif name == ZERO_STAGE:
        acc = stages[name]()
      elif name == SYNC_STAGE:
        acc = stages[name](acc)
      elif acc is None:                   # compute_grad(_sync): micro-batch 0
        acc = stages[name](used, sums)
        i += 1
      else:
        acc = stages[name](used, lw.micro_batch_index[i], acc, sums)
        i += 1
    grads, micro_outs = acc
    del acc
    donated = [leaves[k] for k in lw.donated]
    try:
      apply_outs = stages["apply_grad"](donated, [leaves[k] for k in lw.kept], grads)
    except (TypeError, ValueError):
      # (A donated leaf used up: the update ran, and its error is the step's.)
      if placed or any(map(deleted, donated)):
        raise
      leaves = self.place(leaves)
      apply_outs = stages["apply_grad"]([leaves[k] for k in lw.donated],
                                        [leaves[k] for k in lw.kept], grads)
    return self._outputs(apply_outs, micro_outs)

  def _place_batch(self, leaves: Sequence[Any]) -> list[Any]:
    """``leaves`` with the batch's placed (:meth:`place`), once for the
    stages that read it."""
    leaves = list(leaves)
    for k in self.lowered.batch:
      x, s = leaves[k], self.lowered.in_shardings[k]
      if not (isinstance(x, jax.Array) and (x.sharding is s or _same_placement(x, s))):
        leaves[k] = jax.device_put(x, s)
    return leaves

  def _outputs(self, apply_outs, micro_outs) -> list[Any]:
    """The step's flat outputs from the update's and the gradient stages'."""
    both = [*apply_outs, *micro_outs]
    pick = self._out_pickers.get(len(apply_outs))
    if pick is None:
      pick = self._out_pickers[len(apply_outs)] = picker(
          [idx if kind is OutputKind.APPLY else len(apply_outs) + idx
           for kind, idx in zip(self.split.out_kinds, self.split.out_index, strict=True)])
    return pick(both)

  def results(self, outs: Sequence[Any], args: Sequence[Any]):
    """The step's result from the flat outputs of :meth:`run`: static leaves
    put back, and arguments the step changed in place (Flax NNX modules)
    updated in ``args``."""
    return split_updates(self.split.traced, self.split.traced.outputs.merge(outs), args)

  def __call__(self, *args):
    """Runs one step on the full positional arguments (static ones included)."""
    dynamic = tuple(a for i, a in enumerate(args) if i not in self.static_argnums)
    leaves, part = partition(dynamic)
    if part.key != self.split.traced.inputs.key:
      raise InputError(
          "Executable: these arguments have another structure or other static "
          "leaves than the ones it was compiled for. Fix: call the parallelized "
          "step itself (it compiles once per signature), or get_executable(*args).")
    return self.results(self.run_placing(leaves), args)


def deleted(x) -> bool:
  """Whether ``x`` is an array whose buffers are gone (donated or deleted)."""
  return isinstance(x, jax.Array) and x.is_deleted()


def picker(positions: Sequence[int]) -> Callable[[Sequence[Any]], list]:
  """``lambda xs: [xs[k] for k in positions]``, picking in C
  (``operator.itemgetter``): the per-call path of a step with thousands of
  leaves."""
  if not positions:
    return lambda xs: []
  if len(positions) == 1:
    (k,) = positions
    return lambda xs: [xs[k]]
  get = operator.itemgetter(*positions)
  return lambda xs: list(get(xs))


def _same_placement(x: jax.Array, s) -> bool:
  xs = x.sharding
  if xs == s:
    return True
  try:
    return xs.is_equivalent_to(s, x.ndim)
  except Exception:  # different device sets, memory kinds, ...
    return False
