"""Split a traced step at the grad marker into compute_grad and apply_grad.

The front end's second step (``frontend/``): :class:`~autopar.frontend.trace.TracedStep` ->
:class:`SplitStep`. With consts lifted to leading inputs, the step's jaxpr
``step(consts, leaves) -> outs`` becomes two jaxprs::

    compute_grad(consts, leaves) -> (grads, per_micro_batch_outs)
    apply_grad(consts, leaves, grads) -> apply_outs

``compute_grad`` is everything the marker's operands need plus the outputs
that depend on the batch but not on the gradients (the loss, metrics, per-
example predictions); it runs once per micro-batch. ``apply_grad`` is
everything that produces the other outputs (the new state, anything computed
from the gradients, anything that depends on neither); it runs once per
step, with the marked gradients replaced by the whole batch's (accumulated
over micro-batches, summed over devices: ``loss.py``).
Both keep the full input signature so that argument positions line up.

Before / after, for ``loss, g = value_and_grad(f)(w); return w - g, loss``::

    { lambda ; w x. let                     compute_grad: { lambda ; w x. let
        l = ... w x ...                        l = ... ; g0 = ...   in (g0, l) }
        g0 = ... backward ...           ->
        g = autopar_grad g0                 apply_grad: { lambda ; w x g. let
        w2 = sub w g                           w2 = sub w g   in (w2,) }
      in (w2, l) }

How outputs computed before the marker are combined over micro-batches and
devices (``OutputKind``), read from the program, never from a size that
happens to match (``rows.py``, ``combine.py``):

* ``CONCAT``: an output with a dimension that holds the batch's rows (per-
  example values; ``out_dims`` says which) is concatenated back into batch
  order along it.
* An output computed from reductions over the rows (a loss, an accuracy, a
  metric's running total) becomes an ``APPLY`` output: the reductions are
  accumulated like the gradients (``reduced``, after the gradients among
  compute_grad's results and apply_grad's inputs) and the output is
  computed from them once per step (``combine.py``).
* ``MEAN`` / ``SUM`` / ``MAX`` / ``MIN``: an output the caller said how to
  combine (``output_reductions``), combined so from its per-micro-batch
  values.
* ``OTHER``: anything else cannot be combined; it is an error when there is
  more than one micro-batch or data-parallel device (``why`` says what).

An output that depends on the batch's shape but not its values (say
``jnp.arange(batch.shape[0])``) is an ``apply_grad`` output, computed once
per step on the whole batch's shapes.

Effects (``jax.debug.print``, callbacks) stay where the user wrote them: one
before the marker runs with the gradient computation (once per micro-batch),
one after it with the update (once per step), never in both.
"""

from __future__ import annotations

import dataclasses
import enum
import fnmatch
from typing import Any, Mapping, NamedTuple

from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Var

from autopar import jax_compat as jc
from autopar.frontend.combine import derive
from autopar.frontend.evaluate import gather_sites
from autopar.errors import InputError, MarkerError
from autopar.frontend.hints import HINT_PRIMITIVES, Hint, find_hints
from autopar.frontend.loss import (LOSS_KEY, LossGradient, cotangents, expand, find_head,
                          inline_loss)
from autopar.frontend.marker import grad_marker_p, value_marker_p
from autopar.frontend.retype import without_meshes
from autopar.frontend.rng import DRAW_PRIMITIVES, RowDraw, find_draws
from autopar.frontend.rows import RowDim, RowOracle, mixing_of
from autopar.frontend.trace import (TracedStep, count_markers, eqns_by_path, inline_calls,
                           inline_loss_rules, instantiate, instantiator)

__all__ = ["MIXED", "OutputKind", "SplitStep", "split_step", "instantiate_split",
           "outputs_at", "reads", "depends_on", "dce", "apply_at", "scale_at",
           "leaves_read_by_compute", "leaf_gather_sites", "BY_DEVICE", "disagreement"]


# How ``SplitStep.why`` starts for an output whose rows mix.
MIXED = "its rows mix on the way"


class OutputKind(enum.Enum):
  MEAN = "mean"
  SUM = "sum"
  MAX = "max"
  MIN = "min"
  CONCAT = "concat"
  OTHER = "other"
  APPLY = "apply"


# How the outputs the caller said how to combine are combined over devices.
BY_DEVICE = {OutputKind.MEAN: "mean", OutputKind.SUM: "sum", OutputKind.MAX: "max",
             OutputKind.MIN: "min"}


_BY_USER = {"mean": OutputKind.MEAN, "sum": OutputKind.SUM, "max": OutputKind.MAX,
            "min": OutputKind.MIN}


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
    out_kinds: per output leaf, how it is produced and combined (read from
      a symbolic trace, or from two traces: ``split_step(reference=...)``).
    out_index: per output leaf, its position among the compute outputs after
      the grads (for MEAN/SUM/CONCAT/OTHER) or among the apply outputs.
    out_dims: per output leaf, the dimension that holds the batch's rows
      (``rows.RowDim``), or None; CONCAT outputs are concatenated along it.
    draws: random draws of ``compute`` whose shape holds the batch's rows,
      by equation path (``rng.py``); None when not known (a step traced at
      one concrete size, with no reference).
    hints: the user's sharding hints in ``compute`` and ``apply``
      (``hints.py``).
    reduced: how each reduction over the rows that ``apply`` computes
      outputs from is combined ("sum", "max", "min", or "mean" where the
      caller said so); they follow the gradients among ``compute``'s
      results and ``apply``'s inputs.
    why: per output that cannot be combined (``OTHER``), the reason.
    loss: how the gradient stages seed the loss's cotangents (``loss.py``);
      None for a step without a loss function's call.
    raw: the step as traced, before its loss function was differentiated
      (``traced`` is after): what another trace is compared with.
  """
  traced: TracedStep
  compute: ClosedJaxpr | None
  apply: ClosedJaxpr
  consts: tuple
  grad_names: tuple[str, ...]
  out_kinds: tuple[OutputKind, ...]
  out_index: tuple[int, ...]
  out_dims: tuple[RowDim | None, ...] = ()
  draws: dict[str, RowDraw] | None = None
  hints: tuple[Hint, ...] = ()
  reduced: tuple[str, ...] = ()
  why: Mapping[int, str] = dataclasses.field(default_factory=dict)
  loss: LossGradient | None = None
  raw: TracedStep | None = None

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
  def reduced_avals(self) -> list:
    n = self.num_grads
    return [v.aval for v in self.compute.jaxpr.outvars[n:n + len(self.reduced)]]

  @property
  def num_micro_batch_outs(self) -> int:
    return sum(k is not OutputKind.APPLY for k in self.out_kinds)

  def __str__(self) -> str:
    parts = []
    if self.compute is not None:
      parts.append(f"compute_grad:\n{self.compute}")
    parts.append(f"apply_grad:\n{self.apply}")
    return "\n".join(parts)


def reads(jaxpr) -> set:
  """Top-level variables read by the equations and outputs of ``jaxpr``."""
  read = {v for e in jaxpr.eqns for v in e.invars if isinstance(v, Var)}
  read |= {v for v in jaxpr.outvars if isinstance(v, Var)}
  return read


def depends_on(jaxpr, sources, *, stop=None) -> set:
  """Variables computed (transitively) from ``sources``, ``sources`` included.

  Dependence does not flow through the equation ``stop`` (the grad marker).
  Through a call (``jax.checkpoint``, a nested ``jit``) it is read from the
  call's body, output by output: nnx.remat's call of a layer returns the
  layer's parameters unchanged beside its activations, and they depend on
  the parameters alone.
  """
  dep = set(sources)
  for eqn in jaxpr.eqns:
    if eqn is stop:
      continue
    reads = [isinstance(v, Var) and v in dep for v in eqn.invars]
    if not any(reads):
      continue
    body = _call_body(eqn)
    if body is None:
      dep.update(eqn.outvars)
      continue
    inner = depends_on(body, {b for b, r in zip(body.invars, reads) if r})
    dep.update(o for o, b in zip(eqn.outvars, body.outvars)
               if isinstance(b, Var) and b in inner)
  return dep


def _call_body(eqn):
  """The body of a call equation whose inputs and outputs are its body's
  one to one (``remat2``, ``pjit``, ``closed_call``), or None."""
  p = eqn.params
  body = {"remat2": p.get("jaxpr"), "pjit": p.get("jaxpr"), "jit": p.get("jaxpr"),
          "closed_call": p.get("call_jaxpr"), "core_call": p.get("call_jaxpr")
          }.get(eqn.primitive.name)
  body = getattr(body, "jaxpr", body)
  if body is None or len(body.invars) != len(eqn.invars) or \
      len(body.outvars) != len(eqn.outvars):
    return None
  return body


def dce(jaxpr: Jaxpr, keep=None) -> Jaxpr:
  """``jaxpr`` without the equations its outputs do not need (and those
  ``keep(eqn)`` holds for, such as markers with no outputs); every input
  is kept. The same as ``jc.dce_jaxpr(jaxpr, [True] * n, instantiate=True)``
  (JAX's rules prune loop and call bodies), with a faster path for the
  equations that have no rule, which are nearly all of a large step's.
  """
  live = {v for v in jaxpr.outvars if type(v) is not Literal}
  kept = []
  for eqn in reversed(jaxpr.eqns):
    if keep is not None and keep(eqn):
      kept.append(eqn)
      continue
    rule = jc.dce_rule(eqn.primitive)
    if rule is None:
      if any(v in live for v in eqn.outvars) or (eqn.effects and jc.has_effects(eqn)):
        kept.append(eqn)
        live.update(v for v in eqn.invars if type(v) is not Literal)
      continue
    used_ins, new = rule([v in live for v in eqn.outvars], eqn)
    if new is not None:
      kept.append(new)
    live.update(v for v, used in zip(eqn.invars, used_ins)
                if used and type(v) is not Literal)
  kept.reverse()
  return jaxpr.replace(eqns=kept, effects=jc.make_jaxpr_effects(
      jaxpr.constvars, jaxpr.invars, jaxpr.outvars, kept))


def split_step(traced: TracedStep, *, fn_name: str = "step",
               reference: TracedStep | None = None,
               output_reductions: Mapping[str, str] | None = None,
               remat: Any = "none", remat_loop: str = "scan",
               pipeline: bool = False, keep_rules: bool = False) -> SplitStep:
  """Cuts ``traced`` at its grad marker (see the module docstring).

  Which dimensions hold rows is read from ``traced`` itself when it was
  traced at a symbolic batch size, else by comparing it with ``reference``,
  the step traced at another size; with neither (one device, one
  micro-batch, where it does not matter) outputs without rows are ``OTHER``.
  ``output_reductions``: output path (or glob) -> "sum" / "mean" / "max" /
  "min", for outputs the program does not say how to combine; its key
  ``"loss"``: how to combine the loss itself (``loss.py``). ``remat``: the
  method's, applied where the loss function is differentiated, its layers
  in a ``remat_loop`` (``remat.layer_loop``). ``pipeline``: the loss function
  inlined, not differentiated; its custom derivative rules inlined too
  (each stage differentiates its primal equations) unless ``keep_rules``
  (the step traced at a concrete size, where a stage keeps the rule's call).
  """
  how = _loss_how(output_reductions)
  raw = traced
  traced, reference, loss_grad = _differentiate(traced, reference, fn_name, how, remat,
                                                remat_loop, pipeline, keep_rules)
  closed = traced.jaxpr
  jaxpr = jc.convert_constvars_jaxpr(closed.jaxpr)
  nconst = len(closed.consts)
  leaf_vars = jaxpr.invars[nconst:]
  batch_vars = {v for v, l in zip(leaf_vars, traced.leaves, strict=True)
                if l.is_batch}

  total = count_markers(jaxpr)
  markers = [i for i, e in enumerate(jaxpr.eqns) if e.primitive is grad_marker_p]
  if total == 1 and loss_grad is None:
    raise MarkerError(
        f"{fn_name}: the gradients are marked for autopar (autopar.mark_gradients) "
        f"but not computed by autopar.value_and_grad / autopar.grad, so autopar "
        f"cannot tell how the loss combines over micro-batches and devices. Fix: "
        f"compute them with autopar.value_and_grad.")
  if total > 1:
    raise MarkerError(
        f"{fn_name}: the step calls autopar.grad / autopar.value_and_grad "
        f"{total} times; autopar splits the step at exactly one grad marker. "
        f"Fix: compute all gradients with one call (e.g. differentiate with "
        f"respect to a tuple of parameters) and use jax.grad for the others.")
  oracle = _oracle(traced, jaxpr, reference)
  known = oracle is not None
  def dims(v):
    return oracle.dims(v) if known else None
  out_dims = tuple(_one(dims(v)) for v in jaxpr.outvars)
  if total == 0:
    return SplitStep(traced=traced, compute=None,
                     apply=ClosedJaxpr(jaxpr, ()), consts=tuple(closed.consts),
                     grad_names=(), out_kinds=(OutputKind.APPLY,) * len(jaxpr.outvars),
                     out_index=tuple(range(len(jaxpr.outvars))), out_dims=out_dims,
                     draws={}, hints=_hints(None, jaxpr, oracle), raw=raw)
  at = markers[0]
  marker = jaxpr.eqns[at]

  # Forward dependence on the batch and on the (marked) gradients.
  on_batch = depends_on(jaxpr, batch_vars, stop=marker)
  on_grads = depends_on(jaxpr, marker.outvars, stop=marker)

  by_user = _by_user(output_reductions, traced.out_paths)
  if how is not None:
    # Outputs that are the loss itself combine as the caller said it does.
    values = {v for e in jaxpr.eqns if e.primitive is value_marker_p for v in e.outvars}
    by_user.update({j: _BY_USER[how] for j, v in enumerate(jaxpr.outvars)
                    if isinstance(v, Var) and v in values and j not in by_user})
  kinds: list = []
  why: dict[int, str] = {}
  candidates = []                 # outputs to derive from reductions over the rows
  for j, (path, v) in enumerate(zip(traced.out_paths, jaxpr.outvars, strict=True)):
    if isinstance(v, Var) and v in on_grads and v in on_batch:
      raise _batch_after_marker_error(fn_name, path, traced)
    d = dims(v)
    if not (isinstance(v, Var) and v in on_batch and v not in on_grads):
      kinds.append(OutputKind.APPLY)
    elif out_dims[j] is not None:
      kinds.append(OutputKind.CONCAT)
    elif j in by_user:
      kinds.append(by_user[j])
    elif d is not None and len(d) > 1:
      kinds.append(OutputKind.OTHER)
      why[j] = "it holds the batch's rows in more than one dimension"
    else:
      kinds.append(None)
      candidates.append(j)
  derivation = derive(jaxpr, candidates, on_batch, dims)
  why.update(derivation.failures)
  for j in candidates:
    kinds[j] = OutputKind.APPLY if j in derivation.derived else OutputKind.OTHER
  # An output whose rows mix (a per-example value minus the batch's mean)
  # cannot be combined from the groups' values either.
  if known:
    mixed = mixing_of(jaxpr, {j: [jaxpr.outvars[j]] for j, k in enumerate(kinds)
                              if k is OutputKind.CONCAT or j in derivation.derived},
                      batch=batch_vars, oracle=oracle)
    for j, what in mixed.items():
      kinds[j] = OutputKind.OTHER
      why[j] = f"{MIXED}: {what}; or run with num_micro_batches=1 and the batch " \
               f"whole (ShardParallel keeps it so by itself)"
    derivation = derive(jaxpr, [j for j in candidates if j not in mixed], on_batch, dims)
  reduced = [v for v, _ in derivation.reduced]
  made = set(reduced)
  makers = {id(e) for e in jaxpr.eqns if any(v in made for v in e.outvars)}

  index, micro_outs, apply_outs = [], [], []
  for kind, v in zip(kinds, jaxpr.outvars, strict=True):
    if kind is OutputKind.APPLY:
      index.append(len(apply_outs))
      apply_outs.append(v)
    else:
      index.append(len(micro_outs))
      micro_outs.append(v)

  # An effect runs in the stage on its side of the marker, once.
  effects = [i for i, e in enumerate(jaxpr.eqns) if e.effects and jc.has_effects(e)]
  after = {i for i in effects if i > at}
  compute = dce(jaxpr.replace(outvars=[*marker.invars, *reduced, *micro_outs],
                               eqns=[e for i, e in enumerate(jaxpr.eqns) if i not in after]))
  # apply_grad takes the reductions as inputs, as it takes the gradients:
  # what made them (over the rows) is not in it.
  apply = dce(jaxpr.replace(
      invars=[*jaxpr.invars, *marker.outvars, *reduced], outvars=apply_outs,
      eqns=[e for i, e in enumerate(jaxpr.eqns)
            if e is not marker and id(e) not in makers and (i > at or i not in effects)]))
  used_batch = batch_vars & reads(apply)
  if used_batch:
    raise _batch_after_marker_error(fn_name, None, traced)

  names = tuple(marker.params.get("names") or
                (f"grad[{i}]" for i in range(len(marker.invars))))
  draws = find_draws(eqns_by_path(compute), oracle) if known else None
  return SplitStep(traced=traced, compute=ClosedJaxpr(compute, ()),
                   apply=ClosedJaxpr(apply, ()), consts=tuple(closed.consts),
                   grad_names=names, out_kinds=tuple(kinds),
                   out_index=tuple(index), out_dims=out_dims, draws=draws,
                   hints=_hints(compute, apply, oracle),
                   reduced=tuple(op for _, op in derivation.reduced), why=why,
                   loss=loss_grad, raw=raw)


def _loss_how(output_reductions) -> str | None:
  """``output_reductions["loss"]``: how the caller says the loss combines."""
  how = (output_reductions or {}).get(LOSS_KEY)
  if how is not None and how not in ("mean", "sum"):
    raise InputError(f"output_reductions[{LOSS_KEY!r}] = {how!r}; the loss combines "
                     f"as a 'mean' (each device's and micro-batch's loss and gradient "
                     f"averaged) or a 'sum'.")
  return how


def _differentiate(traced: TracedStep, reference: TracedStep | None, fn_name: str,
                   how: str | None, remat, remat_loop: str = "scan",
                   pipeline: bool = False, keep_rules: bool = False) -> tuple:
  """``traced`` (and ``reference``, the same step at another size) with the
  loss function differentiated as the whole batch's (``loss.py``), and how
  the gradient stages seed it; as they are, with None, for a step without
  a loss function's call. For a pipeline, the loss function is inlined and
  not differentiated: the pipeline differentiates each stage itself."""
  rules = ((lambda c: inline_loss_rules(c, fn_name=fn_name)) if pipeline and not keep_rules
           else (lambda c: c))
  view, call = inline_loss(rules(traced.jaxpr), fn_name)
  if call is None:
    return traced, reference, None
  ref_view = ref_call = None
  if reference is not None:
    ref_view, ref_call = inline_loss(rules(reference.jaxpr), fn_name)
    if ref_call is None:
      ref_view = None
  if jc.is_symbolic_dim(traced.micro_batch_size):
    oracles = (RowOracle.symbolic(), None)
  elif ref_view is not None:
    a, b = traced.micro_batch_size, reference.micro_batch_size
    oracles = (RowOracle.paired(view.jaxpr, ref_view.jaxpr, a, b),
               RowOracle.paired(ref_view.jaxpr, view.jaxpr, b, a))
  else:
    oracles = (None, None)

  def differentiated(t: TracedStep, v: ClosedJaxpr, c, oracle):
    batch = {x for x, l in zip(v.jaxpr.invars, t.leaves, strict=True) if l.is_batch}
    head = find_head(v, c, batch=batch, oracle=oracle, how=how)
    closed, grad = expand(v, c, head, remat=remat, remat_loop=remat_loop, how=how)
    closed = without_meshes(inline_calls(closed, fn_name=fn_name))
    return dataclasses.replace(t, jaxpr=closed), grad

  if pipeline:
    batch = {x for x, l in zip(view.jaxpr.invars, traced.leaves, strict=True) if l.is_batch}
    head = find_head(view, call, batch=batch, oracle=oracles[0], how=how)
    grad = cotangents(view, call, head, how).gradient(head, call, how, with_values=True)
    if ref_view is not None:
      reference = dataclasses.replace(reference, jaxpr=ref_view)
    return dataclasses.replace(traced, jaxpr=view), reference, grad
  traced, grad = differentiated(traced, view, call, oracles[0])
  if ref_view is not None:
    reference, _ = differentiated(reference, ref_view, ref_call, oracles[1])
  return traced, reference, grad


def _one(dims):
  """The one row dimension, or None (none, several, or not known)."""
  return dims[0] if dims is not None and len(dims) == 1 else None


def _oracle(traced: TracedStep, jaxpr, reference: TracedStep | None):
  """How to tell the row dimensions of ``jaxpr``'s values (``rows.py``)."""
  if jc.is_symbolic_dim(traced.micro_batch_size):
    return RowOracle.symbolic()
  if reference is None:
    return None
  if reference.micro_batch_size == traced.micro_batch_size:
    raise ValueError("the reference trace must be at another batch size")
  return RowOracle.paired(jaxpr, jc.convert_constvars_jaxpr(reference.jaxpr.jaxpr),
                          traced.micro_batch_size, reference.micro_batch_size)


def _by_user(output_reductions, out_paths) -> dict[int, OutputKind]:
  """Output position -> the kind ``output_reductions`` gives it."""
  out = {}
  for pattern, how in (output_reductions or {}).items():
    if pattern == LOSS_KEY:
      continue
    if how not in _BY_USER:
      raise InputError(f"output_reductions[{pattern!r}] = {how!r}; expected one of "
                       f"{tuple(_BY_USER)}.")
    hits = [j for j, p in enumerate(out_paths) if p == pattern or
            fnmatch.fnmatchcase(p, pattern)]
    if not hits:
      raise InputError(f"output_reductions: {pattern!r} names no output of the step; "
                       f"its outputs are {', '.join(out_paths)}.")
    for j in hits:
      out[j] = _BY_USER[how]
  return out


def _hints(compute, apply, oracle) -> tuple[Hint, ...]:
  """The sharding hints of both parts, those of ``compute`` with their row
  dimensions."""
  out = []
  if compute is not None:
    out.extend(find_hints("compute", eqns_by_path(compute), oracle).values())
  if apply is not None:
    out.extend(find_hints("apply", eqns_by_path(apply)).values())
  return tuple(out)


def _in_order(a, b, primitives) -> list | None:
  """(path, equation of ``a``, the same-numbered one of ``b``) for the
  equations of ``primitives``, or None if the two have not the same ones."""
  ea = [(p, e) for p, e in eqns_by_path(a) if e.primitive.name in primitives]
  eb = [e for _, e in eqns_by_path(b) if e.primitive.name in primitives]
  if [e.primitive for _, e in ea] != [e.primitive for e in eb]:
    return None
  return [(p, e, f) for (p, e), f in zip(ea, eb)]


def instantiate_split(split: SplitStep, micro_batch_size: int) -> SplitStep:
  """``split`` of a symbolic-batch trace (:func:`~autopar.frontend.trace.trace_step_any_batch`)
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
  # Writing out drops the symbolic equations (dim_as_value), which renumbers
  # the ones after them: the draws and hints are found again by their order.
  draws = split.draws
  if draws and compute is not None:
    draws = {new: draws[old] for old, new in renumbered(
        split.compute.jaxpr, compute.jaxpr, DRAW_PRIMITIVES) if old in draws}
  hints = []
  for part, old_j, new_j in (("compute", split.compute, compute),
                             ("apply", split.apply, apply)):
    mine = {h.path: h for h in split.hints if h.part == part}
    if mine:
      hints += [dataclasses.replace(mine[old], path=new) for old, new in
                renumbered(old_j.jaxpr, new_j.jaxpr, HINT_PRIMITIVES) if old in mine]
  return dataclasses.replace(split, traced=traced, compute=compute, apply=apply,
                             draws=draws, hints=tuple(hints))


def renumbered(old, new, primitives) -> list[tuple[str, str]]:
  """(path in ``old``, path in ``new``) of the equations of ``primitives``,
  matched in order (``new`` is ``old`` written out at a concrete size)."""
  pairs = _in_order(old, new, primitives)
  assert pairs is not None, "writing a jaxpr out changed its equations"
  index = {id(e): p for p, e in eqns_by_path(new) if e.primitive.name in primitives}
  return [(p, index[id(f)]) for p, _, f in pairs]


def apply_at(split: SplitStep, rows: int) -> ClosedJaxpr:
  """``split.apply`` (from a symbolic-batch trace) written out at ``rows``
  (the whole batch's: apply_grad runs once per step, on its shapes)."""
  if not jc.is_symbolic_dim(split.traced.micro_batch_size):
    assert split.traced.micro_batch_size == rows, (split.traced.micro_batch_size, rows)
    return split.apply
  return ClosedJaxpr(instantiator(rows).jaxpr(split.apply.jaxpr), ())


def scale_at(split: SplitStep, rows: int) -> ClosedJaxpr:
  """``split.loss.scale`` (the loss's cotangents from the sums) at the
  whole batch's ``rows``: a stage seeds each group with the whole batch's."""
  scale = split.loss.scale
  if not jc.is_symbolic_dim(split.traced.micro_batch_size):
    assert split.traced.micro_batch_size == rows, (split.traced.micro_batch_size, rows)
    return scale
  return ClosedJaxpr(instantiator(rows).jaxpr(scale.jaxpr), scale.consts)


class SizedOutputs(NamedTuple):
  """What the planner reads of a step's results at one batch size."""
  avals: list                       # per output leaf
  kinds: tuple                      # per output leaf, an OutputKind
  grad_avals: list                  # per gradient


def outputs_at(split: SplitStep, micro_batch_size: int) -> SizedOutputs:
  """The step's outputs and gradients at ``micro_batch_size`` rows, from
  ``split`` at that size or at a symbolic one
  (:func:`~autopar.frontend.trace.trace_step_any_batch`), without writing the step
  out at the size as :func:`instantiate_split` does."""
  outvars = split.traced.jaxpr.jaxpr.outvars
  grads = split.grad_avals if split.has_marker else []
  if split.traced.micro_batch_size == micro_batch_size:
    return SizedOutputs([v.aval for v in outvars], split.out_kinds, grads)
  inst = instantiator(micro_batch_size)
  return SizedOutputs([inst.aval(v.aval) for v in outvars], split.out_kinds,
                      [inst.aval(a) for a in grads])


# How an output of each kind is combined, for messages.
_COMBINED = {OutputKind.APPLY: "computed once a step (from reductions over the rows, "
                               "or by the update)",
             OutputKind.CONCAT: "concatenated along its rows",
             OutputKind.OTHER: "not combinable",
             **{k: f"combined as a {how}" for k, how in BY_DEVICE.items()}}


def disagreement(a: SplitStep, b: SplitStep) -> str:
  """"" if ``a`` and ``b``, one step traced and split at two concrete batch
  sizes, are split alike: the same gradients, reductions over the rows,
  outputs combined the same way along the same dimensions, and the loss
  seeded from the same sums. Else the first difference, for a message.

  The stages are built from splits at several sizes (a device's rows of a
  micro-batch, the micro-batch, the whole batch) that must line up; traced
  at a symbolic size they do by construction, traced at concrete sizes only
  where the program and what ``rows.py`` reads from it agree."""
  sa, sb = a.traced.micro_batch_size, b.traced.micro_batch_size
  if a.grad_names != b.grad_names:
    return (f"the gradients are {len(a.grad_names)} at {sa} rows and "
            f"{len(b.grad_names)} at {sb}")
  for j, (path, ka, kb) in enumerate(zip(a.traced.out_paths, a.out_kinds, b.out_kinds,
                                         strict=True)):
    if ka is not kb:
      why = a.why.get(j) or b.why.get(j)
      return (f"output {path} is {_COMBINED[ka]} at {sa} rows but {_COMBINED[kb]} "
              f"at {sb}" + (f": {why}" if why else ""))
    da, db = a.out_dims[j], b.out_dims[j]
    if ka is OutputKind.CONCAT and da != db:
      return (f"output {path} holds the batch's rows in dimension {da.dim} at {sa} "
              f"rows but in dimension {db.dim} at {sb}")
  if a.reduced != b.reduced:
    return (f"the outputs are computed from reductions over the rows "
            f"{list(a.reduced)} at {sa} rows but {list(b.reduced)} at {sb}")
  la, lb = a.loss, b.loss
  if (la is None) != (lb is None) or la is not None and (
      (la.kinds, la.sum_ops) != (lb.kinds, lb.sum_ops)):
    what = lambda loss: ("no loss function" if loss is None else   # noqa: E731
                         f"cotangents {list(loss.kinds)} from sums {list(loss.sum_ops)}")
    return (f"the loss's gradient is seeded with {what(la)} at {sa} rows but with "
            f"{what(lb)} at {sb}")
  return ""


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


def leaves_read_by_compute(split: SplitStep) -> set[int]:
  """Indices of the leaves that ``compute_grad`` reads."""
  if split.compute is None:
    return set()
  jaxpr = split.compute.jaxpr
  read = reads(jaxpr)
  return {k for k, v in enumerate(jaxpr.invars[len(split.consts):]) if v in read}


def leaf_gather_sites(split: SplitStep) -> dict[int, int]:
  """Per leaf ``compute_grad`` reads: how many all-gathers of it the pass
  makes where the plan stores it split over the batch axes (ZeRO-3: one
  for each reader, ``evaluate.gather_sites``)."""
  if split.compute is None:
    return {}
  jaxpr = split.compute.jaxpr
  leaves = jaxpr.invars[len(split.consts):]
  sites = gather_sites(jaxpr, leaves)
  return {k: sites[v] for k, v in enumerate(leaves) if v in sites}
