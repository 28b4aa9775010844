"""Rewriting a traced jaxpr's types.

Two passes over a step's jaxpr (and its sub-jaxprs) that give variables new
types and leave the program as it is:

* :class:`Instantiator` writes a jaxpr traced at a symbolic batch size
  (``trace.trace_step_any_batch``) out at a concrete size, in one pass over
  the equations instead of a new trace.
* :func:`without_meshes` takes out the meshes that a sharding constraint or a
  ``jax.set_mesh`` context put into the types while the step was traced,
  keeping only the user's hints (see ``hints.py``).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, Literal, Var
from jax.sharding import NamedSharding

from autopar import jax_compat as jc

__all__ = ["Instantiator", "without_meshes", "jaxprs_in", "has_hints", "primitive_names",
           "HOST_CALLBACKS", "lowers_with_devices"]


# Host callbacks: JAX lowers one only in a computation split by hand over
# every mesh axis or none.
HOST_CALLBACKS = ("pure_callback", "io_callback", "debug_callback", "debug_print")


def primitive_names(jaxpr, seen=None) -> set[str]:
  """The names of the primitives in ``jaxpr`` and its sub-jaxprs."""
  seen = set() if seen is None else seen
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    for sub in jaxprs_in(eqn):
      if id(sub) not in seen:
        seen.add(id(sub))
        names |= primitive_names(sub, seen)
  return names


def lowers_with_devices(jaxpr) -> bool:
  """Whether ``jaxpr`` holds an op JAX lowers with the devices in hand (a
  host callback, a ``custom_partitioning`` op), which it lowers in a
  computation manual over every mesh axis or none, not some."""
  return bool(primitive_names(jaxpr) & {*HOST_CALLBACKS, "custom_partitioning"})


def jaxprs_in(eqn) -> list:
  """The jaxprs in ``eqn``'s params (as ``jaxprs_in_params``; this runs per
  equation of a large step, so it checks types without a generator)."""
  out = []
  for val in eqn.params.values():
    for v in (val if isinstance(val, tuple) else (val,)):
      if isinstance(v, Jaxpr):
        out.append(v)
      elif isinstance(v, ClosedJaxpr):
        out.append(v.jaxpr)
  return out


class _Retyper:
  """Gives each variable its new type (:meth:`aval`) once; a literal is
  rewritten by :meth:`literal`."""

  def __init__(self):
    self.vars: dict = {}

  def aval(self, aval):
    raise NotImplementedError

  def literal(self, v):
    return v

  def var(self, v):
    if type(v) is Literal:
      return self.literal(v)
    w = self.vars.get(v)
    if w is None:
      aval = self.aval(v.aval)
      w = v if aval is v.aval else DropVar(aval) if isinstance(v, DropVar) else Var(aval)
      self.vars[v] = w
    return w


# -- written out at a concrete batch size ----------------------------------------

def _is_symbolic(d) -> bool:
  return jc.is_symbolic_dim(d)


# What _Instantiator.value does with a param, by the param's type
# (process-wide: one entry per parameter type JAX uses).
_OPAQUE, _DIM, _JAXPR, _SEQ, _AVAL = range(5)
_KINDS: dict[type, int] = {}


def _kind(t: type) -> int:
  k = _KINDS.get(t)
  if k is None:
    k = _KINDS[t] = (
        _JAXPR if issubclass(t, (ClosedJaxpr, Jaxpr)) else
        _SEQ if issubclass(t, (tuple, list)) else
        _AVAL if issubclass(t, jc.ShapedArray) else           # a callback's result
        _DIM if getattr(t, "dimension_as_value", None) is not None else  # see
        _OPAQUE)                                             # is_symbolic_dim
  return k


class Instantiator(_Retyper):
  """Writes a symbolic-shape jaxpr out at concrete sizes (``env``).

  It runs once per batch size over every equation of a large step, so it
  looks each thing up once: a param's kind by its type, a variable's
  replacement by the variable, an aval's by the aval.
  """

  def __init__(self, env):
    super().__init__()           # self.vars: old var -> new var, literal, or itself
    self.env = env
    self.jaxprs: dict = {}       # id(sub-jaxpr) -> instantiated
    self.avals: dict = {}        # symbolic aval -> concrete aval
    self.eqns: dict = {}         # id(equation) -> (instantiated, equation)

  def value(self, v):
    """A param (a shape, dimension numbers, a sub-jaxpr...) made concrete."""
    k = _KINDS.get(type(v))
    if k is None:
      k = _kind(type(v))
    if k == _OPAQUE:
      return v
    if k == _DIM:
      return jc.evaluate_dim(v, self.env)
    if k == _AVAL:
      return self.aval(v)
    if k == _SEQ:
      if all(_KINDS.get(t) == _OPAQUE for t in set(map(type, v))):
        return v                         # e.g. a tuple of ints
      items = [self.value(x) for x in v]
      if all(a is b for a, b in zip(items, v)):
        return v
      if hasattr(v, "_fields"):          # a NamedTuple (dimension numbers)
        return type(v)(*items)
      return type(v)(items)
    out = self.jaxprs.get(id(v))
    if out is None:
      out = (ClosedJaxpr(self.jaxpr(v.jaxpr), v.consts) if isinstance(v, ClosedJaxpr)
             else self.jaxpr(v))
      self.jaxprs[id(v)] = (out, v)       # keep v alive: its id stays unique
      return out
    return out[0]

  def aval(self, aval):
    """``aval`` at concrete sizes (itself if it has no symbolic dimension)."""
    shape = getattr(aval, "shape", ())
    if all(type(d) is int for d in shape):
      return aval
    new = self.avals.get(aval)       # equal avals: one evaluation
    if new is None:
      new = self.avals[aval] = (
          aval.update(shape=tuple(self.value(d) for d in shape))
          if any(_is_symbolic(d) for d in shape) else aval)
    return new

  def jaxpr(self, jaxpr: Jaxpr) -> Jaxpr:
    var, value, known = self.var, self.value, self.vars.get
    memo = self.eqns
    eqns = []
    for eqn in jaxpr.eqns:
      done = memo.get(id(eqn))
      if done is not None:
        eqns.append(done[0])
        continue
      if eqn.primitive.name == "dim_as_value":
        (out,) = eqn.outvars
        self.vars[out] = Literal(np.array(value(eqn.params["dim"]), out.aval.dtype),
                                 out.aval)
        continue
      params = eqn.params
      new_params = None
      for k, p in params.items():
        q = value(p)
        if q is not p:
          if new_params is None:
            new_params = dict(params)
          new_params[k] = q
      if new_params is not None and eqn.primitive.name == "custom_jvp_call":
        # The rule is a thunk that traces it at the symbolic types: its
        # jaxpr is written out at these sizes too, when it is traced.
        new_params["jvp_jaxpr_fun"] = jc.mapped_jvp_rule(
            params["jvp_jaxpr_fun"],
            lambda j, env=self.env: Instantiator(env).jaxpr(_meshless_jaxpr(j)))
      changed = new_params is not None
      invars = []
      for v in eqn.invars:
        w = v if type(v) is Literal else known(v) or var(v)
        changed = changed or w is not v
        invars.append(w)
      outvars = []
      for v in eqn.outvars:
        w = known(v) or var(v)
        changed = changed or w is not v
        outvars.append(w)
      # Unchanged: nothing symbolic in it (e.g. the optimizer's equations).
      new = eqn.replace(invars=invars, outvars=outvars,
                        params=new_params or params) if changed else eqn
      memo[id(eqn)] = (new, eqn)      # keep eqn alive: its id stays unique
      eqns.append(new)
    return Jaxpr([var(v) for v in jaxpr.constvars], [var(v) for v in jaxpr.invars],
                 [var(v) for v in jaxpr.outvars], eqns, jaxpr.effects,
                 jaxpr.debug_info)


# -- without meshes in the types ----------------------------------------------------


# Equations whose sharding params are the user's hints (hints.py): kept.
_HINTS = ("sharding_constraint", "reshard")


def _mesh_of(aval):
  sharding = getattr(aval, "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  return None if mesh is None or not getattr(mesh, "axis_names", ()) else mesh


def _literal_mesh(literal):
  """The mesh in the type of a literal's value (a constant folded while a
  mesh was in context), if any."""
  aval = getattr(literal.val, "aval", None)
  if aval is None and isinstance(literal.val, jax.Array):
    aval = jax.typeof(literal.val)
  return None if aval is None else _mesh_of(aval)


def _meshless(val):
  """A literal's value with no mesh in its type."""
  if isinstance(val, np.ndarray) and hasattr(val, "aval"):      # a TypedNdArray
    return type(val)(val.view(np.ndarray), val.aval.update(sharding=None))
  return np.asarray(val) if isinstance(val, jax.Array) else val


def without_meshes(closed: ClosedJaxpr, *, in_context: bool = False) -> ClosedJaxpr:
  """``closed`` with no mesh in its types or in its equations' sharding
  params, other than in the user's hints.

  A sharding constraint (or a ``jax.set_mesh`` context: ``in_context``)
  while the step is traced puts its mesh into the types of every value
  downstream, and JAX records it in params such as
  ``broadcast_in_dim[sharding=...]``. autopar evaluates the step again on its
  own meshes (with the batch axes manual in the gradient stages), where such
  a mesh would clash; what the user asked for stays in the hints. A step
  traced with neither is returned as it is (checked by equation name only:
  this runs on every trace of a large step).
  """
  j = closed.jaxpr
  new = _MeshStripper().jaxpr(j) if in_context else _meshless_jaxpr(j)
  return closed if new is j else ClosedJaxpr(new, closed.consts)


def _meshless_jaxpr(jaxpr: Jaxpr) -> Jaxpr:
  """``jaxpr`` with no mesh in its types but the user's hints (also a
  custom_jvp rule traced from types a mesh context gave); itself where its
  inputs carry no mesh and it holds no hint."""
  if not (any(_mesh_of(v.aval) is not None for v in (*jaxpr.constvars, *jaxpr.invars))
          or has_hints(jaxpr)):
    return jaxpr
  return _MeshStripper().jaxpr(jaxpr)


def has_hints(jaxpr) -> bool:
  """Whether ``jaxpr`` (or a jaxpr inside it) has a sharding hint."""
  return _has_hints(jaxpr, set())


def _has_hints(jaxpr, seen: set) -> bool:
  if id(jaxpr) in seen:
    return False
  seen.add(id(jaxpr))
  return any(eqn.primitive.name in _HINTS or
             any(_has_hints(sub, seen) for sub in jaxprs_in(eqn))
             for eqn in jaxpr.eqns)


class _MeshStripper(_Retyper):
  """Rewrites a jaxpr (and its sub-jaxprs) without meshes in its types."""

  def __init__(self):
    super().__init__()
    self.jaxprs: dict = {}

  def aval(self, aval):
    return aval.update(sharding=None) if _mesh_of(aval) is not None else aval

  def literal(self, v):
    aval = self.aval(v.aval)
    return v if aval is v.aval and _literal_mesh(v) is None else \
        Literal(_meshless(v.val), aval)

  def context(self, ctx):
    """``ctx`` (the config an equation was traced under) without its mesh."""
    if not getattr(ctx.cur_abstract_mesh, "axis_names", ()):
      return ctx
    return jc.eqn_context_without_mesh(ctx)

  def param(self, hint: bool, value):
    if isinstance(value, NamedSharding):
      return value if hint else None
    if isinstance(value, ClosedJaxpr):
      return ClosedJaxpr(self.jaxpr(value.jaxpr), value.consts)
    if isinstance(value, Jaxpr):
      return self.jaxpr(value)
    if isinstance(value, tuple) and any(isinstance(x, (ClosedJaxpr, Jaxpr)) for x in value):
      return tuple(self.param(hint, x) for x in value)
    return value

  def jaxpr(self, jaxpr: Jaxpr) -> Jaxpr:
    done = self.jaxprs.get(id(jaxpr))
    if done is not None:
      return done[0]
    eqns = []
    for eqn in jaxpr.eqns:
      hint = eqn.primitive.name in _HINTS
      params = {k: self.param(hint, v) for k, v in eqn.params.items()}
      eqns.append(eqn.replace(invars=[self.var(v) for v in eqn.invars],
                              outvars=[self.var(v) for v in eqn.outvars], params=params,
                              ctx=self.context(eqn.ctx)))
    out = Jaxpr([self.var(v) for v in jaxpr.constvars], [self.var(v) for v in jaxpr.invars],
                [self.var(v) for v in jaxpr.outvars], eqns, jaxpr.effects, jaxpr.debug_info)
    self.jaxprs[id(jaxpr)] = (out, jaxpr)
    return out
