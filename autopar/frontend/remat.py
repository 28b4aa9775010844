"""``remat="layers"``: the repeated layers of a forward pass, checkpointed one by one.

A transformer written as a Python loop over blocks traces to the same run of
equations once per layer, each reading its own weights. With a method's
``remat="layers"`` (or a ``jax.checkpoint`` policy), ``autopar.grad`` /
``autopar.value_and_grad`` do not differentiate the user's loss function as
written: they trace it, find the longest stretch of equations that repeats
layer after layer, and differentiate an equivalent program in which each
repetition is a layer whose backward pass recomputes it. The backward pass
keeps only what crosses layer boundaries (the carry, and what a policy
saves) plus one layer's activations at a time. Each layer reads its weights
where they are: no stacked copy of them exists, and the user's parameters
keep their own pytree, so each layer's gradient comes back to its own leaf.

The layers run in one of two ways (``loop``, the method's ``remat_loop``;
:func:`layer_loop` picks it by platform when the method does not):

* ``"unrolled"`` (:func:`_run_stack_unrolled`; the default on GPU and TPU):
  one layer after another, each a call with a VJP of its own
  (:func:`_recomputed_layer`) that keeps the layer's inputs and, in the
  backward pass, recomputes and differentiates the layer once the
  cotangent of its output exists, the two tied by an optimization barrier.
  No loop and no conditional; XLA compiles every layer. XLA:CPU drops
  optimization barriers before its common-subexpression pass, merging each
  recomputation with the forward pass (no memory saved), hence:
* ``"scan"`` (:func:`_run_stack_selected`; the default on CPU): a forward
  scan over the layer index picks layer ``k``'s inputs with ``lax.switch``
  and saves the carry entering each layer, plus what a ``jax.checkpoint``
  policy saves inside it (nothing, with ``remat="layers"``); a VJP of its
  own runs a reverse scan that picks the same inputs and differentiates
  layer ``k`` from what was saved, recomputing the rest. XLA compiles one
  loop body. The conditional's branch index is read back to the host on
  XLA:GPU, once per layer per pass. The layers' gradients leave the
  backward loop as one stacked output, a layer per trip, which the gradient
  stages fold into the partial sums (or reduce) trip by trip, never holding
  it whole (``gradstack.py``).

How a stretch is found (:func:`find_layers`):

1. Each equation gets a signature: primitive, parameters, input and output
   types (literals by type: their values are checked in step 2). A call
   with custom derivative rules (``jax.nn.relu``, ``softmax``, a user's
   ``custom_jvp`` / ``custom_vjp``) is keyed by what it computes, rules
   included: the jaxpr of its VJP (each layer's call holds its rules in
   Python objects of its own). Candidate periods ``L`` are the distances
   between equal signatures; for each, runs where ``sig[i] == sig[i + L]``
   give ``N = run // L + 1`` repetitions.
2. A candidate (start, L, N) is checked for data flow. Equation ``j`` of
   repetition ``k`` must read, at each operand, the same kind of value as
   equation ``j`` of every other repetition: a value made earlier in the same
   repetition (at the same position), a value made by the previous
   repetition (a *carry*; the first repetition reads its initial value from
   before the stretch), a value from outside that is the same for every
   repetition (loop-invariant), or one that differs (stacked and scanned
   over: the layer's weights, or a literal such as a per-layer RNG fold-in
   constant). Values a repetition makes may be read only by
   itself and the next one, and the last repetition's by the code after the
   stretch through the carry.
3. The longest valid candidate that reads per-layer values wins; the search
   then repeats before and after it (e.g. an encoder and a decoder stack).

A scan over layers that the user wrote already (per-iteration inputs, two or
more iterations, a body not yet checkpointed) gets ``jax.checkpoint`` on its
body instead.

Because every repetition is checked to compute exactly the first one's
equations on its own inputs, the rolled program computes the same values as
the original; only the order of floating-point operations inside XLA's
fusions may differ.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import functools
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from autopar import jax_compat as jc
from autopar.errors import InputError, PlanError
from autopar.frontend.pytrees import leaf_mask

__all__ = ["remat_mode", "check_remat", "maybe_roll", "rolled_eval", "called_eval",
           "find_layers", "Stack",
           "NoLayersWarning", "layer_loop", "CUSTOM_DERIVATIVES", "derivative_key"]

_MODE: contextvars.ContextVar = contextvars.ContextVar("autopar_remat",
                                                      default=("none", "scan"))
_NOTHING = jax.checkpoint_policies.nothing_saveable
LOOPS = ("scan", "unrolled")


def check_remat(remat: Any, where: str) -> None:
  if remat in ("none", "layers") or callable(remat):
    return
  raise InputError(f"{where}: remat={remat!r}; expected 'none', 'layers' or a "
                   f"jax.checkpoint policy (e.g. jax.checkpoint_policies."
                   f"dots_with_no_batch_dims_saveable).")


def check_remat_loop(loop: Any, where: str) -> None:
  if loop is None or loop in LOOPS:
    return
  raise InputError(f"{where}: remat_loop={loop!r}; expected None (the platform's: "
                   f"'unrolled' on GPU and TPU, 'scan' on CPU), 'scan' or 'unrolled'.")


class NoLayersWarning(UserWarning):
  """remat found no repeated layers to checkpoint: nothing is recomputed."""


def layer_loop(loop: str | None, platform: str, gathers: bool = False) -> str:
  """How the layers rolled under remat reach their weights: ``loop`` if the
  method names one, else ``"unrolled"`` where XLA keeps optimization
  barriers until it has scheduled the program (GPU, TPU) and ``"scan"`` on
  CPU, whose compiler drops them before its common-subexpression pass and
  so would merge each layer's recomputation with its forward pass (see the
  module docstring). ``gathers``: the method gathers each parameter for
  each equation that reads it (ZeRO-3, ``evaluate.Rules.gathers``):
  ``"unrolled"`` on CPU too, where a recomputed layer reads a gather of
  its own, which XLA cannot merge with the forward pass's, while a scan
  reads every layer's weights, gathered whole for the loop (a 12-layer
  transformer on 8 devices: 0.96 MB unrolled, 3.66 MB as a scan, 1.77 MB
  without remat)."""
  if loop is not None:
    return loop
  return "scan" if platform == "cpu" and not gathers else "unrolled"


@contextlib.contextmanager
def remat_mode(remat: Any, loop: str = "scan"):
  """While tracing a step: how ``autopar.grad`` treats repeated layers
  (``loop``: ``layer_loop``'s)."""
  token = _MODE.set((remat, loop))
  try:
    yield
  finally:
    _MODE.reset(token)


def maybe_roll(fun: Callable) -> Callable:
  """``fun``, or ``fun`` with its repeated layers checkpointed one by one when
  the step is traced under ``remat="layers"`` or a policy."""
  def call(*args, **kwargs):
    mode, loop = _MODE.get()
    if mode == "none":
      return fun(*args, **kwargs)
    policy = _NOTHING if mode == "layers" else mode
    return _rolled_call(fun, policy, loop, args, kwargs)
  return call


# -- the rolled program ---------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Stack:
  """``count`` repetitions of ``length`` equations from ``start``.

  Attributes:
    carry_pos: per carry slot, (equation, output) within a repetition of the
      value each repetition hands to the next.
    carry_init: per carry slot, the variable from before the stack that the
      first repetition reads in its place (None: a slot only read after the
      stack, which starts at zeros).
    stacked: per scanned input, the variable each repetition reads (stacked
      on a new leading axis).
    stacked_template: per scanned input, the variable the first repetition
      reads (the body binds it to the current layer's slice).
  """
  start: int
  length: int
  count: int
  carry_pos: tuple[tuple[int, int], ...]
  carry_init: tuple[Any, ...]
  stacked: tuple[tuple[Any, ...], ...]
  stacked_template: tuple[Any, ...]

  @property
  def end(self) -> int:
    return self.start + self.length * self.count


def _rolled_call(fun, policy, loop, args, kwargs):
  flat, tree = jax.tree.flatten((args, kwargs))
  is_array = leaf_mask((args, kwargs))      # traced as autopar traces the step
  out_tree = []

  constant_outs = []          # outputs that do not depend on the inputs (an aux int)

  def flat_fun(*arrays):
    it = iter(arrays)
    leaves = [next(it) if a else x for a, x in zip(is_array, flat)]
    a, k = jax.tree.unflatten(tree, leaves)
    out, t = jax.tree.flatten(fun(*a, **k))
    out_tree.append(t)
    constant_outs.append([None if isinstance(o, jc.Tracer) else (o,) for o in out])
    return out

  arrays = [x for a, x in zip(is_array, flat) if a]
  closed = jax.make_jaxpr(flat_fun)(*arrays)
  outs = rolled_eval(closed.jaxpr, closed.consts, arrays, policy,
                     getattr(fun, "__name__", "the function"), stacklevel=5, loop=loop)
  outs = [x if c is None else c[0] for x, c in zip(outs, constant_outs[0], strict=True)]
  return jax.tree.unflatten(out_tree[0], outs)


def rolled_eval(jaxpr: Jaxpr, consts, args, remat: Any, name: str, *,
                stacklevel: int = 2, without: Jaxpr | None = None,
                loop: str = "scan") -> list:
  """``jaxpr`` evaluated on ``args`` with its repeated layers checkpointed
  one by one (``remat``: ``"layers"`` or a ``jax.checkpoint`` policy), for
  differentiating: what ``autopar.value_and_grad`` runs under a method's
  remat. ``loop``: ``"scan"`` (one loop over the layers) or ``"unrolled"``
  (see the module docstring). ``name``: the function's, for the warning
  when it has no repeated layers. ``without``: the same function without
  the extra outputs ``jaxpr`` has (the loss's sums, ``loss.py``), for that
  warning to say when it is those that hide the layers."""
  policy = _NOTHING if remat == "layers" else remat
  stacks = find_layers(jaxpr)
  if not stacks and not any(_is_layer_scan(e) for e in jaxpr.eqns):
    mode = 'layers' if policy is _NOTHING else repr(policy)
    if without is not None and find_layers(without):
      warnings.warn(
          f"autopar: remat={mode}: {name}'s repeated layers compute values of the "
          f"loss itself (a per-layer auxiliary loss or penalty, summed over the "
          f"layers), which its gradient reads one by one, so the layers are not "
          f"rolled and nothing is rematerialised. Fix: stack the per-layer values "
          f"and reduce them after the layers.", NoLayersWarning,
          stacklevel=stacklevel + 1)
    else:
      warnings.warn(
          f"autopar: remat={mode} found no repeated layers in {name} (a stretch of "
          f"equations that repeats with different weights, or a scan over "
          f"per-layer inputs), so nothing is rematerialised.", NoLayersWarning,
          stacklevel=stacklevel + 1)
  return _eval(jaxpr, consts, args, stacks, policy, loop)


def _eval(jaxpr: Jaxpr, consts, args, stacks: list[Stack], policy, loop: str) -> list:
  env: dict = {}

  def read(v):
    return v.val if isinstance(v, Literal) else env[v]

  def run(eqns, env, literals=None):
    # `literals`: id -> value of the literals a scan body binds (a literal
    # that differs from layer to layer).
    for eqn in eqns:
      vals = [env[v] if not isinstance(v, Literal) else
              literals[id(v)] if literals and id(v) in literals else v.val
              for v in eqn.invars]
      if literals is None and policy is not None and _is_layer_scan(eqn):
        ans = _checkpointed_scan(eqn, vals, policy)
      else:
        params = eqn.primitive.get_bind_params(eqn.params)
        with eqn.ctx.manager:
          ans = eqn.primitive.bind(*vals, **params)
        ans = ans if eqn.primitive.multiple_results else [ans]
      for v, x in zip(eqn.outvars, ans, strict=True):
        env[v] = x

  env.update(zip(jaxpr.constvars, consts, strict=True))
  env.update(zip(jaxpr.invars, args, strict=True))
  pos = 0
  for s in stacks:
    run(jaxpr.eqns[pos:s.start], env)
    if policy is None:
      # One jitted function for every layer: differentiating the stack then
      # differentiates one layer's equations, once (JAX keeps the
      # derivative of a call's jaxpr), and binds the result per layer.
      _run_stack_unrolled(jaxpr, s, env, run, functools.cache(jax.jit))
    elif loop == "unrolled":
      _run_stack_unrolled(jaxpr, s, env, run,
                          lambda layer: _recomputed_layer(layer, policy))
    else:
      _run_stack_selected(jaxpr, s, env, run, policy)
    pos = s.end
  run(jaxpr.eqns[pos:], env)
  return [read(v) for v in jaxpr.outvars]


def _is_layer_scan(eqn) -> bool:
  """A scan the user wrote over layers (per-iteration inputs, two or more
  iterations) whose body is not checkpointed yet."""
  if eqn.primitive.name != "scan":
    return False
  p = eqn.params
  has_xs = len(eqn.invars) > sum(jc.scan_counts(p))
  return (has_xs and p["length"] >= 2 and
          not any(e.primitive.name == "remat2" for e in p["jaxpr"].jaxpr.eqns))


def _checkpointed_scan(eqn, vals, policy) -> list:
  """A scan over layers, re-bound with ``jax.checkpoint`` on its body."""
  from jax.extend.core import jaxpr_as_fun
  p = eqn.params
  nc, ncar = jc.scan_counts(p)
  consts, init, xs = vals[:nc], vals[nc:nc + ncar], vals[nc + ncar:]
  body = jaxpr_as_fun(p["jaxpr"])

  def step(carry, x):
    outs = body(*consts, *carry, *x)
    return list(outs[:ncar]), list(outs[ncar:])
  carry, ys = lax.scan(jax.checkpoint(step, policy=policy, prevent_cse=False),
                       list(init), list(xs), length=p["length"], reverse=p["reverse"],
                       unroll=p["unroll"])
  return [*carry, *ys]


def _run_layer(s: Stack, body_eqns, run, local, carry, inputs) -> list:
  """One layer of ``s``: binds its carries and per-layer inputs (in
  ``s.stacked_template`` order) in ``local``, runs ``body_eqns`` and returns
  the carries it hands on."""
  literals = {}

  def bind(v, value):
    if isinstance(v, Literal):
      literals[id(v)] = value
    else:
      local[v] = value
  for v, c in zip(s.carry_init, carry, strict=True):
    if v is not None:
      bind(v, c)
  for v, x in zip(s.stacked_template, inputs, strict=True):
    bind(v, x)
  run(body_eqns, local, literals)
  return [local[body_eqns[j].outvars[o]] for j, o in s.carry_pos]


def _initial_carries(s: Stack, body_eqns, env: dict) -> list:
  """The carries entering the first layer (zeros for a slot only read after
  the stack)."""
  out = []
  for v, (j, o) in zip(s.carry_init, s.carry_pos, strict=True):
    aval = body_eqns[j].outvars[o].aval
    out.append(_outer_value(env, v) if v is not None else jnp.zeros(aval.shape, aval.dtype))
  return out


def _set_outputs(jaxpr: Jaxpr, s: Stack, env: dict, final) -> None:
  """The stack's final carries, as the last repetition's outputs in ``env``."""
  last = jaxpr.eqns[s.start + (s.count - 1) * s.length:s.end]
  for (j, o), x in zip(s.carry_pos, final, strict=True):
    env[last[j].outvars[o]] = x


def _run_stack_selected(jaxpr: Jaxpr, s: Stack, env: dict, run, policy) -> None:
  """The stack as one call with a VJP of its own, which reads each layer's
  weights where they are instead of stacking them.

  Forward: a scan over the layer index whose body picks layer ``k``'s inputs
  with ``lax.switch`` (one layer's copy at a time) and keeps the carry
  entering each layer, plus what ``policy`` saves inside the layer
  (nothing, for ``remat="layers"``). Backward: a reverse scan that picks the
  same inputs and runs layer ``k``'s VJP from what was kept, recomputing
  the rest. The layers'
  gradients leave the backward loop stacked, each sliced to its own leaf
  (the gradient stages fold the stack as it is made: ``gradstack.py``);
  loop-invariant inputs' gradients are summed in its carry. Differentiating
  ``lax.scan`` itself instead would need the weights stacked (``xs``), or,
  with the weights as loop constants, would add every layer's zero
  cotangent to every constant's gradient at every layer.

  How a layer's VJP is kept: the forward pass takes ``jax.vjp`` of the layer
  under ``jax.checkpoint(policy)``. The VJP is a pytree whose leaves are
  its residuals; those that are the layer's own inputs (its carry, picked
  weights, per-layer literals, loop invariants) are found again in the
  backward pass, and only the rest, what the policy saves, leave the
  forward loop stacked.
  """
  body_eqns = jaxpr.eqns[s.start:s.start + s.length]
  invariant = _invariants(s, body_eqns)
  # Per-layer inputs: literals (a layer's RNG fold-in constant) are stacked as
  # numpy constants; the rest (weights) are picked per layer.
  lit = [i for i, t in enumerate(s.stacked_template) if isinstance(t, Literal)]
  var = [i for i, t in enumerate(s.stacked_template) if not isinstance(t, Literal)]
  lit_xs = [np.stack([np.asarray(v.val, v.aval.dtype) for v in s.stacked[i]]) for i in lit]
  read = [i for i, v in enumerate(s.carry_init) if v is not None]   # slots layers read
  count, nv = s.count, len(var)
  init = _initial_carries(s, body_eqns, env)
  per_layer = [_outer_value(env, s.stacked[i][k]) for i in var for k in range(count)]
  inv = [env[v] for v in invariant]
  c_diff = [_differentiable(x) for x in init]
  p_diff = [_differentiable(per_layer[i * count]) for i in range(nv)]
  i_diff = [_differentiable(x) for x in inv]
  kept: dict = {}       # from tracing the forward pass: how to rebuild a layer's VJP

  def layer(carry, picked, lits, inv):
    inputs = [None] * len(s.stacked_template)
    for i, x in (*zip(var, picked, strict=True), *zip(lit, lits, strict=True)):
      inputs[i] = x
    return _run_layer(s, body_eqns, run, dict(zip(invariant, inv, strict=True)),
                      carry, inputs)

  def pick(k, per_layer):
    """Layer ``k``'s picked inputs; ``per_layer``: slot-major, layer-minor."""
    if not nv:
      return []
    branches = [lambda *a, k=k: [a[i * count + k] for i in range(nv)] for k in range(count)]
    return lax.switch(k, branches, *per_layer)

  def layer_vjp(carry, picked, lits, inv):
    """The layer's outputs and the residuals of its VJP that are not its
    inputs (``kept`` records where each residual comes from)."""
    outs, vjp = _layer_vjp(layer, policy, (carry, picked, lits, inv),
                           (c_diff, p_diff, None, i_diff))
    leaves, tree = jax.tree.flatten(vjp)
    inputs = {id(x): (name, i) for name, xs in (
        ("carry", carry), ("picked", picked), ("lits", lits), ("inv", inv))
        for i, x in enumerate(xs)}
    where, saved = [], []
    for leaf in leaves:
      if id(leaf) in inputs:
        where.append(inputs[id(leaf)])
      elif isinstance(leaf, (jax.Array, np.ndarray)):
        # Saved per layer: a traced value, or under jax.disable_jit (where
        # the scan runs its body eagerly) a concrete one, which differs from
        # layer to layer just the same.
        where.append(("saved", len(saved)))
        saved.append(leaf)
      else:                           # a Python scalar: the same for every layer
        where.append(("constant", leaf))
    kept.update(tree=tree, where=where)
    return outs, saved

  def forward(init, per_layer, inv, save):
    def body(carry, x):
      k, lits = x
      picked = pick(k, per_layer)
      if not save:
        return layer(carry, picked, lits, inv), None
      out, saved = layer_vjp(carry, picked, lits, inv)
      return out, ([carry[i] for i in read], saved)
    return lax.scan(body, list(init), (jnp.arange(count), lit_xs), length=count)

  @jax.custom_vjp
  def stack(init, per_layer, inv):
    return forward(init, per_layer, inv, False)[0]

  def stack_fwd(init, per_layer, inv):
    final, saved = forward(init, per_layer, inv, True)
    return final, (init, per_layer, inv, saved)

  def stack_bwd(res, cts):
    init, per_layer, inv, (carries, saved) = res
    tree, where = kept["tree"], kept["where"]
    expected = sum(w[0] == "saved" for w in where)
    if len(saved) != expected:
      raise PlanError(
          f"autopar: remat traced the layers' forward pass with a different "
          f"structure from the one their backward pass rebuilds ({len(saved)} "
          f"saved values against {expected}). This is a bug in autopar; "
          f"remat='none' avoids it.")

    def body(acc, x):
      ct, inv_ct = acc
      k, lits, carry_read, saved_k = x
      carry = [jnp.zeros_like(c) for c in init]
      for i, c in zip(read, carry_read, strict=True):
        carry[i] = c
      found = {"carry": carry, "picked": pick(k, per_layer), "lits": lits, "inv": inv,
               "saved": saved_k}
      vjp = jax.tree.unflatten(tree, [w[1] if w[0] == "constant" else found[w[0]][w[1]]
                                      for w in where])
      d_c, d_p, d_i = vjp(list(ct))
      return (d_c, [a + b for a, b in zip(inv_ct, d_i, strict=True)]), d_p

    ct0 = _take(list(cts), c_diff)
    inv0 = [jnp.zeros_like(x) for x in _take(inv, i_diff)]
    (d_init, d_inv), d_layers = lax.scan(
        body, (ct0, inv0), (jnp.arange(count), lit_xs, carries, saved), length=count,
        reverse=True)
    d_layers = iter(d_layers)
    d_per_layer = []
    for i in range(nv):
      stacked = next(d_layers) if p_diff[i] else None
      d_per_layer += [stacked[k] if p_diff[i] else _zero_cotangent(per_layer[i * count + k])
                      for k in range(count)]
    return (_fill(init, d_init, c_diff), d_per_layer, _fill(inv, d_inv, i_diff))

  stack.defvjp(stack_fwd, stack_bwd)
  final = stack(init, per_layer, inv)
  _set_outputs(jaxpr, s, env, final)


def _invariants(s: Stack, body_eqns) -> list:
  """The values from before the stack that every layer reads alike."""
  bound = {id(v) for v in (*s.carry_init, *s.stacked_template) if v is not None}
  made = {v for e in body_eqns for v in e.outvars}
  return list(dict.fromkeys(
      v for e in body_eqns for v in e.invars
      if not isinstance(v, Literal) and v not in made and id(v) not in bound))


def _run_stack_unrolled(jaxpr: Jaxpr, s: Stack, env: dict, run, wrap: Callable) -> None:
  """The stack one layer after another, each layer run as ``wrap(layer)``
  (``layer``: carries, per-layer inputs, invariants -> carries): no loop, so
  each layer reads its own weights where they are, with neither a
  conditional to pick them nor a stacked copy of them. XLA compiles every
  layer. Under remat, ``wrap`` makes a call whose backward pass recomputes
  the layer (:func:`_recomputed_layer`); in :func:`called_eval` it is the
  one jitted function of the stack."""
  body_eqns = jaxpr.eqns[s.start:s.start + s.length]
  invariant = _invariants(s, body_eqns)
  inv = [env[v] for v in invariant]

  def layer(carry, inputs, inv):
    return _run_layer(s, body_eqns, run, dict(zip(invariant, inv, strict=True)),
                      carry, inputs)
  carry = _initial_carries(s, body_eqns, env)
  for k in range(s.count):
    inputs = [_outer_value(env, per_layer[k]) for per_layer in s.stacked]
    carry = wrap(layer)(carry, inputs, inv)
  _set_outputs(jaxpr, s, env, carry)


def called_eval(jaxpr: Jaxpr, consts, args) -> list:
  """``jaxpr`` evaluated on ``args`` with each of its repeated layers a call
  of one jitted function (``jit`` equations, which the caller inlines once
  it has differentiated them): a program of many equal layers, such as a
  transformer written as a Python loop, is differentiated in the time of
  one layer and the rest of the program. The values are ``eval_jaxpr``'s."""
  return _eval(jaxpr, consts, args, find_layers(jaxpr), None, "called")


def _recomputed_layer(layer: Callable, policy) -> Callable:
  """``layer`` (carries, per-layer inputs, invariants -> carries) as a call
  that keeps its inputs, plus what ``policy`` saves, for its backward pass,
  which runs the layer's VJP under ``jax.checkpoint(policy)`` from them.

  The backward pass passes what it recomputes from, with the cotangents of
  the layer's outputs, through one ``lax.optimization_barrier``: XLA cannot
  see the recomputation as the forward pass's (and merge the two, keeping
  every layer's activations), nor run it before the layers above have been
  differentiated. (XLA:CPU drops barriers before its own passes, so there
  the merge happens: ``layer_loop`` picks the scan on CPU.)
  """
  kept: dict = {}

  @jax.custom_vjp
  def call(carry, inputs, inv):
    return layer(carry, inputs, inv)

  def call_fwd(carry, inputs, inv):
    masks = [[_differentiable(x) for x in xs] for xs in (carry, inputs, inv)]
    outs, vjp = _layer_vjp(layer, policy, (carry, inputs, inv), masks)
    leaves, tree = jax.tree.flatten(vjp)
    is_array = [isinstance(x, (jax.Array, np.ndarray)) for x in leaves]
    # A Python scalar among the VJP's leaves is the same in the backward pass.
    kept.update(tree=tree, masks=masks, is_array=is_array,
                constants=[None if a else x for x, a in zip(leaves, is_array, strict=True)])
    return outs, [x for x, a in zip(leaves, is_array, strict=True) if a]

  def call_bwd(arrays, cts):
    masks = kept["masks"]
    if len(arrays) != sum(kept["is_array"]):
      raise PlanError(
          f"autopar: remat traced a layer's forward pass with a different structure "
          f"from the one its backward pass rebuilds ({len(arrays)} residuals against "
          f"{sum(kept['is_array'])}). This is a bug in autopar; remat='none' avoids it.")
    arrays, ct = lax.optimization_barrier((list(arrays), _take(list(cts), masks[0])))
    it = iter(arrays)
    vjp = jax.tree.unflatten(kept["tree"], [next(it) if a else c for a, c in zip(
        kept["is_array"], kept["constants"], strict=True)])
    grads = vjp(ct)
    # None: the zero cotangent of an integer input (see _zero_cotangent).
    return tuple([next(g) if d else None for d in m]
                 for g, m in zip(map(iter, grads), masks, strict=True))

  call.defvjp(call_fwd, call_bwd)
  return call


def _layer_vjp(layer: Callable, policy, args: tuple, masks: Sequence) -> tuple:
  """``layer(*args)``'s carries and the VJP of ``jax.checkpoint(layer,
  policy)`` with respect to the entries of each argument under its mask
  (None: an argument not differentiated). ``args[0]`` are the carries the
  layer takes, in the slots of those it returns."""
  diff = [i for i, m in enumerate(masks) if m is not None]
  carry_mask = masks[0]

  def f(*parts):
    full = list(args)
    for i, part in zip(diff, parts, strict=True):
      full[i] = _merge(args[i], part, masks[i])
    out = layer(*full)
    # The integer carries (positions, masks) are aux: the VJP then takes no
    # float0 cotangents, which a symbolic batch size cannot shape.
    return _take(out, carry_mask), [o for o, d in zip(out, carry_mask, strict=True) if not d]
  diff_outs, vjp, aux = jax.vjp(jax.checkpoint(f, policy=policy, prevent_cse=False),
                                *(_take(args[i], masks[i]) for i in diff), has_aux=True)
  diff_it, aux_it = iter(diff_outs), iter(aux)
  return [next(diff_it) if d else next(aux_it) for d in carry_mask], vjp


def _differentiable(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _zero_cotangent(x):
  """The cotangent of ``x`` that is zero, for a ``custom_vjp``'s backward
  rule: None (JAX's symbolic zero) for integers and keys, whose float0
  zeros cannot be made at a symbolic batch size."""
  if _differentiable(x):
    return jnp.zeros_like(x)
  return None


def _take(xs, mask):
  return [x for x, m in zip(xs, mask, strict=True) if m]


def _merge(xs, picked, mask):
  """``xs`` with the entries under ``mask`` replaced by ``picked``, in order."""
  it = iter(picked)
  return [next(it) if m else x for x, m in zip(xs, mask, strict=True)]


def _fill(xs, cts, mask):
  """Cotangents of ``xs``: ``cts`` under ``mask``, zero elsewhere."""
  it = iter(cts)
  return [next(it) if m else _zero_cotangent(x) for x, m in zip(xs, mask, strict=True)]


def _outer_value(env: dict, v):
  if isinstance(v, Literal):
    return jnp.asarray(v.val, v.aval.dtype)
  return env[v]


# -- finding the layers -----------------------------------------------------------

def find_layers(jaxpr: Jaxpr, min_count: int = 2) -> list[Stack]:
  """The stacks of repeated layers in ``jaxpr`` (see the module docstring)."""
  eqns = jaxpr.eqns
  sigs = _signatures(eqns)
  uses = _uses(jaxpr)
  out: list[Stack] = []
  ranges = [(0, len(eqns))]
  while ranges:
    lo, hi = ranges.pop()
    best = _best_stack(eqns, sigs, uses, lo, hi, min_count)
    if best is None:
      continue
    out.append(best)
    ranges += [(lo, best.start), (best.end, hi)]
  return sorted(out, key=lambda s: s.start)


def _best_stack(eqns, sigs, uses, lo, hi, min_count) -> Stack | None:
  s = sigs[lo:hi]
  n = len(s)
  if n < 2 * min_count:
    return None
  last_seen: dict = {}
  periods = collections.Counter()
  for i, x in enumerate(s):
    if x in last_seen:
      periods[i - last_seen[x]] += 1
    last_seen[x] = i
  candidates = []        # (coverage, length, run start, run length)
  for length, hits in periods.items():
    # A layer's equations that occur once in it all recur at its period;
    # the runs below check the rest.
    if hits < max(2, length // 8) or length > n // min_count:
      continue
    eq = np.concatenate([[False], s[:-length] == s[length:], [False]])
    edges = np.flatnonzero(np.diff(eq.astype(np.int8)))
    for a, b in zip(edges[::2], edges[1::2]):
      run = b - a
      count = run // length + 1
      if count >= min_count:
        candidates.append((count * length, length, lo + a, run))
  candidates.sort(key=lambda c: (-c[0], c[1]))
  for _, length, a, run in candidates[:16]:
    top = run // length + 1
    for count in range(top, max(min_count, top - 2) - 1, -1):
      for start in range(a, a + min(length, run - (count - 1) * length + 1)):
        stack = _check(eqns, uses, start, length, count)
        if stack is not None:
          return stack
  return None


def _check(eqns, uses, start, length, count) -> Stack | None:
  """The stack at (start, length, count) if its data flow is that of layers."""
  where: dict = {}           # var -> (repetition, equation, output)
  for k in range(count):
    for j in range(length):
      for o, v in enumerate(eqns[start + k * length + j].outvars):
        where[v] = (k, j, o)
  roles = None               # per (j, operand): ("in", j', o) | ("carry", j', o) | "out"
  outer = collections.defaultdict(list)  # (j, operand) -> outer var per repetition
  for k in range(count):
    mine = []
    for j in range(length):
      eqn = eqns[start + k * length + j]
      for a, v in enumerate(eqn.invars):
        w = None if isinstance(v, Literal) else where.get(v)
        if w is None:
          mine.append("out")
          outer[(j, a)].append(v)
        elif w[0] == k:
          mine.append(("in", w[1], w[2]))
        elif w[0] == k - 1:
          mine.append(("carry", w[1], w[2]))
        else:
          return None
    if k == 0:
      roles = mine
    elif k == 1:
      if any(r0 != r1 and not (r0 == "out" and r1[0] == "carry")
             for r0, r1 in zip(roles, mine, strict=True)):
        return None
      roles1 = mine
    elif mine != roles1:
      return None
  # Operands that read the previous repetition: their carry slot and the
  # value the first repetition reads in its place.
  keys = [(j, a) for j in range(length) for a in range(len(eqns[start + j].invars))]
  carry: dict = {}           # (j', o) -> initial outer var
  stacked: dict = {}         # id(template) -> (template, outer values per repetition)
  for key, r0, r1 in zip(keys, roles, roles1, strict=True):
    if r0 != "out":
      continue
    first = outer[key][0]
    if r1 != "out":          # a carry: repetition 0 reads its initial value
      slot = (r1[1], r1[2])
      if carry.setdefault(slot, first) is not first:
        return None
      continue
    per_layer = tuple(outer[key])
    if any(not _same_value(v, first) for v in per_layer):
      if stacked.setdefault(id(first), (first, per_layer))[1] != per_layer:
        return None
  if not stacked:
    return None              # nothing per layer: not a stack of layers
  # The body binds the carries' and stacked inputs' template variables to
  # its own values, so none of them may also be read as a loop invariant.
  # (Sets of ids: literals are not hashable.)
  bound = [id(v) for v in carry.values()] + list(stacked)
  invariant = {id(outer[key][0]) for key, r0, r1 in zip(keys, roles, roles1)
               if r0 == r1 == "out" and id(outer[key][0]) not in stacked}
  if len(set(bound)) < len(bound) or invariant & set(bound):
    return None
  # Values made inside may be read only by their own repetition, the next
  # one, or (the last repetition's carries) the code after the stack.
  end = start + length * count
  extra = []
  for k in range(count):
    for j in range(length):
      eqn = eqns[start + k * length + j]
      for o, v in enumerate(eqn.outvars):
        for user in uses.get(v, ()):
          if user is None or user >= end:       # read after the stack
            if k != count - 1:
              return None
            if (j, o) not in carry:
              extra.append((j, o))
          elif user < start + k * length or user >= start + (k + 2) * length:
            return None
  for slot in extra:
    carry.setdefault(slot, None)              # an output only: starts at zeros
  carry_pos = tuple(sorted(carry))
  return Stack(start=start, length=length, count=count, carry_pos=carry_pos,
               carry_init=tuple(carry[p] for p in carry_pos),
               stacked=tuple(p for _, p in stacked.values()),
               stacked_template=tuple(t for t, _ in stacked.values()))


def _same_value(a, b) -> bool:
  """The same variable, or literals of equal type and value."""
  if a is b:
    return True
  return (isinstance(a, Literal) and isinstance(b, Literal) and a.aval == b.aval and
          np.array_equal(np.asarray(a.val), np.asarray(b.val)))


def _uses(jaxpr: Jaxpr) -> dict:
  """var -> indices of the equations that read it (None: a jaxpr output)."""
  uses = collections.defaultdict(list)
  for i, eqn in enumerate(jaxpr.eqns):
    for v in eqn.invars:
      if not isinstance(v, Literal):
        uses[v].append(i)
  for v in jaxpr.outvars:
    if not isinstance(v, Literal):
      uses[v].append(None)
  return uses


def _signatures(eqns) -> np.ndarray:
  ids: dict = {}
  memo: dict = {}
  out = np.empty(len(eqns), np.int64)
  for i, eqn in enumerate(eqns):
    if eqn.primitive.name in CUSTOM_DERIVATIVES:
      params = (("rules", derivative_key(eqn)),)
    else:
      params = tuple((k, _param_key(p, memo)) for k, p in sorted(eqn.params.items()))
    key = (eqn.primitive.name,
           tuple(_operand_key(v) for v in eqn.invars),
           tuple(_aval_key(v.aval) for v in eqn.outvars),
           params)
    out[i] = ids.setdefault(key, len(ids))
  return out


# Calls whose derivative is a rule of the user's (jax.nn.relu, softmax, ...).
CUSTOM_DERIVATIVES = ("custom_jvp_call", "custom_vjp_call")


def derivative_key(eqn) -> tuple:
  """What a custom-derivative call computes, its rules included: the jaxpr
  of its VJP (primal and backward pass), with the values of the constants it
  closes over.

  Each layer's call holds its rules in Python objects of its own (a relu in
  every layer of a loop has its own JVP thunk), so comparing the objects
  would tell every layer apart; comparing what the rules compute merges the
  layers that compute alike and keeps apart those whose rules differ (say,
  two custom_vjp functions, or one closing over another constant).
  """
  params = eqn.primitive.get_bind_params(eqn.params)

  def call(*xs):
    with eqn.ctx.manager:
      out = eqn.primitive.bind(*xs, **params)
    return out if eqn.primitive.multiple_results else [out]

  def vjp(xs, cts):
    out, back = jax.vjp(call, *xs)
    return out, back(cts)

  ins = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
  cts = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.outvars]
  try:
    closed = jax.make_jaxpr(vjp)(ins, cts)
  except Exception:   # noqa: BLE001 - a rule that cannot be traced alone: itself
    return ("opaque", id(eqn))
  consts = tuple((np.asarray(c).dtype.str, np.asarray(c).shape,
                  np.asarray(c).tobytes()) if isinstance(c, (np.ndarray, jax.Array))
                 else repr(c) for c in closed.consts)
  return (str(closed.jaxpr), consts)


def _aval_key(aval) -> Any:
  return (getattr(aval, "shape", ()), str(getattr(aval, "dtype", "")),
          getattr(aval, "weak_type", False))


def _operand_key(v) -> Any:
  # A literal matches by type alone: one that differs between layers (a
  # layer's index or RNG fold-in constant) is scanned over like a weight.
  if isinstance(v, Literal):
    return ("lit", _aval_key(v.aval))
  return _aval_key(v.aval)


def _param_key(p, memo) -> Any:
  if isinstance(p, (ClosedJaxpr, Jaxpr)):
    got = memo.get(id(p))
    if got is None:
      consts = tuple(id(c) for c in p.consts) if isinstance(p, ClosedJaxpr) else ()
      got = memo[id(p)] = (p, ("jaxpr", str(p), consts))   # p: keeps its id unique
    return got[1]
  if isinstance(p, (tuple, list)):
    return tuple(_param_key(x, memo) for x in p)
  if callable(p) and not isinstance(p, type):
    # A custom derivative rule: the same Python function in every layer.
    f = getattr(p, "f", p)
    return ("fn", getattr(f, "__module__", ""), getattr(f, "__qualname__", type(f).__name__))
  try:
    hash(p)
    return p
  except TypeError:
    return ("repr", type(p).__name__, repr(p))
