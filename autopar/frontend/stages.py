"""A pipeline stage: a range of ``P``'s equations, and its forward and
backward passes.

:func:`stage_program` cuts positions ``[lo, hi)`` of ``P`` (``program.py``)
out as :class:`StageProgram`, the jaxpr ``G`` of the stage::

    G(roots, acts_in, leaves, step consts, F consts) -> (acts_out, finals)

* ``roots``: the loss function's differentiated inputs that the stage reads
  (their cotangents are gradients);
* ``acts_in``: values earlier stages make and this one reads, each with its
  row dimension; ``acts_out``: values it makes that later stages read;
* ``finals``: outputs of ``P`` it makes (the loss, reductions over the rows,
  per-example outputs).

Floating equations (no batch data, ``program.py``) that the stage needs are
copied into it, wherever they sit in ``P``.

:func:`forward_backward` differentiates ``G`` with ``jax.vjp``:
``forward(first_row, ...) -> (differentiated outputs, other outputs,
residuals)`` and ``backward(residuals, cotangents) -> (cotangents of the
roots, cotangents of the differentiated acts_in)``. ``first_row`` is the
first of the whole batch's rows that a device's slice of a micro-batch holds
(random draws use it, as in ``rng.py``). Residuals that are inputs or
outputs of the forward pass are not stored twice: the backward pass is
given those values again (``Residuals``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Var

from autopar.errors import InputError, PlanError
from autopar.frontend.hints import HINT_PRIMITIVES, find_hints
from autopar.frontend.evaluate import Rules, eval_jaxpr
from autopar.frontend.program import Analysis, Program, matching
from autopar.frontend.remat import CUSTOM_DERIVATIVES, derivative_key
from autopar.frontend.retype import Instantiator
from autopar.frontend.rng import DRAW_PRIMITIVES, find_draws
from autopar.frontend.rows import ROWS_NAME, RowOracle
from autopar.frontend.split import renumbered
from autopar.frontend.trace import eqns_by_path

__all__ = ["StageProgram", "stage_program", "stage_at", "Residuals", "forward_backward",
           "InputWeight", "split_input_weight",
           "StageFunctions"]


@dataclasses.dataclass(frozen=True)
class StageProgram:
  """One stage's program ``G`` (see the module docstring).

  Attributes:
    lo, hi: the positions of ``P`` it covers.
    jaxpr: ``G``, on ``P``'s (symbolic) variables.
    roots: indices into ``program.roots`` of the roots it reads.
    acts_in: the values of ``P`` it receives, in ``G``'s input order.
    leaves: indices of the argument leaves it reads.
    step_consts, fn_consts: indices of the step's consts and of ``P``'s
      constvars it reads.
    acts_out: the values it sends.
    finals: indices of ``P``'s outputs it makes (seeded ones first).
    tangent_in, tangent_out: per act, whether it carries a derivative.
    row_in, row_out: per act, the dimension that holds the rows.
    draws, hints: random draws and sharding hints of ``G``, by path.
    eqn_indices: the equations of ``P`` that ``G``'s are, in order.
  """
  lo: int
  hi: int
  jaxpr: Jaxpr
  roots: tuple[int, ...]
  acts_in: tuple[Var, ...]
  leaves: tuple[int, ...]
  step_consts: tuple[int, ...]
  fn_consts: tuple[int, ...]
  acts_out: tuple[Var, ...]
  finals: tuple[int, ...]
  tangent_in: tuple[bool, ...]
  tangent_out: tuple[bool, ...]
  row_in: tuple[int, ...]
  row_out: tuple[int, ...]
  num_seeded: int
  draws: dict
  hints: dict
  eqn_indices: tuple[int, ...] = ()

  @property
  def input_groups(self) -> tuple[int, int, int, int, int]:
    return (len(self.roots), len(self.acts_in), len(self.leaves),
            len(self.step_consts), len(self.fn_consts))

  @property
  def seeded_finals(self) -> tuple[int, ...]:
    return tuple(j for j in self.finals if j < self.num_seeded)

  @functools.cached_property
  def signature(self) -> str:
    """Equal for stages that compute alike on inputs alike (one of them is
    planned for all). A custom derivative's rules print as their function's
    name alone: they are keyed by what they compute (two layers whose rules
    close over other constants differ)."""
    rules = [derivative_key(e) for _, e in eqns_by_path(self.jaxpr)
             if e.primitive.name in CUSTOM_DERIVATIVES]
    return str(self.jaxpr) + repr((self.input_groups, self.tangent_in,
                                   self.tangent_out, self.row_in, self.row_out,
                                   [j < self.num_seeded for j in self.finals], rules))


def _owner_stage(program: Program, analysis: Analysis, j: int, ranges) -> int:
  """The stage (index into ``ranges``) that makes output ``j`` of ``P``."""
  v = program.jaxpr.outvars[j]
  i = analysis.producer.get(v) if isinstance(v, Var) else None
  if i is None or i in analysis.floating:
    return len(ranges) - 1
  return next(s for s, (lo, hi) in enumerate(ranges) if lo <= i < hi)


def stage_program(program: Program, analysis: Analysis, ranges: Sequence[tuple[int, int]],
                  s: int) -> StageProgram:
  """Stage ``s`` of the partition of ``P`` into position ``ranges``."""
  jaxpr = program.jaxpr
  eqns = jaxpr.eqns
  lo, hi = ranges[s]
  floating = analysis.floating
  finals = [j for j in range(len(jaxpr.outvars))
            if _owner_stage(program, analysis, j, ranges) == s]
  later = range(hi, len(eqns))
  # Values this stage makes that a later stage's own (non-floating) equation
  # reads: they are sent.
  acts_out = []
  seen = set()
  for i in later:
    if i in floating:
      continue
    for v in eqns[i].invars:
      if isinstance(v, Var) and v not in seen:
        p = analysis.producer.get(v)
        if p is not None and lo <= p < hi and p not in floating:
          seen.add(v)
          acts_out.append(v)
  # The equations: its own non-floating ones, and the floating ones they
  # (or its outputs) need.
  needed = set()
  stack = [v for i in range(lo, hi) if i not in floating for v in eqns[i].invars]
  stack += [jaxpr.outvars[j] for j in finals]
  keep = {i for i in range(lo, hi) if i not in floating}
  while stack:
    v = stack.pop()
    if not isinstance(v, Var) or v in needed:
      continue
    needed.add(v)
    p = analysis.producer.get(v)
    if p is not None and p in floating and p not in keep:
      keep.add(p)
      stack.extend(eqns[p].invars)
  order = sorted(keep)
  made = {v for i in order for v in eqns[i].outvars}
  read = []
  read_set = set()
  for i in order:
    for v in eqns[i].invars:
      if isinstance(v, Var) and v not in made and v not in read_set:
        read_set.add(v)
        read.append(v)
  for j in finals:
    v = jaxpr.outvars[j]
    if isinstance(v, Var) and v not in made and v not in read_set:
      read_set.add(v)
      read.append(v)
  invars = jaxpr.invars
  nc = program.num_step_consts
  nl = len(program.leaves)
  position = {v: k for k, v in enumerate(invars)}
  root_index = {r.var: k for k, r in enumerate(program.roots)}
  const_index = {v: k for k, v in enumerate(jaxpr.constvars)}
  roots, acts_in, leaves, step_consts, fn_consts = [], [], [], [], []
  for v in read:
    if v in root_index:
      roots.append(root_index[v])
    elif v in const_index:
      fn_consts.append(const_index[v])
    elif v in position and position[v] < nc:
      step_consts.append(position[v])
    elif v in position and position[v] < nc + nl:
      leaves.append(position[v] - nc)
    elif v in analysis.producer:
      acts_in.append(v)
    else:
      raise AssertionError(f"stage {s} reads {v}, which nothing makes")
  roots.sort()
  leaves.sort()
  step_consts.sort()
  fn_consts.sort()
  g_in = ([program.roots[k].var for k in roots] + acts_in +
          [invars[nc + k] for k in leaves] + [invars[k] for k in step_consts] +
          [jaxpr.constvars[k] for k in fn_consts])
  g_out = list(acts_out) + [jaxpr.outvars[j] for j in finals]
  g = Jaxpr([], g_in, g_out, [eqns[i] for i in order], jaxpr.effects, jaxpr.debug_info)
  oracle = analysis.oracle or RowOracle.symbolic()
  row = lambda v: analysis.row_dim(v)
  for v in [*acts_in, *acts_out]:
    if row(v) is None:
      raise PlanError(f"autopar: stage {s} would send or receive a value of shape "
                      f"{v.aval.shape} with no row dimension (an internal error: "
                      f"the cut should not have been chosen).")
  return StageProgram(
      lo=lo, hi=hi, jaxpr=g, roots=tuple(roots), acts_in=tuple(acts_in),
      leaves=tuple(leaves), step_consts=tuple(step_consts), fn_consts=tuple(fn_consts),
      acts_out=tuple(acts_out), finals=tuple(finals),
      tangent_in=tuple(analysis.is_tangent(v) for v in acts_in),
      tangent_out=tuple(analysis.is_tangent(v) for v in acts_out),
      row_in=tuple(row(v) for v in acts_in), row_out=tuple(row(v) for v in acts_out),
      num_seeded=program.num_seeded,
      draws=find_draws(eqns_by_path(g), oracle),
      hints=find_hints("compute", eqns_by_path(g), oracle), eqn_indices=tuple(order))


def instantiate_stage(stage: StageProgram, rows: int) -> tuple[Jaxpr, dict, dict]:
  """``G`` at ``rows`` rows per device and micro-batch, with its draws and
  hints renumbered to the written-out equations."""
  inst = Instantiator({ROWS_NAME: rows})
  g = inst.jaxpr(stage.jaxpr)
  draws = {}
  if stage.draws:
    draws = {new: stage.draws[old] for old, new in
             renumbered(stage.jaxpr, g, DRAW_PRIMITIVES) if old in stage.draws}
  hints = {}
  if stage.hints:
    hints = {new: dataclasses.replace(stage.hints[old], path=new) for old, new in
             renumbered(stage.jaxpr, g, HINT_PRIMITIVES) if old in stage.hints}
  return g, draws, hints


def stage_at(stage: StageProgram, ref: Program, other: Program) -> Jaxpr:
  """``stage``'s ``G``, cut from ``ref`` (``P`` traced at a concrete size),
  at another size: the same equations of ``other``, ``P`` traced there
  (``program.unlike(ref, other)`` is ""), by position. Its draws and hints
  keep their paths."""
  sub = matching(ref, other)
  read = lambda v: v if isinstance(v, Literal) else sub[v]
  g = stage.jaxpr
  return Jaxpr([], [read(v) for v in g.invars], [read(v) for v in g.outvars],
               [other.eqns[i] for i in stage.eqn_indices], g.effects, g.debug_info)


# -- forward and backward ----------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Residuals:
  """Where each of the backward pass's residuals comes from.

  Per residual, one of ``("stored", k)`` (the forward pass's ``k``-th
  stored residual), ``("input", k)`` (its ``k``-th input), ``("output", k)``
  (its ``k``-th output) or ``("constant", value)``.
  """
  sources: tuple

  @property
  def num_stored(self) -> int:
    return sum(1 for kind, _ in self.sources if kind == "stored")


@dataclasses.dataclass(frozen=True)
class StageFunctions:
  """A stage's forward and backward passes as jaxprs at one size.

  ``forward.invars``: ``(first_row, roots, acts_in, leaves, step consts, F
  consts)``; outvars: ``(differentiated outputs, other outputs, stored
  residuals)``. The differentiated outputs are the tangent ``acts_out`` then
  the seeded finals; the others the rest of ``acts_out`` then the other
  finals (``out_order`` says which ``G`` output each is).

  ``backward.invars``: ``(every residual, cotangents of the differentiated
  outputs)``; outvars: the cotangents of the roots, then of the tangent
  ``acts_in``.
  """
  forward: ClosedJaxpr
  backward: ClosedJaxpr
  residuals: Residuals
  num_diff_out: int
  out_order: tuple[int, ...]       # G output index of each forward output (before residuals)
  diff_in: tuple[int, ...]         # G input index of each differentiated input

  @property
  def num_outputs(self) -> int:
    return len(self.out_order)


def forward_backward(stage: StageProgram, g: Jaxpr, draws: dict, *,
                     total_rows: int, remat_groups: Sequence[Sequence[int]] | None = None,
                     policy=None) -> StageFunctions:
  """The forward and backward jaxprs of ``g`` (``stage``'s ``G`` written out
  at one size; ``draws`` renumbered to it). ``total_rows``: the whole
  batch's rows (draws give each device its rows of the whole draw).
  ``remat_groups``: equation index ranges of ``g`` to checkpoint one by one
  (the stage's layers under ``remat="layers"``), with ``policy``.
  """
  nr, na, nl, nc, nk = stage.input_groups
  n_out = len(stage.acts_out)
  diff_in = list(range(nr)) + [nr + k for k, t in enumerate(stage.tangent_in) if t]
  diff_out = ([k for k, t in enumerate(stage.tangent_out) if t] +
              [n_out + k for k, j in enumerate(stage.finals) if j < stage.num_seeded])
  other_out = [k for k in range(len(g.outvars)) if k not in set(diff_out)]
  in_avals = [v.aval for v in g.invars]
  box: dict[str, Any] = {}

  def evaluate(first_row, ins):
    rules = Rules(draws=draws, rows=(first_row, total_rows)) if draws else Rules()
    if remat_groups:
      return _eval_grouped(g, ins, rules, remat_groups, policy)
    return eval_jaxpr(g, (), ins, rules)

  def forward(first_row, *ins):
    ins = list(ins)

    def f(*d):
      full = list(ins)
      for k, x in zip(diff_in, d, strict=True):
        full[k] = x
      outs = evaluate(first_row, full)
      return [outs[k] for k in diff_out], [outs[k] for k in other_out]
    douts, vjp, aux = jax.vjp(f, *[ins[k] for k in diff_in], has_aux=True)
    res, tree = jax.tree_util.tree_flatten(vjp)
    box["tree"] = tree
    return [*douts, *aux, *res]

  first = jax.ShapeDtypeStruct((), np.int32)
  try:
    closed = jax.make_jaxpr(forward)(first, *[jax.ShapeDtypeStruct(a.shape, a.dtype)
                                              for a in in_avals])
  except NotImplementedError as e:
    if "Differentiation rule for 'custom_partitioning'" not in str(e):
      raise
    raise InputError(
        "PipeshardParallel: the loss function differentiates a custom_partitioning "
        "op other than through a jax.custom_vjp or jax.custom_jvp rule, and "
        "custom_partitioning has no derivative of its own. Fix: put the op under "
        "a jax.custom_vjp (as jax.nn.dot_product_attention does), "
        "use ShardParallel or DataParallel, or a version of the op "
        "without custom_partitioning (implementation='xla' for attention).") from e
  fj = closed.jaxpr
  n_fwd_out = len(diff_out) + len(other_out)
  res_vars = fj.outvars[n_fwd_out:]
  in_pos = {v: k for k, v in enumerate(fj.invars)}
  out_pos = {}
  for k, v in enumerate(fj.outvars[:n_fwd_out]):
    if isinstance(v, Var):
      out_pos.setdefault(v, k)
  sources, stored = [], []
  for v in res_vars:
    if isinstance(v, Literal):
      sources.append(("constant", np.asarray(v.val)))
    elif v in in_pos:
      sources.append(("input", in_pos[v]))
    elif v in out_pos:
      sources.append(("output", out_pos[v]))
    else:
      sources.append(("stored", len(stored)))
      stored.append(v)
  fwd = ClosedJaxpr(fj.replace(outvars=[*fj.outvars[:n_fwd_out], *stored]),
                    closed.consts)
  tree = box["tree"]

  def backward(res, cts):
    return jax.tree_util.tree_unflatten(tree, res)(list(cts))

  res_avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in res_vars]
  ct_avals = [jax.ShapeDtypeStruct(fj.outvars[k].aval.shape, fj.outvars[k].aval.dtype)
              for k in range(len(diff_out))]
  bwd = jax.make_jaxpr(backward)(res_avals, ct_avals)
  return StageFunctions(forward=fwd, backward=bwd, residuals=Residuals(tuple(sources)),
                        num_diff_out=len(diff_out),
                        out_order=tuple(diff_out + other_out), diff_in=tuple(diff_in))


def _eval_grouped(g: Jaxpr, ins, rules: Rules, groups, policy):
  """``g`` evaluated with each group of equations under ``jax.checkpoint``."""
  env = dict(zip(g.invars, ins, strict=True))
  read = lambda a: a.val if isinstance(a, Literal) else env[a]
  needed_after = []
  later: set = {v for v in g.outvars if isinstance(v, Var)}
  for lo, hi in reversed(groups):
    needed_after.append(set(later))
    for e in g.eqns[lo:hi]:
      later.update(v for v in e.invars if isinstance(v, Var))
  needed_after.reverse()
  for (lo, hi), after in zip(groups, needed_after, strict=True):
    eqns = g.eqns[lo:hi]
    made = {v for e in eqns for v in e.outvars}
    ins_g = [v for v in dict.fromkeys(v for e in eqns for v in e.invars
                                      if isinstance(v, Var) and v not in made)]
    outs_g = [v for v in dict.fromkeys(v for e in eqns for v in e.outvars) if v in after]
    sub = Jaxpr([], ins_g, outs_g, eqns, g.effects, g.debug_info)
    inner = Rules(draws={_shift(p, -lo): d for p, d in rules.draws.items()
                          if lo <= int(p.split(".")[0]) < hi}, rows=rules.rows)

    def run(*xs, sub=sub, inner=inner):
      return eval_jaxpr(sub, (), xs, inner)
    outs = jax.checkpoint(run, policy=policy, prevent_cse=False)(*[env[v] for v in ins_g])
    env.update(zip(outs_g, outs, strict=True))
  return [read(v) for v in g.outvars]


def _shift(path: str, by: int) -> str:
  """``path`` (``"12.0.5"``) with its top-level index moved by ``by``."""
  head, _, rest = path.partition(".")
  return str(int(head) + by) + ("." + rest if rest else "")


@dataclasses.dataclass(frozen=True)
class InputWeight:
  """A backward pass split in two (zero-bubble schedules): ``inputs``, what
  the cotangents of the stage's inputs need, and ``weights``, the rest of
  what its roots' cotangents (the gradients) need.

  ``inputs.invars``: the backward's; outvars: the cotangents of the tangent
  ``acts_in``, then the ``carried`` values ``weights`` reads from it.
  ``weights.invars``: the backward's invars at positions ``reads``, then the
  carried values; outvars: the cotangents of the roots. ``paths``: per
  part, equation path of the backward -> its path there (for the plan's
  pins).
  """
  inputs: ClosedJaxpr
  weights: ClosedJaxpr
  reads: tuple[int, ...]
  num_carried: int
  paths: tuple[dict, dict]

  @property
  def carried(self) -> list:
    """The values ``inputs`` hands ``weights`` (variables of the backward)."""
    outs = self.inputs.jaxpr.outvars
    return list(outs[len(outs) - self.num_carried:])

  def pins(self, pins: dict) -> tuple[dict, dict]:
    """The backward's pins (equation path -> outputs' specs), per part."""
    out: tuple[dict, dict] = ({}, {})
    for path, spec in pins.items():
      head, _, rest = path.partition(".")
      for part, where in zip(out, self.paths):
        if head in where:
          part[where[head] + ("." + rest if rest else "")] = spec
    return out


def split_input_weight(backward: ClosedJaxpr, num_roots: int) -> InputWeight:
  """``backward`` (outvars: the roots' cotangents, then the inputs') split
  into the equations the inputs' cotangents need, and those only the roots'
  need (:class:`InputWeight`). An equation with effects goes with the
  first part, which runs for every micro-batch as the whole pass would."""
  j = backward.jaxpr
  roots_out, inputs_out = j.outvars[:num_roots], j.outvars[num_roots:]

  def needed(outs, skip):
    want = {v for v in outs if isinstance(v, Var)}
    keep = [False] * len(j.eqns)
    for k in reversed(range(len(j.eqns))):
      e = j.eqns[k]
      if skip[k]:
        continue
      if e.effects or any(o in want for o in e.outvars):
        keep[k] = True
        want.update(v for v in e.invars if isinstance(v, Var))
    return keep
  in_b = needed(inputs_out, [False] * len(j.eqns))
  in_w = needed(roots_out, in_b)        # (every equation with effects is in_b)
  made_b = {o for k, e in enumerate(j.eqns) if in_b[k] for o in e.outvars}
  w_eqns = [e for k, e in enumerate(j.eqns) if in_w[k]]
  read_w = dict.fromkeys(
      [v for e in w_eqns for v in e.invars if isinstance(v, Var)] +
      [v for v in roots_out if isinstance(v, Var)])
  carried = [v for v in read_w if v in made_b]
  pos = {v: k for k, v in enumerate(j.invars)}
  reads = tuple(sorted(pos[v] for v in read_w if v in pos))
  b_jaxpr = j.replace(eqns=[e for k, e in enumerate(j.eqns) if in_b[k]],
                      outvars=[*inputs_out, *carried])
  w_jaxpr = j.replace(eqns=w_eqns, invars=[j.invars[k] for k in reads] + carried,
                      outvars=list(roots_out))
  paths = ({}, {})
  for part, keep in zip(paths, (in_b, in_w)):
    for k in range(len(j.eqns)):
      if keep[k]:
        part[str(k)] = str(len(part))
  return InputWeight(inputs=ClosedJaxpr(b_jaxpr, backward.consts),
                     weights=ClosedJaxpr(w_jaxpr, backward.consts), reads=reads,
                     num_carried=len(carried), paths=paths)
