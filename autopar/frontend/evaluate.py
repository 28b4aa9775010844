"""Evaluate a jaxpr under a plan's rules: the values the plan decided
pinned to their specs, random draws given this device's rows of the whole
batch's draw, debug callbacks run once, and chosen equations evaluated in
place of their primitive; inside scan, while, cond and checkpoint bodies too.

The stages ``lower.py`` builds trace their jaxprs through :func:`eval_jaxpr`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Literal, Var

from autopar import jax_compat as jc
from autopar.frontend import rng
from autopar.errors import PlanError
from autopar.frontend.hints import HINT_PRIMITIVES, spec_of
from autopar.frontend.trace import region_jaxprs

__all__ = ["DEBUG_CALLBACKS", "Rules", "check_pins", "eqn_at", "eval_jaxpr", "eval_scan", "gather_anchor",
           "gather_sites"]

# jax.debug.print / jax.debug.callback (by JAX version), run once per group.
DEBUG_CALLBACKS = ("debug_callback", "debug_print")


def eqn_at(jaxpr, path: str):
  """The equation at ``path`` (``trace.eqns_by_path``), or None."""
  eqn, where = None, jaxpr
  for depth, idx in enumerate(path.split(".")):
    if depth % 2 == 0:
      eqns = where.eqns
      eqn = eqns[int(idx)] if int(idx) < len(eqns) else None
    else:
      subs = region_jaxprs(eqn) if eqn is not None else []
      where = subs[int(idx)] if int(idx) < len(subs) else None
    if eqn is None or where is None:
      return None
  return eqn


def check_pins(constraints: dict[str, dict], jaxpr, part: str) -> None:
  """Every pin of the plan names a value of ``jaxpr`` of the spec's rank.

  The plan's fingerprint already ties it to this program; this catches a
  plan that disagrees with it anyway, so that no pin is dropped silently.
  """
  for path, pins in constraints.items():
    eqn = eqn_at(jaxpr, path)
    for j, spec in pins.items():
      values = (eqn.invars if isinstance(j, str) else eqn.outvars) if eqn else ()
      k = int(j.lstrip("inx")) if isinstance(j, str) else j
      value = values[k] if k < len(values) else None
      rank = len(getattr(value.aval, "shape", ())) if value is not None else -1
      if isinstance(j, str) and j.startswith("x"):
        rank -= 1                       # a slice of the scanned operand
      if value is None or len(spec) > rank:
        raise PlanError(
            f"autopar: the plan pins {part}/{path}/{j} to {spec}, but this "
            f"program has no such value of rank >= {len(spec)}: the plan was made "
            f"for another program. Fix: plan again for this step.")


def _inside(table: dict[str, Any], prefix: str) -> dict[str, Any]:
  """The entries of one sub-jaxpr, with ``prefix`` taken off their paths."""
  n = len(prefix)
  return {k[n:]: v for k, v in table.items() if k.startswith(prefix)}


@dataclasses.dataclass(frozen=True)
class Rules:
  """What :func:`eval_jaxpr` changes in a jaxpr, by equation path.

  Attributes:
    pins: path -> {output index, ``"in<k>"`` or ``"x<k>"``: spec}: values
      the plan decided, pinned with ``pin(value, spec)`` (``plan.plan_constraints``).
    draws: path -> ``rng.RowDraw``: random draws that must give this
      device and micro-batch its rows of the whole batch's draw; ``rows`` is
      ``(first_row, total_rows)`` then (``rng.draw``).
    once_axes: manual mesh axes over which ``jax.debug.print`` /
      ``jax.debug.callback`` run on the first device only, so that they run
      once per micro-batch, as on one device, not once per device.
    hint: applies a user's sharding hint (a ``sharding_constraint`` or
      ``reshard`` equation) in this stage: ``hint(value, spec)``; None when
      the jaxpr has no hint.
    override: top-level path -> ``f(eqn, args, rules) -> outs``, evaluating
      that equation in place of its primitive (the scans that make stacked
      gradients, ``gradstack.py``).
    trips: for the rules a scan is evaluated under (``eval_scan``): scanned
      operand index -> the spec each trip's slice enters the body in.
    quiet: ``jax.debug.print`` / ``jax.debug.callback`` do not run (a
      pass that evaluates the forward pass once more: a pipeline's first).
    gathers: top-level input -> ``f(x)`` that gathers it (a parameter
      stored split over the manual batch axes: ZeRO-3): gathered for each
      equation that reads it, once its other operands are made
      (:func:`_gathered`).
  """
  pins: dict = dataclasses.field(default_factory=dict)
  pin: Callable | None = None
  draws: dict = dataclasses.field(default_factory=dict)
  rows: tuple | None = None
  once_axes: tuple[str, ...] = ()
  hint: Callable | None = None
  override: dict = dataclasses.field(default_factory=dict)
  trips: dict = dataclasses.field(default_factory=dict)
  gathers: dict = dataclasses.field(default_factory=dict)
  quiet: bool = False

  def __bool__(self) -> bool:
    return bool(self.pins or self.draws or self.once_axes or self.hint or self.override
                or self.trips or self.gathers or self.quiet)

  def inside(self, prefix: str) -> "Rules":
    return dataclasses.replace(self, pins=_inside(self.pins, prefix),
                               draws=_inside(self.draws, prefix), override={}, trips={},
                               gathers={})


def eval_jaxpr(jaxpr, consts, args, rules: Rules, constvals=()):
  """``eval_jaxpr`` that applies ``rules``: pins the values the plan decided
  to their specs and gives random draws their rows of the whole batch's
  draw, inside scan / while / cond / checkpoint bodies too."""
  if not rules:
    return jc.eval_jaxpr(jaxpr, constvals, *consts, *args)
  env = {}

  def read(a):
    return a.val if isinstance(a, Literal) else env[a]

  for v, x in zip(jaxpr.constvars, constvals, strict=True):
    env[v] = x
  for v, x in zip(jaxpr.invars, [*consts, *args], strict=True):
    env[v] = x
  made_at = {}                      # value -> the equation that made it
  for i, eqn in enumerate(jaxpr.eqns):
    path = str(i)
    pinned = rules.pins.get(path, {})
    args = [read(a) for a in eqn.invars]
    if rules.gathers:
      args = _gathered(eqn, args, rules.gathers, made_at, env)
    args = [rules.pin(x, pinned[f"in{k}"]) if f"in{k}" in pinned else x
            for k, x in enumerate(args)]
    name = eqn.primitive.name
    inner = rules.inside(f"{i}.") if name in _REGION_EVAL or path in rules.override \
        else None
    if inner is not None and name == "scan":
      inner = dataclasses.replace(inner, trips={
          int(j[1:]): spec for j, spec in pinned.items()
          if isinstance(j, str) and j.startswith("x")})
    if path in rules.override:
      outs = rules.override[path](eqn, args, inner)
    elif inner:
      outs = _REGION_EVAL[name](eqn, args, inner)
    elif path in rules.draws:
      outs = rng.draw(eqn, path, rules.draws[path], args[0], *rules.rows)
    elif name in DEBUG_CALLBACKS and rules.quiet:
      outs = []
    elif name in DEBUG_CALLBACKS and rules.once_axes:
      outs = _on_first_device(eqn, args, rules.once_axes)
    elif name in HINT_PRIMITIVES and rules.hint is not None:
      outs = [rules.hint(args[0], spec_of(eqn))]
    else:
      params = eqn.primitive.get_bind_params(eqn.params)
      # The equation's name stack (``transpose(jvp(...))``) goes into the
      # HLO's metadata, as JAX's eval_jaxpr puts it (hlo.py reads it).
      name_stack = jc.current_name_stack() + eqn.source_info.name_stack
      with jc.user_context(eqn.source_info.traceback,
                               name_stack=name_stack), eqn.ctx.manager:
        ans = eqn.primitive.bind(*args, **params)
      outs = ans if eqn.primitive.multiple_results else [ans]
    if pinned:
      outs = [rules.pin(x, pinned[j]) if j in pinned else x
              for j, x in enumerate(outs)]
    for v, x in zip(eqn.outvars, outs, strict=True):
      env[v] = x
      made_at[v] = i
  return [rules.gathers[a](env[a]) if isinstance(a, Var) and a in rules.gathers else read(a)
          for a in jaxpr.outvars]


def _gathered(eqn, args: list, gathers, made_at, env) -> list:
  """``args`` with each operand in ``gathers`` gathered for this equation
  alone. An optimization barrier ties the stored shards to an operand the
  pass makes, so that XLA gathers them only once that is made, and each
  reader gathers its own copy: XLA neither issues every parameter's gather
  at the start of the pass nor holds one gathered copy from the forward
  pass to the backward pass (a 4-layer MLP of 256 on 4 devices: its
  compiled peak x0.74). An equation that reads no value the pass makes
  gathers without a barrier, and so does a loop, branch or call (tied to
  an operand, a scanned GPT's layer stacks cost copies that made its step
  x1.2 of the predicted time on XLA:CPU): XLA merges such equal gathers
  into one."""
  ks = [k for k, a in enumerate(eqn.invars) if isinstance(a, Var) and a in gathers]
  if not ks:
    return args
  args = list(args)
  anchor = None if region_jaxprs(eqn) else gather_anchor(eqn, made_at)
  shards = [args[k] for k in ks]
  if anchor is not None:
    *shards, args[anchor] = lax.optimization_barrier((*shards, args[anchor]))
    # Every later reader of the operand reads the barrier's result, so that
    # XLA need not keep (copy) the operand beside it.
    env[eqn.invars[anchor]] = args[anchor]
  for k, x in zip(ks, shards, strict=True):
    args[k] = gathers[eqn.invars[k]](x)
  return args


def gather_anchor(eqn, made_at) -> int | None:
  """The operand of ``eqn`` its gathered parameters wait for
  (:func:`_gathered`): the one the pass made last (``made_at``: value ->
  the index of the equation that made it), so that the gathers run just
  before their reader."""
  made = [k for k, a in enumerate(eqn.invars) if isinstance(a, Var) and a in made_at]
  return max(made, key=lambda k: made_at[eqn.invars[k]], default=None)


def gather_sites(jaxpr, gathered) -> dict:
  """How many all-gathers of each of ``gathered`` (top-level inputs of
  ``jaxpr``) evaluating it with ``Rules.gathers`` makes: one per equation
  that reads it, but equations that wait for the same operand (or for
  none: loops, branches and calls too) make one gather (XLA merges the
  equal ones), and one more where the program gives it back as an
  output."""
  gathered = set(gathered)
  made_at: dict = {}
  sites: dict = {}
  for i, eqn in enumerate(jaxpr.eqns):
    anchor = None if region_jaxprs(eqn) else gather_anchor(eqn, made_at)
    wait = None if anchor is None else eqn.invars[anchor]
    for a in eqn.invars:
      if isinstance(a, Var) and a in gathered:
        sites.setdefault(a, set()).add(wait)
    made_at.update((o, i) for o in eqn.outvars)
  out = {v: len(w) for v, w in sites.items()}
  for a in jaxpr.outvars:
    if isinstance(a, Var) and a in gathered:
      out[a] = out.get(a, 0) + 1
  return out


def _on_first_device(eqn, args, axes):
  """Runs a debug callback on the first device along ``axes`` only."""
  params = eqn.primitive.get_bind_params(eqn.params)

  def run(*xs):
    with eqn.ctx.manager:
      eqn.primitive.bind(*xs, **params)
    return ()
  lax.cond(lax.axis_index(axes) == 0, run, lambda *xs: (), *args)
  return []


def _eval_closed(closed, args, rules: Rules):
  return eval_jaxpr(closed.jaxpr, (), args, rules, constvals=closed.consts)


def _carry_pins(closed, ncar: int, body: Rules) -> list:
  """The spec the plan gives each carry where the body makes it (None: not
  pinned). Pinning the carry entering the body to it as well keeps XLA
  from holding the loop's carry in another sharding, which it would
  reshard at every trip."""
  made = {}
  for i, e in enumerate(closed.jaxpr.eqns):
    for j, v in enumerate(e.outvars):
      made[v] = body.pins.get(str(i), {}).get(j)
  return [made.get(v) if isinstance(v, Var) else None
          for v in closed.jaxpr.outvars[:ncar]]


def eval_scan(eqn, args, rules: Rules, folds=()):
  """A scan under ``rules`` (the scan's own: its body's are
  ``rules.inside("0.")``; ``rules.trips`` pins each trip's slices).

  ``folds``: ``(out, f, state)`` per stacked output ``out`` (an index among
  the scan's outputs, one of its ys) folded as each trip makes its slice:
  ``f(state, k, y_k) -> (state, emitted)`` with ``k`` the slice's index;
  ``out`` is then the emitted slices stacked, or the final state when
  ``f`` emits None (``gradstack.py``).
  """
  p = eqn.params
  nc, ncar = jc.scan_counts(p)
  consts, init, xs = args[:nc], args[nc:nc + ncar], args[nc + ncar:]
  body = rules.inside("0.")
  pins = _carry_pins(p["jaxpr"], ncar, body) if body.pin is not None else [None] * ncar
  trips = [rules.trips.get(k) for k in range(nc + ncar, len(args))]

  def step(carry, x):
    carry = [c if s is None else body.pin(c, s) for c, s in zip(carry, pins, strict=True)]
    x = [a if s is None else body.pin(a, s) for a, s in zip(x, trips, strict=True)]
    outs = _eval_closed(p["jaxpr"], [*consts, *carry, *x], body)
    return outs[:ncar], outs[ncar:]

  def folding_step(carry, x):
    (carry, states), (k, x) = carry, x
    carry, ys = step(carry, x)
    states = list(states)
    for j, (out, f, _) in enumerate(folds):
      states[j], ys[out - ncar] = f(states[j], k, ys[out - ncar])
    return (carry, states), ys

  opts = dict(length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
  if not folds:
    carry, ys = lax.scan(step, list(init), list(xs), **opts)
    return [*carry, *ys]
  (carry, states), ys = lax.scan(folding_step, (list(init), [st for _, _, st in folds]),
                                 (jnp.arange(p["length"]), list(xs)), **opts)
  for (out, _, _), state in zip(folds, states, strict=True):
    if ys[out - ncar] is None:
      ys[out - ncar] = state
  return [*carry, *ys]


def _while(eqn, args, rules: Rules):
  p = eqn.params
  cn, bn = p["cond_nconsts"], p["body_nconsts"]
  cconsts, bconsts, init = args[:cn], args[cn:cn + bn], args[cn + bn:]
  body = rules.inside("1.")

  def cond(carry):
    return jc.eval_jaxpr(p["cond_jaxpr"].jaxpr, p["cond_jaxpr"].consts,
                         *cconsts, *carry)[0]

  def step(carry):
    return _eval_closed(p["body_jaxpr"], [*bconsts, *carry], body)
  return list(lax.while_loop(cond, step, list(init)))


def _cond(eqn, args, rules: Rules):
  index, ops = args[0], args[1:]
  def branch(b, closed):
    inner = rules.inside(f"{b}.")
    return lambda *xs: _eval_closed(closed, list(xs), inner)
  return list(lax.switch(index, [branch(b, c) for b, c in
                                 enumerate(eqn.params["branches"])], *ops))


def _checkpoint(eqn, args, rules: Rules):
  """The remat body under the rules, re-bound as the same ``checkpoint``
  primitive (same policy, same ``differentiated`` flag)."""
  body = rules.inside("0.")
  jaxpr = eqn.params["jaxpr"]
  closed = jax.make_jaxpr(lambda *xs: eval_jaxpr(jaxpr, (), xs, body))(
      *[jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in jaxpr.invars])
  new = jc.convert_constvars_jaxpr(closed.jaxpr)
  params = dict(eqn.params, jaxpr=new)
  with eqn.ctx.manager:
    return eqn.primitive.bind(*closed.consts, *args, **params)


_REGION_EVAL = {"scan": eval_scan,
                "while": _while, "cond": _cond,
                "remat2": _checkpoint}        # remat2: jax.checkpoint
