"""One micro-batch's gradient computation, as the pipeline cuts it.

``build_program`` turns a step traced for a pipeline (``capture.py``) and
split with its loss function inlined (``loss.inline_loss``: the view) into
:class:`Program`: the jaxpr ``P`` of one micro-batch's forward pass, with the
loss function's ``autopar_backward`` call taken out. The gradients are then
the cotangents of ``P``'s *roots* (the loss function's differentiated
inputs) when ``P``'s *seeded* outputs, the loss's entries (``loss.py``: its
reductions over the rows and the row-free values it reads that depend on the
parameters), are given the whole batch's cotangents::

    view:                                      P:
      a = autopar_loss_input[diff] w     ->      ... F's equations on a, x ...
      ... F's equations on a, x ...              in (<entries>, <the other outputs>)
      g = autopar_backward[F] w x 1.0            roots: a (value: leaf w)
      in (g, l)

A root's value is the argument leaf it reads (the usual case: the loss
function's parameters), or for a differentiated value computed in the step,
``u + eps`` with a zero input ``eps`` whose cotangent is the gradient.

The analyses the stage construction needs are here too:

* *floating* equations: those that read no batch data (a cast of the
  weights, a causal mask). They never cross a stage boundary: each stage
  that needs one computes it (``stages.py``).
* *cuts*: a position between two equations is a valid stage boundary when
  every value computed from the batch that crosses it holds the batch's rows
  in some dimension (so each device can send its rows; a reduction over the
  rows, such as an auxiliary loss summed across layers, cannot cross).
* *layers* (``layers.py``): where the repeated blocks of the forward pass
  start (the remat pass's ``find_layers``), the user's
  ``mark_pipeline_boundary`` calls, or cuts of balanced flops.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Var

from autopar import jax_compat as jc
from autopar.errors import MarkerError
from autopar.frontend.loss import LossGradient, loss_input_p
from autopar.frontend.capture import backward_p, boundary_p
from autopar.frontend.split import dce
from autopar.frontend.rows import RowOracle
from autopar.frontend.retype import jaxprs_in
from autopar.frontend.trace import LeafInfo

__all__ = ["Program", "Root", "build_program", "find_cuts", "sizer", "unlike", "matching",
           "same_value"]


@dataclasses.dataclass(frozen=True)
class Root:
  """A differentiated input of the loss function.

  ``var``: the root variable in ``P`` (an input). ``leaf``: the argument
  leaf index its value is (or None); otherwise it is a zero ``eps`` that
  ``P`` adds to the value the loss function was given.
  """
  var: Var
  leaf: int | None


@dataclasses.dataclass(frozen=True)
class Program:
  """The forward pass of one micro-batch (see the module docstring).

  Attributes:
    jaxpr: ``P``. Invars: the step's consts and argument leaves (as
      ``compute_grad``'s), then the roots. Outvars: the seeded outputs, then
      ``compute_grad``'s outputs after the gradients (the reductions over the
      rows, then the per-micro-batch outputs), then the ``num_first``
      first-pass outputs. Constvars: the loss function's own constants
      (values in ``consts``).
    consts: values of ``jaxpr.constvars``.
    num_step_consts: how many leading invars are the step's consts.
    leaves: the step's argument leaves (``trace.LeafInfo``), in invar order
      after the consts.
    roots: the roots, in invar order after the leaves.
    grad_roots: per gradient of the step (marker order), its root's index.
    num_seeded: how many of the outputs are seeded: the loss's entries
      (``loss.py``), whose cotangents the runtime gives per step.
    boundaries: positions (equation indices of ``P``) of the user's
      ``mark_pipeline_boundary`` calls.
    fn_name: the step's name, for messages.
    num_first: how many of the outputs (the last) are what the loss's
      cotangents read that the stages compute (``loss.LossValues``: its
      sums, then its inputs), where a first pass through the stages
      computes them before the schedule's backward passes.
  """
  jaxpr: Jaxpr
  consts: tuple
  num_step_consts: int
  leaves: tuple[LeafInfo, ...]
  roots: tuple[Root, ...]
  grad_roots: tuple[int, ...]
  num_seeded: int
  boundaries: tuple[int, ...]
  fn_name: str = "step"
  num_first: int = 0

  @property
  def first_outputs(self) -> tuple[int, ...]:
    """The indices of the first-pass outputs."""
    n = len(self.jaxpr.outvars)
    return tuple(range(n - self.num_first, n))

  @property
  def eqns(self):
    return self.jaxpr.eqns

  @property
  def leaf_vars(self) -> list[Var]:
    n = self.num_step_consts
    return self.jaxpr.invars[n:n + len(self.leaves)]

  @property
  def root_vars(self) -> list[Var]:
    return [r.var for r in self.roots]

  def analysis(self, oracle: RowOracle | None = None) -> "Analysis":
    return Analysis.of(self, oracle)


def _find(jaxpr, prim, where="") -> list[str]:
  """Paths of the equations of ``prim`` anywhere in ``jaxpr``."""
  out = []
  for i, eqn in enumerate(jaxpr.eqns):
    if eqn.primitive is prim:
      out.append(f"{where}{i}")
    for k, sub in enumerate(jaxprs_in(eqn)):
      out.extend(_find(sub, prim, f"{where}{i}.{k}."))
  return out


def build_program(view: ClosedJaxpr, *, leaves: Sequence[LeafInfo], grads: Sequence,
                  outs: Sequence, loss: LossGradient, first: Sequence = (),
                  fn_name: str = "step") -> Program:
  """``P`` of a step traced under ``capture.capture_mode`` and split for a
  pipeline: ``view`` is the step with the loss function inlined
  (``loss.inline_loss``; its consts are leading inputs of ``P``), ``grads``
  its gradients (the marker's operands), ``outs`` what ``compute_grad``
  returns after them (the reductions over the rows, the per-micro-batch
  outputs), ``loss`` how the loss's entries are seeded (``loss.py``): they
  are ``P``'s seeded outputs; ``first``: values of the view a first pass
  computes (``Program.num_first``).
  """
  jaxpr = jc.convert_constvars_jaxpr(view.jaxpr)
  num_consts = len(view.consts)
  bwd_at = [i for i, e in enumerate(jaxpr.eqns) if e.primitive is backward_p]
  # (The backward call holds the loss function again: its markers do not count.)
  forward = jaxpr.replace(eqns=[e for e in jaxpr.eqns if e.primitive is not backward_p])
  bad = [p for p in _find(forward, boundary_p) if "." in p]
  if bad:
    raise MarkerError(
        f"{fn_name}: autopar.mark_pipeline_boundary() is called inside a loop or "
        f"under a condition (lax.scan / fori_loop / while_loop / cond; equation "
        f"{bad[0]} of the step), where no stage can end. Fix: call it at the loss "
        f"function's top level, between layers (unroll the loop of layers, or mark "
        f"the boundaries around it).")
  if len(bwd_at) != 1 or loss.values is None:
    raise MarkerError(
        f"{fn_name}: PipeshardParallel needs the gradients from exactly one "
        f"autopar.value_and_grad / autopar.grad / autopar.filter_value_and_grad "
        f"call at the step's top level (jax.grad inside the step is not cut into "
        f"stages). Fix: compute the gradients with one autopar.value_and_grad call.")
  eb = jaxpr.eqns[bwd_at[0]]
  invars = list(jaxpr.invars)
  leaf_index = {v: k for k, v in enumerate(invars[num_consts:])}

  # Roots: the loss function's differentiated inputs (their bindings).
  roots: list[Root] = []
  sub: dict = {}
  eqns = []
  for i, eqn in enumerate(jaxpr.eqns):
    if i == bwd_at[0]:
      continue
    if eqn.primitive is loss_input_p:
      (u,), (fv,) = eqn.invars, eqn.outvars
      if not eqn.params["diff"]:
        sub[fv] = u if isinstance(u, Literal) else sub.get(u, u)
      elif isinstance(u, Var) and u in leaf_index:
        roots.append(Root(fv, leaf_index[u]))
      else:
        eps = Var(fv.aval)
        eqns.append(jc.new_jaxpr_eqn(
            [u if isinstance(u, Literal) else sub.get(u, u), eps], [fv],
            jc.add_p, {}, jc.no_effects, eqn.source_info, eqn.ctx))
        roots.append(Root(eps, None))
      continue
    if any(not isinstance(a, Literal) and a in sub for a in eqn.invars):
      eqn = eqn.replace(invars=[a if isinstance(a, Literal) else sub.get(a, a)
                                for a in eqn.invars])
    eqns.append(eqn)

  # Each gradient is the cotangent of one root (in the order of the
  # differentiated inputs, as the backward call returns them).
  by_grad_var = dict(zip(eb.outvars, range(len(roots)), strict=True))
  grad_roots = []
  for j, g in enumerate(grads):
    if not isinstance(g, Var) or g not in by_grad_var:
      raise MarkerError(
          f"{fn_name}: gradient {j} is not the loss function's gradient as "
          f"autopar.value_and_grad returns it (it is computed from it, or from "
          f"elsewhere); PipeshardParallel needs the gradients straight from the "
          f"call. Fix: transform the gradients after autopar.value_and_grad "
          f"returns them, in the update.")
    grad_roots.append(by_grad_var[g])

  read = lambda v: v if isinstance(v, Literal) else sub.get(v, v)
  outvars = ([read(v) for v in loss.values.entries] + [read(v) for v in outs] +
             [read(v) for v in first])
  program = Jaxpr([], [*invars, *(r.var for r in roots)], outvars, eqns,
                  jaxpr.effects, jaxpr.debug_info)
  program, boundaries = _dce_with_boundaries(program)
  return Program(jaxpr=program, consts=(), num_step_consts=num_consts,
                 leaves=tuple(leaves), roots=tuple(roots), grad_roots=tuple(grad_roots),
                 num_seeded=len(loss.values.entries), boundaries=boundaries,
                 fn_name=fn_name, num_first=len(first))


def _dce_with_boundaries(jaxpr: Jaxpr) -> tuple[Jaxpr, tuple[int, ...]]:
  """``jaxpr`` without unneeded equations and without its boundary markers,
  and where the markers were (the index of the equation after each)."""
  kept = dce(jaxpr, keep=lambda eqn: eqn.primitive is boundary_p).eqns
  eqns, cuts = [], []
  for eqn in kept:
    if eqn.primitive is boundary_p:
      if not cuts or cuts[-1] != len(eqns):
        cuts.append(len(eqns))
    else:
      eqns.append(eqn)
  cuts = tuple(c for c in cuts if 0 < c < len(eqns))
  return jaxpr.replace(eqns=eqns, effects=jc.make_jaxpr_effects(
      jaxpr.constvars, jaxpr.invars, jaxpr.outvars, eqns)), cuts


# -- analyses ---------------------------------------------------------------------

@dataclasses.dataclass
class Analysis:
  """What the stage construction reads of ``P`` (see the module docstring).

  Attributes:
    on_batch: variables computed from the batch leaves.
    on_roots: variables computed from the roots.
    floating: equation indices that read no batch data (and have no effect).
    producer: variable -> index of the equation that makes it.
    last_read: variable -> the last equation index that reads it.
    rows: variable -> its row dimensions (a list; [] none; None unknown).
    oracle: what told them (``rows.RowOracle``): symbolic, or ``P``
      paired with itself traced at another size.
  """
  program: Program
  on_batch: set
  on_roots: set
  floating: set
  producer: dict
  last_read: dict
  rows: dict
  oracle: RowOracle | None = None

  @classmethod
  def of(cls, program: Program, oracle: RowOracle | None) -> "Analysis":
    jaxpr = program.jaxpr
    batch = {v for v, l in zip(program.leaf_vars, program.leaves, strict=True)
             if l.is_batch}
    on_batch, on_roots = set(batch), set(program.root_vars)
    floating, producer, last_read = set(), {}, {}
    for i, eqn in enumerate(jaxpr.eqns):
      ins = [v for v in eqn.invars if not isinstance(v, Literal)]
      if any(v in on_batch for v in ins):
        on_batch.update(eqn.outvars)
      elif not (eqn.effects and jc.has_effects(eqn)):
        floating.add(i)
      if any(v in on_roots for v in ins):
        on_roots.update(eqn.outvars)
      for v in ins:
        last_read[v] = i
      for v in eqn.outvars:
        producer[v] = i
    rows = {}
    if oracle is not None:
      for eqn in jaxpr.eqns:
        for v in eqn.outvars:
          if v in on_batch:
            rows[v] = oracle.dims(v)
      for v in batch:
        rows[v] = oracle.dims(v)
    return cls(program, on_batch, on_roots, floating, producer, last_read, rows, oracle)

  def is_tangent(self, v) -> bool:
    """Whether ``v`` carries a derivative: computed from a root, inexact."""
    return (v in self.on_roots and
            jnp.issubdtype(v.aval.dtype, jnp.inexact))

  def row_dim(self, v) -> int | None:
    dims = self.rows.get(v)
    return dims[0].dim if dims else None

  def crossing(self, position: int) -> list[Var]:
    """Values made by non-floating equations before ``position`` and read at
    or after it (the activations a cut there sends)."""
    out = []
    for v, i in self.producer.items():
      if (i < position and i not in self.floating and
          self.last_read.get(v, -1) >= position):
        out.append(v)
    return out


def find_cuts(analysis: Analysis) -> tuple[list[bool], dict[int, str]]:
  """Per position ``p`` (0..len(eqns)), whether a stage boundary may be cut
  there, and for the positions where not, why.

  A cut is valid when every value that crosses it holds the batch's rows in
  some dimension (``Analysis.crossing``); outputs of ``P`` do not cross (the
  stage that makes one keeps it)."""
  eqns = analysis.program.eqns
  n = len(eqns)
  bad = np.zeros(n + 2, dtype=np.int64)        # a difference array over positions
  first_bad: dict[int, Any] = {}
  for v, i in analysis.producer.items():
    if i in analysis.floating or v not in analysis.on_batch or analysis.rows.get(v):
      continue
    last = analysis.last_read.get(v, -1)
    if last > i:
      bad[i + 1] += 1
      bad[last + 1] -= 1
      first_bad.setdefault(i + 1, v)
  live = np.cumsum(bad)[:n + 1]
  ok = [bool(live[p] == 0) for p in range(n + 1)]
  ok[0] = ok[n] = True
  why = {p: ("a value computed from the batch that holds none of its rows (a "
             "reduction over the rows, say an auxiliary loss summed across layers) "
             "would cross it") for p in range(n + 1) if not ok[p]}
  return ok, why


def sizer(rows: int):
  """``size(shape)`` for shapes that may hold the symbolic row count."""
  from autopar.frontend.rows import ROWS_NAME
  memo: dict = {}

  def dim(d):
    if type(d) is int:
      return d
    v = memo.get(d)
    if v is None:
      v = memo[d] = jc.evaluate_dim(d, {ROWS_NAME: rows})
    return v

  def size(shape, dims=False):
    shape = tuple(dim(d) for d in shape)
    return shape if dims else math.prod(shape)
  return size


# -- P traced at two concrete sizes ---------------------------------------------------

def unlike(a: Program, b: Program, oracle) -> str:
  """Why ``b`` (``P`` traced at another concrete size than ``a``) is not
  ``a``'s program at its size, or "": the same equations in the same order,
  inside calls and loops too, with the same settings where their shapes are
  the same, the same literals except where ``oracle`` (``a`` paired with a
  third size) says an equation's literal is the batch's size
  (``rows.RowOracle.size_dependent``) or its shapes differ, and the same
  values as its outputs."""
  if (len(a.jaxpr.invars), len(a.jaxpr.outvars)) != (len(b.jaxpr.invars),
                                                     len(b.jaxpr.outvars)):
    return (f"{len(a.jaxpr.invars)} inputs and {len(a.jaxpr.outvars)} outputs against "
            f"{len(b.jaxpr.invars)} and {len(b.jaxpr.outvars)}")
  why = _unlike_eqns(a.eqns, b.eqns, oracle, "")
  if why:
    return why
  where_a, where_b = _made_at(a.jaxpr), _made_at(b.jaxpr)
  for k, (x, y) in enumerate(zip(a.jaxpr.outvars, b.jaxpr.outvars)):
    if isinstance(x, Literal) != isinstance(y, Literal) or (
        not isinstance(x, Literal) and where_a.get(x) != where_b.get(y)):
      return f"output {k} of its forward program is another value"
  return ""


def _made_at(jaxpr) -> dict:
  out = {v: ("input", k) for k, v in enumerate(jaxpr.invars)}
  for i, e in enumerate(jaxpr.eqns):
    out.update({v: (i, k) for k, v in enumerate(e.outvars)})
  return out


def _unlike_eqns(ea, eb, oracle, where: str) -> str:
  if len(ea) != len(eb):
    return (f"{len(ea)} equations against {len(eb)}" +
            (f" inside equation {where[:-1]}" if where else ""))
  for i, (e, f) in enumerate(zip(ea, eb)):
    at = f"equation {where}{i} ('{e.primitive.name}')"
    if e.primitive is not f.primitive or (len(e.invars), len(e.outvars)) != (
        len(f.invars), len(f.outvars)):
      return f"equation {where}{i} is '{e.primitive.name}' against '{f.primitive.name}'"
    shaped = [getattr(v.aval, "shape", None) for v in e.outvars] == \
        [getattr(v.aval, "shape", None) for v in f.outvars]
    for x, y in zip(e.invars, f.invars):
      if isinstance(x, Literal) != isinstance(y, Literal):
        return f"{at} reads a constant at one size only"
      if isinstance(x, Literal) and shaped and not (not where and oracle.size_dependent(e)) \
          and not same_value(x.val, y.val):
        return f"{at} reads the constant {x.val} against {y.val}"
    if shaped:
      for name, x in e.params.items():
        y = f.params.get(name)
        if _plain(x) and _plain(y) and x != y:
          return f"{at} has {name}={x!r} against {y!r}"
    subs_a, subs_b = jaxprs_in(e), jaxprs_in(f)
    if len(subs_a) != len(subs_b):
      return f"{at} holds {len(subs_a)} programs against {len(subs_b)}"
    for k, (x, y) in enumerate(zip(subs_a, subs_b)):
      why = _unlike_eqns(x.eqns, y.eqns, oracle, f"{where}{i}.{k}.")
      if why:
        return why
  return ""


def _plain(x) -> bool:
  """A setting compared between two traces: numbers, strings, flags and
  tuples of them (not functions, jaxprs or shardings)."""
  if isinstance(x, (bool, int, float, str, type(None))):
    return True
  return isinstance(x, tuple) and all(_plain(y) for y in x)


def same_value(x, y) -> bool:
  """Whether two constants are equal (shape, dtype, values; a typed PRNG
  key's by its data)."""
  if x is y:
    return True
  try:
    if all(getattr(v, "dtype", None) is not None and
           jnp.issubdtype(v.dtype, jax.dtypes.prng_key) for v in (x, y)):
      x, y = jax.random.key_data(x), jax.random.key_data(y)
    x, y = np.asarray(x), np.asarray(y)
    return x.shape == y.shape and x.dtype == y.dtype and bool(np.all(x == y))
  except Exception:  # noqa: BLE001 - an opaque constant: equal only if the same object
    return False


def matching(a: Program, b: Program) -> dict:
  """``a``'s variables -> ``b``'s, by position (``unlike(a, b)`` is "")."""
  out = dict(zip(a.jaxpr.invars, b.jaxpr.invars, strict=True))
  for e, f in zip(a.eqns, b.eqns, strict=True):
    out.update(zip(e.outvars, f.outvars, strict=True))
  return out

