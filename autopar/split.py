"""Split a traced step at the grad marker into compute_grad and apply_grad.

Stage 2 of the pipeline: :class:`~autopar.trace.TracedStep` ->
:class:`SplitStep`. With consts lifted to leading inputs, the step's jaxpr
``step(consts, leaves) -> outs`` becomes two jaxprs::

    compute_grad(consts, leaves) -> (grads, per_micro_batch_outs)
    apply_grad(consts, leaves, grads) -> apply_outs

``compute_grad`` is everything the marker's operands need plus the outputs
that depend on the batch but not on the gradients (the loss, metrics, per-
example predictions); it runs once per micro-batch. ``apply_grad`` is
everything that produces the other outputs (the new state, anything computed
from the gradients, anything that depends on neither); it runs once per
step, with the marked gradients replaced by the accumulated, averaged ones.
Both keep the full input signature so that argument positions line up.

Before / after, for ``loss, g = value_and_grad(f)(w); return w - g, loss``::

    { lambda ; w x. let                     compute_grad: { lambda ; w x. let
        l = ... w x ...                        l = ... ; g0 = ...   in (g0, l) }
        g0 = ... backward ...           ->
        g = autopar_grad g0                 apply_grad: { lambda ; w x g. let
        w2 = sub w g                           w2 = sub w g   in (w2,) }
      in (w2, l) }

How per-micro-batch outputs are combined (``OutputKind``):

* ``MEAN``: a floating-point scalar (a loss, an accuracy) is averaged over
  micro-batches and data-parallel devices. This assumes it is a mean over
  the examples of the batch, as losses almost always are.
* ``SUM``: an integer scalar (a count of correct predictions) is summed.
* ``CONCAT``: an array whose leading axis is the micro-batch axis (per-
  example values) is concatenated back into batch order.
* ``OTHER``: anything else cannot be combined; it is an error when there is
  more than one micro-batch or data-parallel device.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import NamedTuple

import numpy as np
from jax._src.interpreters import partial_eval as pe
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Var

from autopar.errors import MarkerError
from autopar.marker import grad_marker_p
from autopar.trace import TracedStep, count_markers, instantiate, instantiator

__all__ = ["OutputKind", "SplitStep", "split_step", "instantiate_split",
           "outputs_at", "reads", "depends_on"]


class OutputKind(enum.Enum):
  MEAN = "mean"
  SUM = "sum"
  CONCAT = "concat"
  OTHER = "other"
  APPLY = "apply"


@dataclasses.dataclass(frozen=True)
class SplitStep:
  """A step cut at its grad marker.

  Attributes:
    traced: the traced step this was split from.
    compute: ``compute_grad`` over ``(consts, leaves)`` returning
      ``(grads, per-micro-batch outputs)``; ``None`` when the step has no marker.
    apply: ``apply_grad`` over ``(consts, leaves, grads)`` (no grads when the
      step has no marker, in which case it is the whole step).
    consts: values of the lifted consts, in order.
    grad_names: pytree path of each gradient (from the marker).
    out_kinds: per output leaf, how it is produced and combined.
    out_index: per output leaf, its position among the compute outputs after
      the grads (for MEAN/SUM/CONCAT/OTHER) or among the apply outputs.
  """
  traced: TracedStep
  compute: ClosedJaxpr | None
  apply: ClosedJaxpr
  consts: tuple
  grad_names: tuple[str, ...]
  out_kinds: tuple[OutputKind, ...]
  out_index: tuple[int, ...]

  @property
  def has_marker(self) -> bool:
    return self.compute is not None

  @property
  def num_grads(self) -> int:
    return len(self.grad_names)

  @property
  def grad_avals(self) -> list:
    return [v.aval for v in self.compute.jaxpr.outvars[:self.num_grads]]

  @property
  def num_micro_batch_outs(self) -> int:
    return sum(k is not OutputKind.APPLY for k in self.out_kinds)

  def __str__(self) -> str:
    parts = []
    if self.compute is not None:
      parts.append(f"compute_grad:\n{self.compute}")
    parts.append(f"apply_grad:\n{self.apply}")
    return "\n".join(parts)


def _kind_of(aval, micro_batch_size: int) -> OutputKind:
  if aval.shape == ():
    if np.issubdtype(aval.dtype, np.floating):
      return OutputKind.MEAN
    if np.issubdtype(aval.dtype, np.integer):
      return OutputKind.SUM
    return OutputKind.OTHER
  if micro_batch_size and aval.shape[0] == micro_batch_size:
    return OutputKind.CONCAT
  return OutputKind.OTHER


def reads(jaxpr) -> set:
  """Top-level variables read by the equations and outputs of ``jaxpr``."""
  read = {v for e in jaxpr.eqns for v in e.invars if isinstance(v, Var)}
  read |= {v for v in jaxpr.outvars if isinstance(v, Var)}
  return read


def depends_on(jaxpr, sources, *, stop=None) -> set:
  """Variables computed (transitively) from ``sources``, ``sources`` included.

  Dependence does not flow through the equation ``stop`` (the grad marker).
  """
  dep = set(sources)
  for eqn in jaxpr.eqns:
    if eqn is not stop and any(isinstance(v, Var) and v in dep for v in eqn.invars):
      dep.update(eqn.outvars)
  return dep


def _dce(jaxpr: Jaxpr) -> Jaxpr:
  """``jaxpr`` without the equations its outputs do not need; every input
  is kept. The same as ``pe.dce_jaxpr(jaxpr, [True] * n, instantiate=True)``
  (JAX's rules prune loop and call bodies), with a faster path for the
  equations that have no rule, which are nearly all of a large step's.
  """
  rules = pe.dce_rules
  live = {v for v in jaxpr.outvars if type(v) is not Literal}
  kept = []
  for eqn in reversed(jaxpr.eqns):
    rule = rules.get(eqn.primitive)
    if rule is None:
      if any(v in live for v in eqn.outvars) or (eqn.effects and pe.has_effects(eqn)):
        kept.append(eqn)
        live.update(v for v in eqn.invars if type(v) is not Literal)
      continue
    used_ins, new = rule([v in live for v in eqn.outvars], eqn)
    if new is not None:
      kept.append(new)
    live.update(v for v, used in zip(eqn.invars, used_ins)
                if used and type(v) is not Literal)
  kept.reverse()
  return jaxpr.replace(eqns=kept, effects=pe.make_jaxpr_effects(
      jaxpr.constvars, jaxpr.invars, jaxpr.outvars, kept))


def split_step(traced: TracedStep, *, fn_name: str = "step") -> SplitStep:
  """Cuts ``traced`` at its grad marker (see the module docstring)."""
  closed = traced.jaxpr
  jaxpr = pe.convert_constvars_jaxpr(closed.jaxpr)
  nconst = len(closed.consts)
  leaf_vars = jaxpr.invars[nconst:]
  batch_vars = {v for v, l in zip(leaf_vars, traced.leaves, strict=True)
                if l.is_batch}

  total = count_markers(jaxpr)
  markers = [i for i, e in enumerate(jaxpr.eqns) if e.primitive is grad_marker_p]
  if total > 1:
    raise MarkerError(
        f"{fn_name}: the step calls autopar.grad / autopar.value_and_grad "
        f"{total} times; autopar splits the step at exactly one grad marker. "
        f"Fix: compute all gradients with one call (e.g. differentiate with "
        f"respect to a tuple of parameters) and use jax.grad for the others.")
  if total == 0:
    return SplitStep(traced=traced, compute=None,
                     apply=ClosedJaxpr(jaxpr, ()), consts=tuple(closed.consts),
                     grad_names=(), out_kinds=(OutputKind.APPLY,) * len(jaxpr.outvars),
                     out_index=tuple(range(len(jaxpr.outvars))))
  marker = jaxpr.eqns[markers[0]]

  # Forward dependence on the batch and on the (marked) gradients.
  on_batch = depends_on(jaxpr, batch_vars, stop=marker)
  on_grads = depends_on(jaxpr, marker.outvars, stop=marker)

  kinds, index = [], []
  micro_outs, apply_outs = [], []
  for path, v in zip(traced.out_paths, jaxpr.outvars, strict=True):
    if isinstance(v, Var) and v in on_grads and v in on_batch:
      raise _batch_after_marker_error(fn_name, path, traced)
    if isinstance(v, Var) and v in on_batch and v not in on_grads:
      kinds.append(_kind_of(v.aval, traced.micro_batch_size))
      index.append(len(micro_outs))
      micro_outs.append(v)
    else:
      kinds.append(OutputKind.APPLY)
      index.append(len(apply_outs))
      apply_outs.append(v)

  compute = _dce(jaxpr.replace(outvars=[*marker.invars, *micro_outs]))
  apply = _dce(jaxpr.replace(invars=[*jaxpr.invars, *marker.outvars], outvars=apply_outs,
                             eqns=[e for e in jaxpr.eqns if e is not marker]))
  used_batch = batch_vars & reads(apply)
  if used_batch:
    raise _batch_after_marker_error(fn_name, None, traced)

  names = tuple(marker.params.get("names") or
                (f"grad[{i}]" for i in range(len(marker.invars))))
  return SplitStep(traced=traced, compute=ClosedJaxpr(compute, ()),
                   apply=ClosedJaxpr(apply, ()), consts=tuple(closed.consts),
                   grad_names=names, out_kinds=tuple(kinds),
                   out_index=tuple(index))


def instantiate_split(split: SplitStep, micro_batch_size: int) -> SplitStep:
  """``split`` of a symbolic-batch trace (:func:`~autopar.trace.trace_step_any_batch`)
  at a concrete micro-batch size.

  The same as splitting the step traced at that size, without cutting it
  again: the step's jaxpr is written out at the size, and compute_grad and
  apply_grad, whose equations are the step's, reuse what that wrote.
  """
  inst = instantiator(micro_batch_size)
  traced = instantiate(split.traced, micro_batch_size, inst)
  def write(closed):
    return None if closed is None else ClosedJaxpr(inst.jaxpr(closed.jaxpr), ())
  compute, apply = write(split.compute), write(split.apply)
  avals = [v.aval for v in traced.jaxpr.jaxpr.outvars]
  return dataclasses.replace(split, traced=traced, compute=compute, apply=apply,
                             out_kinds=_kinds_at(split, avals, micro_batch_size))


class SizedOutputs(NamedTuple):
  """What the planner reads of a step's results at one batch size."""
  avals: list                       # per output leaf
  kinds: tuple                      # per output leaf, an OutputKind
  grad_avals: list                  # per gradient


def outputs_at(split: SplitStep, micro_batch_size: int) -> SizedOutputs:
  """The step's outputs and gradients at ``micro_batch_size`` rows, from
  ``split`` at that size or at a symbolic one
  (:func:`~autopar.trace.trace_step_any_batch`), without writing the step
  out at the size as :func:`instantiate_split` does."""
  outvars = split.traced.jaxpr.jaxpr.outvars
  grads = split.grad_avals if split.has_marker else []
  if split.traced.micro_batch_size == micro_batch_size:
    return SizedOutputs([v.aval for v in outvars], split.out_kinds, grads)
  inst = instantiator(micro_batch_size)
  avals = [inst.aval(v.aval) for v in outvars]
  return SizedOutputs(avals, _kinds_at(split, avals, micro_batch_size),
                      [inst.aval(a) for a in grads])


def _kinds_at(split: SplitStep, avals, micro_batch_size: int) -> tuple:
  """``split.out_kinds`` for outputs of avals ``avals``: whether an output
  is per-example depends on the size."""
  return tuple(kind if kind is OutputKind.APPLY else _kind_of(aval, micro_batch_size)
               for kind, aval in zip(split.out_kinds, avals, strict=True))


def _batch_after_marker_error(fn_name: str, path: str | None,
                              traced: TracedStep) -> MarkerError:
  what = f"output {path}" if path else "the update after the grad marker"
  batch = [l.path for l in traced.leaves if l.is_batch]
  return MarkerError(
      f"{fn_name}: {what} uses values computed from the batch "
      f"({', '.join(batch[:3])}) other than through the gradients. autopar runs "
      f"everything after autopar.grad once per step on the gradients averaged "
      f"over micro-batches, so only the gradients may carry batch data across "
      f"the marker. Fix: compute such values before the gradient call and "
      f"return them (e.g. the loss from autopar.value_and_grad), or derive "
      f"them from the gradients only.")
