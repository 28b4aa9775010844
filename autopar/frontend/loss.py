"""The loss's gradient as the whole batch's, whatever the split.

autopar runs the loss function on each device's rows of each micro-batch
(a *group* of rows; ``G`` groups in all). On one device the loss ``L`` is
computed from the whole batch; what each group computes alone is a
different function when ``L`` is not a plain sum of per-group terms: a token
mean ``sum(nll * mask) / sum(mask)`` over a group is its own tokens' mean,
and the mean of the groups' means is the whole batch's only when every group
has as many tokens. So autopar never differentiates a group's loss. It
reads from the program how ``L`` is made of the rows:

    L = head(R, H)

* ``R``: *reductions over the rows* (``combine.reduction_of``: a sum, max or
  min over dimensions that hold the batch's rows, a ``dot_general`` that
  contracts them), each combined over groups as it reduces;
* ``H``: values that depend neither on the batch's values nor on its size
  (a weight-decay term, a temperature parameter);
* ``head``: what the program computes from them (the division, the sum of a
  loss and an auxiliary loss, a constant factor).

By the chain rule, with ``R = sum_g R_g`` over groups ``g``,

    dL/dθ = Σ_g [ Σ_i c_i · dR_gi/dθ  +  Σ_j (c_j / G) · dH_j/dθ ],
    (c_R, c_H) = ∂head/∂(R, H) at the whole batch's R, times the seed,

so each group differentiates its own ``R_g`` and ``H`` (the *entries*: the
ones that depend on the parameters θ) with the cotangents ``c`` of the whole
batch, and the gradients are *summed* over groups. ``c`` is a function
``C(S, H, seed)`` of the sums ``S ⊆ R`` it reads: none for a sum or a mean
over rows (``1``, ``1/rows``: the batch's size is a constant of the whole
batch's program), the mask's sum for a token mean, and for a loss that is
a nonlinear function of parameter-dependent sums (a ratio of two of them)
those sums, which then need a forward pass of their own. A first pass over
the whole batch (``lower.py``'s ``loss_sums`` stage) computes ``S`` when
``C`` reads any. A group with no valid rows contributes zero, never a NaN:
its own ``L_g`` (``0 / 0``) is never used.

The pieces, in the order ``split.py`` uses them:

1. :func:`inline_loss`: the step is traced with the loss function as one
   call (``frontend/capture.py``: ``autopar_forward[F]`` and
   ``autopar_backward[F]``). The forward call is replaced by ``F``'s
   equations, its inputs bound by ``autopar_loss_input`` equations (so ``F``'s
   variables stay apart from the step's): the *view* the analyses read.
2. :func:`find_head`: ``R``, ``H`` and ``head``, walking back from ``L``
   through the view (across ``F``'s inputs into the step: a mask sum taken
   before the loss function and closed over is found too), and the checks
   that the step's rows stay apart (:func:`row_mixing`).
3. :func:`expand` (SPMD methods): the view with the loss function
   differentiated as the whole batch's::

       { ... l = autopar_forward[F] w x ...        { ... R, H, res = <F's forward, with its VJP's
             g = autopar_backward[F] w x 1.0  ->             residuals; remat'd per the method>
         in (g, l) }                                  l = head(R, H) ...
                                                      c = autopar_loss_cotangent ∂head·1.0 ; S H 1.0
                                                      g = <F's backward from c>
                                                    in (g, l) }

   ``autopar_loss_cotangent`` is the identity (a plain ``jax.jit`` of the
   jaxpr gives one device's numbers); a gradient stage evaluates it as ``C``
   on the whole batch's ``S`` (``LossGradient.scale``), over ``G`` for the
   ``H`` entries. The pipeline (``frontend/program.py``) instead makes the
   entries the seeded outputs of its forward program.

Where the loss cannot be derived (rows read other than through reductions,
rows autopar cannot tell) the entries are the loss itself, seeded with
``1/G`` as each group's mean: right with one group, and an
:class:`~autopar.InputError` with more, unless
``output_reductions={"loss": "mean" | "sum"}`` says so.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Primitive, Var
from autopar import jax_compat as jc
from autopar.jax_compat import mlir

from autopar.frontend.combine import reduction_of
from autopar.errors import InputError, MarkerError
from autopar.frontend.capture import backward_p, forward_p
from autopar.frontend.remat import called_eval, rolled_eval
from autopar.frontend.retype import jaxprs_in
from autopar.frontend.rows import RowOracle, depends, row_mixing, where

__all__ = ["loss_input_p", "loss_cotangent_p", "LossCall", "LossHead", "LossGradient",
           "LossValues", "inline_loss", "find_head", "cotangents", "expand",
           "check_loss", "LOSS_KEY",
           "WHOLE", "SHARE"]

# The key of output_reductions= that says how to combine the loss itself.
LOSS_KEY = "loss"
WHOLE, SHARE = "whole", "share"


# -- primitives --------------------------------------------------------------------

loss_input_p = Primitive("autopar_loss_input")
loss_input_p.def_impl(lambda x, *, diff: x)
loss_input_p.def_abstract_eval(lambda aval, *, diff: aval)
mlir.register_lowering(loss_input_p, mlir.lower_fun(lambda x, *, diff: x,
                                                    multiple_results=False))

loss_cotangent_p = Primitive("autopar_loss_cotangent")
loss_cotangent_p.multiple_results = True


def _cotangent_impl(*args, kinds, sum_ops, num_inputs, num_seeds):
  del sum_ops, num_inputs, num_seeds
  return args[:len(kinds)]


loss_cotangent_p.def_impl(_cotangent_impl)
loss_cotangent_p.def_abstract_eval(
    lambda *avals, kinds, sum_ops, num_inputs, num_seeds: list(avals[:len(kinds)]))
mlir.register_lowering(loss_cotangent_p,
                       mlir.lower_fun(_cotangent_impl, multiple_results=True))


# -- the loss function's call --------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LossCall:
  """Where the loss function sits in the view (:func:`inline_loss`).

  Attributes:
    start, stop: the view's equations ``[start, stop)`` are ``F``'s: its
      input bindings, then its own equations.
    backward: the index of the ``autopar_backward`` equation.
    fn: ``F`` (its inputs are the loss function's operands).
    name: the loss function's name.
    diff: per input of ``F``, whether it is differentiated.
    seeded: the outputs of ``F`` given a cotangent (the loss).
    consts: the values of ``fn``'s constvars (of calls inlined into it).
  """
  start: int
  stop: int
  backward: int
  fn: Jaxpr
  name: str
  diff: tuple[bool, ...]
  seeded: tuple[int, ...]
  consts: tuple = ()

  @property
  def seeds(self) -> int:
    return len(self.seeded)


def inline_loss(closed: ClosedJaxpr, fn_name: str) -> tuple[ClosedJaxpr, LossCall | None]:
  """The view of a step traced with its loss function captured: the
  ``autopar_forward`` call replaced by ``F``'s equations (see the module
  docstring); the step as it is if it has no such call."""
  jaxpr = closed.jaxpr
  fwd = [i for i, e in enumerate(jaxpr.eqns) if e.primitive is forward_p]
  bwd = [i for i, e in enumerate(jaxpr.eqns) if e.primitive is backward_p]
  if not fwd and not bwd:
    return closed, None
  if len(fwd) != 1 or len(bwd) != 1:
    raise MarkerError(
        f"{fn_name}: the step calls autopar.grad / autopar.value_and_grad "
        f"{max(len(fwd), len(bwd))} times; autopar splits the step at exactly one "
        f"grad marker. Fix: compute all gradients with one call (e.g. differentiate "
        f"with respect to a tuple of parameters) and use jax.grad for the others.")
  a, b = fwd[0], bwd[0]
  ef, eb = jaxpr.eqns[a], jaxpr.eqns[b]
  F: ClosedJaxpr = ef.params["jaxpr"]
  diff, outd, cmask = eb.params["diff"], eb.params["outd"], eb.params["cmask"]
  nin = len(diff)
  if b < a or len(ef.invars) != nin or any(
      not (x is y or isinstance(x, Literal) and isinstance(y, Literal))
      for x, y in zip(ef.invars, eb.invars[:nin])):
    raise MarkerError(f"{fn_name}: the loss function's backward pass reads other "
                      f"values than its forward pass; autopar cannot derive its "
                      f"gradient.")
  fn = F.jaxpr
  douts = [j for j, m in enumerate(outd) if m]
  seeded = tuple(douts[k] for k, m in enumerate(cmask) if m)
  env: dict = {}
  eqns = list(jaxpr.eqns[:a])
  for p, (fv, u) in enumerate(zip(fn.invars, ef.invars, strict=True)):
    eqns.append(ef.replace(primitive=loss_input_p, invars=[u], outvars=[fv],
                           params={"diff": bool(diff[p])}, effects=frozenset()))
  eqns.extend(fn.eqns)
  stop = len(eqns)
  for o, fo in zip(ef.outvars, fn.outvars, strict=True):
    env[o] = fo
  read = lambda v: v if isinstance(v, Literal) else env.get(v, v)
  for eqn in jaxpr.eqns[a + 1:]:
    if any(not isinstance(v, Literal) and v in env for v in eqn.invars):
      eqn = eqn.replace(invars=[read(v) for v in eqn.invars])
    eqns.append(eqn)
  outvars = [read(v) for v in jaxpr.outvars]
  # (Constants of calls inlined into F are the step's constants now.)
  constvars = [*jaxpr.constvars, *fn.constvars]
  view = jaxpr.replace(constvars=constvars, eqns=eqns, outvars=outvars,
                       effects=jc.make_jaxpr_effects(constvars, jaxpr.invars, outvars, eqns))
  call = LossCall(start=a, stop=stop, backward=b - a - 1 + stop, fn=fn,
                  name=ef.params.get("name", "loss_fn"), diff=tuple(diff), seeded=seeded,
                  consts=tuple(F.consts))
  return ClosedJaxpr(view, [*closed.consts, *F.consts]), call


# -- the head ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LossHead:
  """How the loss is computed from the rows, in the view's variables
  (:func:`find_head`).

  Attributes:
    reductions: ``R``, each with how it combines ("sum", "max", "min").
    inputs: ``H``.
    eqns: the head's equations (view order); they read only ``R``, ``H``,
      literals and each other's results.
    outputs: the loss (``F``'s seeded outputs).
    on_params: the values of the view that depend on the parameters.
    why: "" if derived; else why not (then the entries are the loss itself).
    mixing: "" or how the step mixes rows, with where (an error with
      several groups, whatever ``output_reductions`` says).
  """
  reductions: tuple[tuple[Var, str], ...]
  inputs: tuple[Var, ...]
  eqns: tuple
  outputs: tuple
  on_params: frozenset
  why: str = ""
  mixing: str = ""

  def entries(self, how: str | None) -> tuple[list, list[str]]:
    """The values each group differentiates, and their kinds: ``WHOLE``
    (the whole batch's cotangent) or ``SHARE`` (it over ``G``)."""
    if self.why or how is not None:
      outs = [v for v in self.outputs if _differentiable(v, self.on_params)]
      return outs, [WHOLE if how == "sum" else SHARE] * len(outs)
    r = [v for v, op in self.reductions if _differentiable(v, self.on_params)]
    h = [v for v in self.inputs if _differentiable(v, self.on_params)]
    return r + h, [WHOLE] * len(r) + [SHARE] * len(h)


def _differentiable(v, on_params) -> bool:
  return (isinstance(v, Var) and v in on_params and
          jnp.issubdtype(v.aval.dtype, jnp.inexact))


def find_head(view: ClosedJaxpr, call: LossCall, *, batch: set, oracle: RowOracle | None,
              how: str | None = None) -> LossHead:
  """``L = head(R, H)`` for the loss of ``call`` in ``view`` (see the module
  docstring). ``batch``: the view's batch leaves; ``oracle``: the row
  dimensions of its values (None: not known); ``how``: the user's
  ``output_reductions["loss"]``, if any."""
  jaxpr = view.jaxpr
  eqns = jaxpr.eqns
  fn = call.fn
  outputs = tuple(fn.outvars[j] for j in call.seeded)
  params = {fv for fv, d in zip(fn.invars, call.diff, strict=True) if d}
  on_params = frozenset(depends(jaxpr, params))
  if oracle is None:
    return LossHead((), (), (), outputs, on_params,
                    why="autopar cannot tell which of the program's values hold the "
                        "batch's rows (the step could not be traced at a symbolic "
                        "batch size, and its program differs from size to size)")
  # Values that depend on the batch: its values, or its size.
  on_batch = depends(jaxpr, set(batch), lambda e: oracle.size_dependent(e) or any(
      oracle.varies(v) for v in e.outvars))
  producer = {v: e for e in eqns for v in e.outvars}
  order = {id(e): i for i, e in enumerate(eqns)}
  # Values computed from literals alone belong to the head (a constant
  # jnp.where(count == 0, 1.0, count) converts): no stage need send them.
  constant: set = set()
  for e in eqns:
    if not e.effects and all(isinstance(a, Literal) or a in constant for a in e.invars):
      constant.update(e.outvars)
  reductions: dict = {}
  inputs: dict = {}
  head: dict = {}
  why = ""
  stack, seen = list(outputs), set()
  while stack and not why:
    v = stack.pop()
    if isinstance(v, Literal) or v in seen:
      continue
    seen.add(v)
    if v in constant:
      head[id(producer[v])] = producer[v]
      stack.extend(producer[v].invars)
      continue
    if v not in on_batch:
      inputs[v] = None
      continue
    dims = oracle.dims(v)
    if dims is None:
      why = ("autopar cannot tell which of its values hold the batch's rows (the "
             "step could not be traced at a symbolic batch size, and its program "
             "differs from size to size)")
      break
    if dims:
      why = (f"it reads a value of shape {tuple(v.aval.shape)} that holds the batch's "
             f"rows other than through a sum, max or min over the rows")
      break
    eqn = producer.get(v)
    if eqn is None:
      why = (f"it reads an input of shape {tuple(v.aval.shape)} that depends on the "
             f"batch but holds no rows")
      break
    op = reduction_of(eqn, oracle.dims)
    if op is not None:
      reductions[v] = op
      continue
    rowed = [a for a in eqn.invars if isinstance(a, Var) and a in on_batch and oracle.dims(a)]
    if rowed and jaxprs_in(eqn):
      why = (f"it is reduced over the rows inside a '{eqn.primitive.name}' "
             f"({where(eqn)}): a jax.checkpoint, custom_jvp, custom_vjp, cond or loop around the "
             f"loss's reduction, which autopar does not look into for the loss's "
             f"sums. (Fix: return the per-example or per-token values from it and "
             f"reduce them after it)")
      break
    if rowed:
      why = (f"it takes the rows to a value without them by '{eqn.primitive.name}' "
             f"({where(eqn)}), which autopar cannot combine over micro-batches and "
             f"devices (only sums, maxes and mins over the rows)")
      break
    head[id(eqn)] = eqn
    stack.extend(eqn.invars)
  r = tuple(sorted(reductions.items(), key=lambda kv: order[id(producer[kv[0]])]))
  if not why:
    bad = [v for v, op in r if op != "sum" and v in on_params]
    if bad:
      eqn = producer[bad[0]]
      why = (f"it takes a {reductions[bad[0]]} over the rows of a value that depends "
             f"on the parameters ({where(eqn)}); its gradient is the one row's where "
             f"the whole batch's {reductions[bad[0]]} is, which autopar does not "
             f"combine over devices")
  # (Towards the loss itself where it was not derived: the escape hatch
  # averages each group's loss, never one whose rows mix.)
  mixing = row_mixing(jaxpr, [v for v, _ in r] if not why else list(outputs),
                      batch=set(batch), oracle=oracle)
  if why:
    return LossHead((), (), (), outputs, on_params, why=why, mixing=mixing)
  h = tuple(v for v in inputs if isinstance(v, Var))
  return LossHead(r, h, tuple(sorted(head.values(), key=lambda e: order[id(e)])),
                  outputs, on_params, mixing=mixing)


# -- the gradient as the whole batch's ------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LossValues:
  """A loss's entries and what their cotangents read, as values of the view
  (a pipeline's forward program gives its entries their cotangents:
  ``frontend/program.py``).

  Attributes:
    entries: the values each group differentiates.
    sums: the sums ``LossGradient.scale`` reads.
    inputs: the inputs it reads.
    seeds: the loss's cotangent seeds (literals, as autopar.value_and_grad
      gives them).
    fixed: per input, whether it depends on neither the parameters nor the
      batch (a step's argument, a constant): a pipeline computes it before
      the schedule.
  """
  entries: tuple
  sums: tuple
  inputs: tuple
  seeds: tuple
  fixed: tuple = ()


@dataclasses.dataclass(frozen=True)
class LossGradient:
  """How a gradient stage seeds the loss's entries (``lower.py``).

  Attributes:
    kinds: per entry (output of the ``autopar_loss_cotangent`` equation),
      ``WHOLE`` or ``SHARE``.
    sum_ops: per sum ``S`` that the cotangents read, how it combines.
    scale: ``C(S, H, seeds) -> cotangent per entry`` at the split's batch
      size (symbolic or concrete); a stage evaluates it at the whole
      batch's (``split.scale_at``).
    forward_sums: some sum in ``S`` depends on the parameters (the first
      pass runs the forward pass).
    why: "" if the loss was derived, else why not.
    mixing: "" or how the step mixes rows (see :func:`row_mixing`).
    how: ``output_reductions["loss"]``, if given.
    name: the loss function's.
    values: the entries and what ``scale`` reads, as values of the view
      (for a pipeline, whose step is not expanded); None after
      :func:`expand`.
  """
  kinds: tuple[str, ...]
  sum_ops: tuple[str, ...]
  scale: ClosedJaxpr
  forward_sums: bool
  why: str = ""
  mixing: str = ""
  how: str | None = None
  name: str = "loss_fn"
  values: LossValues | None = None

  @property
  def num_sums(self) -> int:
    return len(self.sum_ops)


def check_loss(loss: LossGradient | None, fn_name: str, split_over: str) -> None:
  """Raises the :class:`~autopar.InputError` that says why ``loss`` cannot
  be split over ``split_over`` (micro-batches and devices), if it cannot."""
  if loss is None:
    return
  if loss.mixing:
    raise InputError(
        f"{fn_name}: the step mixes the batch's rows on the way to the loss of "
        f"{loss.name}, and autopar runs it on each device's rows of each "
        f"micro-batch ({split_over}), so it would give other numbers than on one "
        f"device: {loss.mixing}; or run with num_micro_batches=1 and the batch "
        f"whole (ShardParallel keeps it so by itself; DataParallel(batch_axes=())).")
  if loss.why and loss.how is None:
    raise InputError(
        f"{fn_name}: the loss of {loss.name} (the value autopar.value_and_grad "
        f"differentiates) cannot be combined over {split_over}: {loss.why}. autopar "
        f"gives the whole batch's loss and gradient for losses computed from sums, "
        f"maxes and mins over the batch's rows (a mean, a sum, a token mean over a "
        f"padding mask, a weighted mean). Fix: compute the loss from such "
        f"reductions; or say how each device's and micro-batch's loss combines with "
        f"parallelize(..., output_reductions={{{LOSS_KEY!r}: 'mean'}}) (their "
        f"losses and gradients averaged, right only if each holds as many valid "
        f"rows) or {{{LOSS_KEY!r}: 'sum'}}; or run with num_micro_batches=1 and the "
        f"batch on one device.")


def _sds(aval) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type",
                                                                        False))


def _evaluate(fn: Jaxpr, consts, args, remat, remat_loop: str, name: str,
              without: Jaxpr) -> list:
  if remat is None or remat == "none":
    return called_eval(fn, consts, args)
  return rolled_eval(fn, consts, args, remat, name, without=without, loop=remat_loop)


@dataclasses.dataclass(frozen=True)
class _Cotangents:
  """The entries of a loss and how their cotangents are computed, in the
  view's variables (:func:`cotangents`)."""
  entries: list                  # the values each group differentiates
  kinds: list                    # per entry: WHOLE or SHARE
  head_in: list                  # the head's inputs: R then H
  head: Jaxpr                    # head_in -> the loss
  seeds: list                    # the loss's cotangent seeds (backward's operands)
  scale: ClosedJaxpr             # (sums read, inputs read, seeds) -> per entry
  sums: list                     # indices into head_in of the sums ``scale`` reads
  inputs: list                   # indices into head_in of the inputs it reads
  sum_ops: tuple

  def local(self, hvals, cts) -> list:
    """The entries' cotangents from one group's own ``head_in`` values."""
    e_at = [self.head_in.index(v) for v in self.entries]

    def h(*e):
      full = list(hvals)
      for k, x in zip(e_at, e, strict=True):
        full[k] = x
      return jc.eval_jaxpr(self.head, [], *full)
    _, hvjp = jax.vjp(h, *[hvals[k] for k in e_at])
    return list(hvjp(list(cts)))

  def gradient(self, head: LossHead, call: LossCall, how, *,
               with_values: bool = False) -> LossGradient:
    values = None
    if with_values:
      inputs = tuple(self.head_in[k] for k in self.inputs)
      values = LossValues(tuple(self.entries), tuple(self.head_in[k] for k in self.sums),
                          inputs, tuple(self.seeds),
                          fixed=tuple(v not in head.on_params for v in inputs))
    return LossGradient(
        kinds=tuple(self.kinds), sum_ops=self.sum_ops, scale=self.scale,
        forward_sums=any(self.head_in[k] in head.on_params for k in self.sums),
        why=head.why, mixing=head.mixing, how=how, name=call.name, values=values)


def cotangents(view: ClosedJaxpr, call: LossCall, head: LossHead,
               how: str | None = None) -> _Cotangents:
  """The entries of ``head``'s loss, and ``C``, their cotangents from the
  sums and inputs they read (see the module docstring)."""
  eqns = view.jaxpr.eqns
  nin = len(call.fn.invars)
  seeds = list(eqns[call.backward].invars[nin:])
  entries, kinds = head.entries(how)
  outputs = list(head.outputs)
  if not head.why and how is None:
    head_in = [v for v, _ in head.reductions] + list(head.inputs)
    body, outputs = _without_bindings(head.eqns, outputs)
    nr = len(head.reductions)
  else:
    head_in = list(dict.fromkeys(v for v in head.outputs if isinstance(v, Var)))
    body, nr = [], 0
  hj = Jaxpr([], head_in, outputs, body,
             debug_info=jc.debug_info("loss head", len(head_in), len(outputs)))
  draft = _Cotangents(entries, kinds, head_in, hj, seeds, None, [], [], ())
  cj = jax.make_jaxpr(draft.local)([_sds(v.aval) for v in head_in],
                                   [_sds(v.aval) for v in seeds])
  scale, used = _scale(cj, len(head_in), len(seeds))
  sums = [k for k in used if k < nr]
  return dataclasses.replace(
      draft, scale=scale, sums=sums, inputs=[k for k in used if k >= nr],
      sum_ops=tuple(head.reductions[k][1] for k in sums))


def _without_bindings(eqns, outputs) -> tuple[list, list]:
  """The head's equations without the loss function's input bindings (a
  mask sum taken before the loss function, read through one), and its
  outputs: what a stage evaluates of it are plain equations."""
  rename: dict = {}
  read = lambda a: a if isinstance(a, Literal) else rename.get(a, a)
  body = []
  for e in eqns:
    if e.primitive is loss_input_p:
      rename[e.outvars[0]] = read(e.invars[0])
    else:
      body.append(e.replace(invars=[read(a) for a in e.invars]))
  return body, [read(v) for v in outputs]


def expand(view: ClosedJaxpr, call: LossCall, head: LossHead, *, remat: Any = "none",
           remat_loop: str = "scan", how: str | None = None) -> tuple[ClosedJaxpr, LossGradient]:
  """The step with the loss function differentiated as the whole batch's
  (see the module docstring), and how its stages seed it."""
  jaxpr = view.jaxpr
  eqns = jaxpr.eqns
  fn = call.fn
  block = eqns[call.start:call.stop]
  nin = len(fn.invars)
  operands = [e.invars[0] for e in block[:nin]]
  inside = set(fn.invars) | {v for e in fn.eqns for v in e.outvars}
  eb = eqns[call.backward]
  ct = cotangents(view, call, head, how)
  head_in, seeds = ct.head_in, ct.seeds
  extras = [v for v in head_in if v in inside]
  diff_pos = [p for p, d in enumerate(call.diff) if d]
  fx = Jaxpr(fn.constvars, fn.invars, [*fn.outvars, *extras], fn.eqns, fn.effects,
             jc.debug_info(call.name, len(fn.invars), len(fn.outvars) + len(extras)))
  nout = len(fn.outvars)
  entry_at = [extras.index(v) for v in ct.entries]
  box: dict = {}

  def forward(*xs):
    def f(*d):
      full = list(xs)
      for p, x in zip(diff_pos, d, strict=True):
        full[p] = x
      outs = _evaluate(fx, call.consts, full, remat, remat_loop, call.name, fn)
      ex = outs[nout:]
      return [ex[k] for k in entry_at], (outs[:nout], ex)
    _, vjp, (outs, ex) = jax.vjp(f, *[xs[p] for p in diff_pos], has_aux=True)
    res, box["tree"] = jax.tree_util.tree_flatten(vjp)
    return [*outs, *ex, *res]

  fj = jax.make_jaxpr(forward)(*[_sds(v.aval) for v in operands])
  res_vars = fj.jaxpr.outvars[nout + len(extras):]
  params = dict(kinds=tuple(ct.kinds), sum_ops=ct.sum_ops, num_inputs=len(ct.inputs),
                num_seeds=len(seeds))

  def backward(res, hvals, cts):
    c = ct.local(hvals, cts)
    if c:
      c = loss_cotangent_p.bind(*c, *[hvals[k] for k in ct.sums],
                                *[hvals[k] for k in ct.inputs], *cts, **params)
    vjp = jax.tree_util.tree_unflatten(box["tree"], res)
    return list(vjp(list(c)))

  h_avals = [_sds(v.aval) for v in head_in]
  ct_avals = [_sds(v.aval) for v in seeds]
  bj = jax.make_jaxpr(backward)([_sds(v.aval) for v in res_vars], h_avals, ct_avals)

  # Splice: the forward in place of F's block, the backward in place of the call.
  env: dict = {}
  read = lambda v: v if isinstance(v, Literal) else env.get(v, v)
  constvars, consts = list(jaxpr.constvars), list(view.consts)
  out = list(eqns[:call.start])

  def splice(closed: ClosedJaxpr, ins: Sequence) -> list:
    sub = dict(zip(closed.jaxpr.invars, [read(v) for v in ins], strict=True))
    for cv, c in zip(closed.jaxpr.constvars, closed.consts, strict=True):
      sub[cv] = Var(cv.aval)
      constvars.append(sub[cv])
      consts.append(c)
    get = lambda v: v if isinstance(v, Literal) else sub.get(v, v)
    for e in closed.jaxpr.eqns:
      out.append(e.replace(invars=[get(v) for v in e.invars]))
    return [get(v) for v in closed.jaxpr.outvars]

  fouts = splice(fj, operands)
  for v, w in zip([*fn.outvars, *extras], fouts[:nout + len(extras)], strict=True):
    if isinstance(v, Var):
      env[v] = w
  res = fouts[nout + len(extras):]
  for e in eqns[call.stop:call.backward]:
    out.append(e.replace(invars=[read(v) for v in e.invars]))
  grads = splice(bj, [*res, *head_in, *seeds])
  for v, g in zip(eb.outvars, grads, strict=True):
    env[v] = g
  for e in eqns[call.backward + 1:]:
    out.append(e.replace(invars=[read(v) for v in e.invars]))
  outvars = [read(v) for v in jaxpr.outvars]
  new = Jaxpr(constvars, jaxpr.invars, outvars, out, jc.make_jaxpr_effects(
      constvars, jaxpr.invars, outvars, out), jaxpr.debug_info)
  return ClosedJaxpr(new, consts), ct.gradient(head, call, how)


def _scale(cj: ClosedJaxpr, num_inputs: int, num_seeds: int) -> tuple[ClosedJaxpr, list[int]]:
  """``cj`` (head inputs, seeds -> cotangents) reading only the head inputs
  it uses (and every seed), and which those are."""
  j = cj.jaxpr
  live = {v for v in j.outvars if isinstance(v, Var)}
  eqns = []
  for e in reversed(j.eqns):
    if any(v in live for v in e.outvars):
      eqns.append(e)
      live.update(v for v in e.invars if isinstance(v, Var))
  eqns.reverse()
  keep_in = [k for k in range(num_inputs) if j.invars[k] in live]
  ins = [j.invars[k] for k in keep_in] + list(j.invars[num_inputs:])
  consts = [(v, c) for v, c in zip(j.constvars, cj.consts) if v in live]
  new = Jaxpr([v for v, _ in consts], ins, j.outvars, eqns,
              debug_info=jc.debug_info("loss scale", len(ins), len(j.outvars)))
  return ClosedJaxpr(new, [c for _, c in consts]), keep_in
