"""One micro-batch's gradient computation, as the pipeline cuts it.

``build_program`` turns the ``compute_grad`` jaxpr of a step traced for a
pipeline (``capture.py``) into :class:`Program`: the jaxpr ``P`` of one
micro-batch's forward pass, with the loss function's ``autopar_forward``
call inlined and its ``autopar_backward`` call taken out. The gradients are
then the cotangents of ``P``'s *roots* (the loss function's differentiated
inputs) when ``P``'s *seeded* outputs (the loss) are given their cotangent
seeds (1.0)::

    compute_grad:                              P:
      l = autopar_forward[F] w x          ->     ... F's equations on a_w, x ...
      g = autopar_backward[F] w x 1.0            in (l, <the other outputs>)
      in (g, l)                                  roots: a_w (value: leaf w), seeds: (1.0,)

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
* *layers*: where the repeated blocks of the forward pass start (the remat
  pass's ``find_layers``), the user's ``mark_pipeline_boundary`` calls, or
  cuts of balanced flops.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np
from jax._src import core as jax_core
from jax._src.interpreters import partial_eval as pe
from jax._src.lax import lax as lax_internal
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Var

from autopar.cost_model import itemsize
from autopar.errors import InputError, MarkerError
from autopar.pipeline.capture import backward_p, boundary_p, forward_p
from autopar.remat import find_layers
from autopar.split import _dce
from autopar.rows import RowOracle
from autopar.retype import jaxprs_in
from autopar.strategies.dot import dot_flops
from autopar.trace import LeafInfo

__all__ = ["Program", "Root", "build_program", "find_cuts", "eqn_flops"]


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
      rows, then the per-micro-batch outputs). Constvars: the loss
      function's own constants (values in ``consts``).
    consts: values of ``jaxpr.constvars``.
    num_step_consts: how many leading invars are the step's consts.
    leaves: the step's argument leaves (``trace.LeafInfo``), in invar order
      after the consts.
    roots: the roots, in invar order after the leaves.
    grad_roots: per gradient of the step (marker order), its root's index.
    seeds: per seeded output, its cotangent (a numpy value).
    boundaries: positions (equation indices of ``P``) of the user's
      ``mark_pipeline_boundary`` calls.
    fn_name: the step's name, for messages.
  """
  jaxpr: Jaxpr
  consts: tuple
  num_step_consts: int
  leaves: tuple[LeafInfo, ...]
  roots: tuple[Root, ...]
  grad_roots: tuple[int, ...]
  seeds: tuple[Any, ...]
  boundaries: tuple[int, ...]
  fn_name: str = "step"

  @property
  def eqns(self):
    return self.jaxpr.eqns

  @property
  def num_seeded(self) -> int:
    return len(self.seeds)

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


def _constant(v, producers: dict):
  """The value of ``v`` if it is computed from literals alone, else None."""
  if isinstance(v, Literal):
    return np.asarray(v.val)
  eqn = producers.get(v)
  if eqn is None:
    return None
  args = [_constant(a, producers) for a in eqn.invars]
  if any(a is None for a in args) or any(
      not isinstance(d, int) for d in getattr(v.aval, "shape", ())):
    return None
  outs = eqn.primitive.bind(*args, **eqn.params)
  outs = outs if eqn.primitive.multiple_results else [outs]
  return np.asarray(outs[eqn.outvars.index(v)])


def build_program(compute: ClosedJaxpr, *, num_consts: int, leaves: Sequence[LeafInfo],
                  num_grads: int, fn_name: str = "step") -> Program:
  """``P`` of a ``compute_grad`` jaxpr traced under ``capture.capture_mode``.

  ``compute.jaxpr`` has the step's consts then its argument leaves as invars
  and the gradients first among its outvars (``split.SplitStep.compute``).
  """
  jaxpr = compute.jaxpr
  fwd_at = [i for i, e in enumerate(jaxpr.eqns) if e.primitive is forward_p]
  bwd_at = [i for i, e in enumerate(jaxpr.eqns) if e.primitive is backward_p]
  if len(fwd_at) != 1 or len(bwd_at) != 1:
    nested = _find(jaxpr, forward_p)
    if len(fwd_at) + len(bwd_at) == 0 and nested:
      raise MarkerError(
          f"{fn_name}: PipeshardParallel cuts the function given to "
          f"autopar.value_and_grad / autopar.grad into stages, but it is called "
          f"inside control flow or a nested call (equation {nested[0]}). Fix: "
          f"call autopar.value_and_grad at the step's top level.")
    raise MarkerError(
        f"{fn_name}: PipeshardParallel needs the gradients from exactly one "
        f"autopar.value_and_grad / autopar.grad / autopar.filter_value_and_grad "
        f"call at the step's top level (found {len(fwd_at)} forward and "
        f"{len(bwd_at)} backward passes of a loss function; jax.grad inside the "
        f"step is not cut into stages). Fix: compute the gradients with one "
        f"autopar.value_and_grad call.")
  ef, eb = jaxpr.eqns[fwd_at[0]], jaxpr.eqns[bwd_at[0]]
  F: ClosedJaxpr = ef.params["jaxpr"]
  nested = [p for p in _find(F.jaxpr, boundary_p) if "." in p]
  if nested:
    raise MarkerError(
        f"{fn_name}: autopar.mark_pipeline_boundary() is called inside a loop or "
        f"under a condition (lax.scan / fori_loop / while_loop / cond; equation "
        f"{nested[0]} of the loss function), where no stage can end. Fix: call it "
        f"at the loss function's top level, between layers (unroll the loop of "
        f"layers, or mark the boundaries around it).")
  diff, outd, cmask = eb.params["diff"], eb.params["outd"], eb.params["cmask"]
  nin = len(diff)
  if len(ef.invars) != nin or any(
      not (a is b or isinstance(a, Literal) and isinstance(b, Literal))
      for a, b in zip(ef.invars, eb.invars[:nin])):
    raise MarkerError(f"{fn_name}: the loss function's backward pass reads other "
                      f"values than its forward pass; autopar cannot pipeline it.")

  invars = list(jaxpr.invars)
  leaf_index = {v: k for k, v in enumerate(invars[num_consts:])}
  producers = {v: e for e in jaxpr.eqns for v in e.outvars}

  # Roots: the loss function's differentiated inputs.
  roots: list[Root] = []
  root_of_input: dict[int, int] = {}
  extra_eqns = []
  sub: dict = {}                       # F's variables -> P's
  for p, (fv, u) in enumerate(zip(F.jaxpr.invars, ef.invars, strict=True)):
    if not diff[p]:
      sub[fv] = u
      continue
    a = Var(fv.aval)
    if isinstance(u, Var) and u in leaf_index:
      roots.append(Root(a, leaf_index[u]))
      sub[fv] = a
    else:
      eps = a
      total = Var(fv.aval)
      extra_eqns.append(jax_core.new_jaxpr_eqn(
          [u, eps], [total], lax_internal.add_p, {}, jax_core.no_effects,
          ef.source_info, ef.ctx))
      roots.append(Root(eps, None))
      sub[fv] = total
    root_of_input[p] = len(roots) - 1
  constvars = [Var(v.aval) for v in F.jaxpr.constvars]
  sub.update(zip(F.jaxpr.constvars, constvars))

  def read(a):
    return a if isinstance(a, Literal) else sub.get(a, a)

  eqns = []
  for i, eqn in enumerate(jaxpr.eqns):
    if i == bwd_at[0]:
      continue
    if i == fwd_at[0]:
      eqns.extend(extra_eqns)
      for e in F.jaxpr.eqns:
        eqns.append(e.replace(invars=[read(a) for a in e.invars]))
      for o, fo in zip(ef.outvars, F.jaxpr.outvars, strict=True):
        sub[o] = read(fo)
      continue
    if any(not isinstance(a, Literal) and a in sub for a in eqn.invars):
      eqn = eqn.replace(invars=[read(a) for a in eqn.invars])
    eqns.append(eqn)

  # The cotangent seeds of the differentiated outputs (1.0 for the loss).
  douts = [j for j, m in enumerate(outd) if m]
  seeded = [douts[k] for k, m in enumerate(cmask) if m]
  seeds = []
  for v in eb.invars[nin:]:
    value = _constant(v, producers)
    if value is None:
      raise MarkerError(f"{fn_name}: the loss's cotangent seed is computed from the "
                        f"step's inputs; PipeshardParallel needs a constant seed (as "
                        f"autopar.value_and_grad gives).")
    seeds.append(value)

  # Each gradient is the cotangent of one root.
  by_grad_var = {}
  diff_inputs = [p for p, m in enumerate(diff) if m]
  for t, gv in enumerate(eb.outvars):
    by_grad_var[gv] = root_of_input[diff_inputs[t]]
  grad_roots = []
  for j, g in enumerate(jaxpr.outvars[:num_grads]):
    if not isinstance(g, Var) or g not in by_grad_var:
      raise MarkerError(
          f"{fn_name}: gradient {j} is not the loss function's gradient as "
          f"autopar.value_and_grad returns it (it is computed from it, or from "
          f"elsewhere); PipeshardParallel needs the gradients straight from the "
          f"call. Fix: transform the gradients after autopar.value_and_grad "
          f"returns them, in the update.")
    grad_roots.append(by_grad_var[g])

  outvars = [read(F.jaxpr.outvars[j]) for j in seeded]
  outvars += [read(v) for v in jaxpr.outvars[num_grads:]]
  program = Jaxpr(constvars, [*invars, *(r.var for r in roots)], outvars, eqns,
                  jaxpr.effects, jaxpr.debug_info)
  program, boundaries = _dce_with_boundaries(program)
  return Program(jaxpr=program, consts=tuple(F.consts), num_step_consts=num_consts,
                 leaves=tuple(leaves), roots=tuple(roots), grad_roots=tuple(grad_roots),
                 seeds=tuple(seeds), boundaries=boundaries, fn_name=fn_name)


def _dce_with_boundaries(jaxpr: Jaxpr) -> tuple[Jaxpr, tuple[int, ...]]:
  """``jaxpr`` without unneeded equations and without its boundary markers,
  and where the markers were (the index of the equation after each)."""
  kept = _dce(jaxpr, keep=lambda eqn: eqn.primitive is boundary_p).eqns
  eqns, cuts = [], []
  for eqn in kept:
    if eqn.primitive is boundary_p:
      if not cuts or cuts[-1] != len(eqns):
        cuts.append(len(eqns))
    else:
      eqns.append(eqn)
  cuts = tuple(c for c in cuts if 0 < c < len(eqns))
  return jaxpr.replace(eqns=eqns, effects=pe.make_jaxpr_effects(
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
  """
  program: Program
  on_batch: set
  on_roots: set
  floating: set
  producer: dict
  last_read: dict
  rows: dict

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
      elif not (eqn.effects and pe.has_effects(eqn)):
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
    return cls(program, on_batch, on_roots, floating, producer, last_read, rows)

  def is_tangent(self, v) -> bool:
    """Whether ``v`` carries a derivative: computed from a root, inexact."""
    return (v in self.on_roots and
            np.issubdtype(np.dtype(v.aval.dtype), np.inexact))

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


def eqn_flops(eqn, size) -> float:
  """Rough flops of one equation (``size``: a function from a shape to its
  element count): a matmul's, or one per output element."""
  if eqn.primitive.name == "dot_general":
    lhs = size(eqn.invars[0].aval.shape, dims=True)
    out = size(eqn.outvars[0].aval.shape, dims=True)
    return float(dot_flops(lhs, out, eqn.params["dimension_numbers"][0][0]))
  total = 0.0
  for v in eqn.outvars:
    total += size(getattr(v.aval, "shape", ()))
  for sub in jaxprs_in(eqn):
    total += sum(eqn_flops(e, size) for e in sub.eqns)
  return total


def sizer(rows: int):
  """``size(shape)`` for shapes that may hold the symbolic row count."""
  from autopar.rows import ROWS_NAME
  memo: dict = {}

  def dim(d):
    if type(d) is int:
      return d
    v = memo.get(d)
    if v is None:
      v = memo[d] = int(d._evaluate({ROWS_NAME: rows}))
    return v

  def size(shape, dims=False):
    shape = tuple(dim(d) for d in shape)
    return shape if dims else math.prod(shape)
  return size


def value_bytes(v, size) -> float:
  return size(getattr(v.aval, "shape", ())) * itemsize(v.aval.dtype)


def layer_starts(program: Program, analysis: Analysis, mode: str, *,
                 max_layers: int, rows: int) -> list[int]:
  """The positions where layers start (the first is 0).

  ``mode``: ``"manual"`` (the user's boundary markers) or ``"auto"`` (the
  starts of repeated blocks, else cuts of balanced flops).
  """
  ok, why = find_cuts(analysis)
  n = len(program.eqns)
  if mode == "manual":
    if not program.boundaries:
      raise InputError(
          f"{program.fn_name}: PipeshardParallel(layers='manual') but the loss "
          f"function calls autopar.mark_pipeline_boundary() nowhere at its top "
          f"level. Fix: mark the boundaries between layers, or use layers='auto'.")
    for c in program.boundaries:
      if not ok[c]:
        raise InputError(
            f"{program.fn_name}: a pipeline boundary (autopar.mark_pipeline_boundary, "
            f"before equation {c} of the forward pass) is where {why[c]}. Fix: move "
            f"the boundary to between two layers.")
    return [0, *program.boundaries]
  starts = []
  for stack in find_layers(program.jaxpr):
    starts.extend(stack.start + k * stack.length for k in range(stack.count))
  starts = sorted(s for s in set(starts) if 0 < s < n and ok[s])
  if len(starts) >= 1:
    return [0, *starts]
  return _balanced(program, ok, max_layers, rows)


def _balanced(program: Program, ok: list[bool], k: int, rows: int) -> list[int]:
  """Up to ``k`` layers of about equal flops, cut at valid positions."""
  size = sizer(rows)
  flops = np.array([eqn_flops(e, size) for e in program.eqns], dtype=float)
  cum = np.concatenate([[0.0], np.cumsum(flops)])
  total = cum[-1]
  valid = [p for p in range(1, len(program.eqns)) if ok[p]]
  if not valid or total <= 0 or k <= 1:
    return [0]
  starts = []
  for j in range(1, k):
    target = total * j / k
    p = min(valid, key=lambda q: abs(cum[q] - target))
    if p not in starts and (not starts or p > starts[-1]):
      starts.append(p)
  return [0, *starts]
