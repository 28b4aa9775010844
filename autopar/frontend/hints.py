"""The user's sharding hints: constraints of every plan, never dropped.

A step may say how some of its values are sharded:
``jax.lax.with_sharding_constraint(h, P("data", "model"))`` (a
``sharding_constraint`` equation), ``jax.sharding.reshard`` on an Explicit
mesh (a ``reshard`` equation), or ``in_shardings`` / ``out_shardings`` of a
nested ``jax.jit`` (which the tracer turns into ``sharding_constraint``
equations on the call's operands and results when it inlines the call).
:func:`find_hints` reads them from the program; the planner keeps them as
constraints and the lowering applies them in every stage:

* In ``apply_grad`` (and a step without a grad marker) nothing is manual: a
  hint is applied as written, on the stage's mesh.
* In the gradient stages the batch axes are manual (``lower.py``): each
  device holds its own rows. A batch axis in a hint is then already honoured
  where it splits the value's rows (``rows.py``) and dropped there; the
  other axes are applied. A batch axis on another dimension cannot be
  honoured (each device computes whole rows) and is an :class:`InputError`
  that names the hint, the axis and the fix. ``DataParallel`` and the ZeRO
  methods with their default ``batch_axes`` leave such axes out of the batch
  split (:func:`model_axes`); ``ShardParallel`` plans only batch axes that
  no hint needs elsewhere.
* A hint naming an axis the method's mesh lacks is an :class:`InputError`.

``AutoShardingOption(pins={path: spec})`` fixes argument leaves by pytree
path in the same spirit: :func:`check_pins` checks the paths and specs.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Any, Mapping, Sequence

from jax.sharding import PartitionSpec

from autopar import jax_compat as jc
from autopar.errors import InputError
from autopar.frontend.trace import HINT_PRIMITIVES
from autopar.frontend.rows import ROWS_NAME, RowDim

__all__ = ["Hint", "HINT_PRIMITIVES", "find_hints", "model_axes", "check_hints",
           "in_stage", "hint_rule", "check_pins", "entry_axes", "spec_of"]


def entry_axes(entry) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry (none for None/UNCONSTRAINED)."""
  if entry is None or entry is PartitionSpec.UNCONSTRAINED:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def _make_entry(axes: Sequence[str]):
  axes = tuple(axes)
  return None if not axes else axes[0] if len(axes) == 1 else axes


@dataclasses.dataclass(frozen=True)
class Hint:
  """One sharding hint of the program.

  Attributes:
    part: "compute" (before the grad marker) or "apply".
    path: the equation's path in that part's jaxpr (``trace.eqns_by_path``).
    spec: the hint's PartitionSpec, one entry per dimension of the value.
    shape: the value's shape (in the trace it was read from).
    rows: the dimension that holds the batch's rows, if any (compute only).
  """
  part: str
  path: str
  spec: PartitionSpec
  shape: tuple
  rows: RowDim | None = None
  dtype: Any = None

  def where(self) -> str:
    shape = ", ".join(str(d).replace(ROWS_NAME, "rows") for d in self.shape)
    return (f"the sharding hint {self.spec} on a value of shape ({shape}) "
            f"({self.part} equation {self.path})")

  def shape_at(self, rows: int) -> tuple[int, ...]:
    """The value's shape for a micro-batch of ``rows`` rows."""
    return tuple(jc.evaluate_dim(d, {ROWS_NAME: rows}) if jc.is_symbolic_dim(d)
                 else int(d) for d in self.shape)

  def axes(self) -> set[str]:
    return {a for e in self.spec for a in entry_axes(e)}


def spec_of(eqn) -> PartitionSpec:
  """The full PartitionSpec a hint equation asks for (padded to the rank)."""
  p = eqn.params
  sharding = p.get("sharding", p.get("dst_sharding"))
  spec = list(getattr(sharding, "spec", PartitionSpec()))
  for d in p.get("unconstrained_dims", ()) or ():
    if d < len(spec):
      spec[d] = PartitionSpec.UNCONSTRAINED
  rank = len(eqn.outvars[0].aval.shape)
  spec += [None] * (rank - len(spec))
  return PartitionSpec(*spec)


def find_hints(part: str, eqns, oracle=None) -> dict[str, Hint]:
  """The hints of one part of the step, by path.

  ``eqns``: ``(path, equation)`` (``trace.eqns_by_path``); ``oracle``: a
  ``rows.RowOracle`` for the row dimensions of the hinted values (None: not
  known, or not needed).
  """
  out = {}
  for path, eqn in eqns:
    if eqn.primitive.name not in HINT_PRIMITIVES:
      continue
    v = eqn.outvars[0]
    dims = (oracle.dims(v) if oracle is not None else None) or []
    out[path] = Hint(part, path, spec_of(eqn), tuple(v.aval.shape),
                     dims[0] if len(dims) == 1 else None, v.aval.dtype)
  return out


def model_axes(hints: Mapping[str, Hint]) -> set[str]:
  """Mesh axes the gradient computation's hints put on dimensions that do
  not hold rows: they cannot also split the batch."""
  out = set()
  for h in hints.values():
    if h.part != "compute":
      continue
    for d, e in enumerate(h.spec):
      if h.rows is None or d != h.rows.dim:
        out.update(entry_axes(e))
  return out


def check_hints(hints: Mapping[str, Hint], mesh_sizes: Mapping[str, int],
                batch_axes: Sequence[str], where: str) -> None:
  """Raises InputError for a hint on an axis the mesh lacks, or on a batch
  axis away from the rows (``where``: the method, for the message).
  ``mesh_sizes``: mesh axis name -> its size; a batch axis of size 1 splits
  nothing, and may be anywhere in a hint."""
  batch = {a for a in batch_axes if mesh_sizes.get(a) != 1}
  mesh_axes = tuple(mesh_sizes)
  for h in hints.values():
    unknown = sorted(h.axes() - set(mesh_axes))
    if unknown:
      raise InputError(
          f"autopar: {h.where()} names mesh axis {unknown[0]!r}, but the method's "
          f"mesh has axes {tuple(mesh_axes)}. Fix: use the method's mesh (or one "
          f"with the same axis names) in the hint.")
    if h.part != "compute":
      continue
    for d, e in enumerate(h.spec):
      bad = [a for a in entry_axes(e) if a in batch]
      if bad and (h.rows is None or d != h.rows.dim):
        raise InputError(
            f"autopar: {h.where()} splits dimension {d} over mesh axis {bad[0]!r}, "
            f"but {where} splits the batch over {tuple(batch_axes)}: there each "
            f"device computes whole rows, so {bad[0]!r} can split only the "
            f"dimension that holds the batch's rows. Fix: leave {bad[0]!r} out of "
            f"the batch axes (DataParallel(batch_axes=...)), use ShardParallel, or "
            f"use another mesh axis in the hint.")


def in_stage(spec: PartitionSpec, manual: Sequence[str]) -> PartitionSpec:
  """``spec`` with the manual (batch) axes taken out: inside the gradient
  stages they are already where the rows are."""
  if not manual:
    return spec
  out = []
  for e in spec:
    if e is PartitionSpec.UNCONSTRAINED:
      out.append(e)
    else:
      out.append(_make_entry([a for a in entry_axes(e) if a not in manual]))
  return PartitionSpec(*out)


def hint_rule(pin, manual: Sequence[str]):
  """``evaluate.Rules.hint`` for a program whose ``manual`` axes are manual:
  ``pin(x, spec)`` with the hint's spec less those axes (:func:`in_stage`)."""
  return lambda x, spec: pin(x, in_stage(spec, manual))


def check_pins(pins: Mapping[str, PartitionSpec], leaves, sizes: Mapping[str, int]
               ) -> dict[int, PartitionSpec]:
  """Leaf index -> pinned spec (padded to the leaf's rank), for
  ``AutoShardingOption(pins=...)``; InputError for a path that names no
  leaf, an unknown axis, a spec longer than the leaf's rank or a dimension
  the axes do not divide."""
  by_path = {l.path: k for k, l in enumerate(leaves)}
  out = {}
  for path, spec in pins.items():
    k = by_path.get(path)
    if k is None:
      close = difflib.get_close_matches(path, list(by_path), n=3)
      raise InputError(
          f"AutoShardingOption(pins=...): {path!r} names no argument leaf of the "
          f"step. {'Did you mean ' + ', '.join(map(repr, close)) + '? ' if close else ''}"
          f"Fix: use a leaf's pytree path as plan.inputs names it (e.g. "
          f"{next(iter(by_path), 'state.params[...]')!r}).")
    leaf = leaves[k]
    if len(spec) > len(leaf.shape):
      raise InputError(
          f"AutoShardingOption(pins=...): {spec} for {path} has {len(spec)} entries "
          f"but the leaf has shape {tuple(leaf.shape)}. Fix: one entry per dimension "
          f"at most.")
    for d, e in enumerate(spec):
      for a in entry_axes(e):
        if a not in sizes:
          raise InputError(
              f"AutoShardingOption(pins=...): {spec} for {path} names mesh axis "
              f"{a!r}, but the mesh has axes {tuple(sizes)}.")
      n = math.prod(sizes[a] for a in entry_axes(e))
      if leaf.shape[d] % n:
        raise InputError(
            f"AutoShardingOption(pins=...): {spec} for {path} splits dimension {d} "
            f"(size {leaf.shape[d]}) {n} ways, which does not divide it. Fix: use "
            f"axes whose sizes divide {leaf.shape[d]}.")
    out[k] = PartitionSpec(*spec, *([None] * (len(leaf.shape) - len(spec))))
  return out
