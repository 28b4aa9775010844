"""``autopar.diff(plan_a, plan_b)``: what changed between two plans.

Specs by parameter (with its gradient and optimizer state) and by other
input, collapsed by layer as in the summary; collectives per (stage, kind,
axes); memory per device; the objective.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING

from autopar.tools.groups import Row, collapsed_name, other_rows, param_rows, path_str
from autopar.tools.summary import collective_rows, memory_by_kind
from autopar.text import canonical_str, format_bytes, format_rows, same_spec

if TYPE_CHECKING:
  from autopar.plan import Plan

__all__ = ["diff", "PlanDiff"]


@dataclasses.dataclass(frozen=True)
class PlanDiff:
  """The differences between two plans; ``str()`` prints them.

  Attributes:
    specs: (name, spec in a, spec in b) per group of leaves whose specs
      differ (``name`` collapsed by layer, e.g. ``Block_{0..23}/kernel``;
      a spec is ``"-"`` where the leaf is missing).
    collectives: (stage, kind, axes, (count, bytes) in a, in b) where they
      differ.
    memory: kind -> (bytes per device in a, in b).
    objective: (a, b), seconds.
    header: one line per plan (method, mesh, micro-batches).
    note: set when the plans are of different programs or arguments.
  """
  specs: tuple[tuple[str, str, str], ...]
  collectives: tuple[tuple, ...]
  memory: dict
  objective: tuple[float, float]
  header: tuple[str, str]
  note: str = ""

  def __bool__(self) -> bool:
    return bool(self.specs or self.collectives or self.objective[0] != self.objective[1]
                or any(x != y for x, y in self.memory.values()))

  def __str__(self) -> str:
    a, b = self.objective
    change = f" ({(b - a) / a:+.1%})" if a else ""
    lines = [f"a: {self.header[0]}", f"b: {self.header[1]}"]
    if self.note:
      lines.append(f"note: {self.note}")
    lines.append(f"objective: {a:.4g} s -> {b:.4g} s{change}")
    lines.append("memory per device: " + ", ".join(
        f"{k} {format_bytes(x)} -> {format_bytes(y)}" for k, (x, y) in self.memory.items()
        if x != y) if any(x != y for x, y in self.memory.values())
        else "memory per device: the same")
    lines.append("")
    if self.specs:
      lines.append(f"specs that differ ({len(self.specs)} group(s)):")
      lines += format_rows([("leaf", "a", "b")] + list(self.specs))
    else:
      lines.append("specs: the same")
    lines.append("")
    if self.collectives:
      lines.append("collectives per step that differ:")
      rows = [("stage", "kind", "axes", "a", "b")]
      for stage, kind, axes, ca, cb in self.collectives:
        rows.append((stage, kind, "(" + ", ".join(axes) + ")", _count(ca), _count(cb)))
      lines += format_rows(rows)
    else:
      lines.append("collectives: the same")
    return "\n".join(lines)


def _count(c) -> str:
  return "-" if c is None else f"{c[0]} x, {format_bytes(c[1])}"


def _header(p: "Plan") -> str:
  mesh = " x ".join(f"{n}={s}" for n, s in p.axis_sizes.items())
  return (f"{p.method} on ({mesh}), {p.num_micro_batches} micro-batch(es), batch over "
          f"({', '.join(p.batch_axes)})")


def _specs(row: Row) -> str:
  """The row's specs, without trailing Nones (``P()`` is ``P(None)``); its
  gradient's and state's where they differ from the parameter's."""
  parts = [canonical_str(row.value.spec)]
  if row.grad is not None and not same_spec(row.grad.spec, row.value.spec):
    parts.append(f"grad {canonical_str(row.grad.spec)}")
  for role, s in row.state:
    if not same_spec(s.spec, row.value.spec):
      parts.append(f"{role} {canonical_str(s.spec)}")
  return ", ".join(parts)


def diff(a: "Plan", b: "Plan") -> PlanDiff:
  """What changed from plan ``a`` to plan ``b``."""
  rows_a = {r.value.name: r for r in param_rows(a) + other_rows(a)}
  rows_b = {r.value.name: r for r in param_rows(b) + other_rows(b)}
  changed = []
  for name in list(rows_a) + [n for n in rows_b if n not in rows_a]:
    sa = _specs(rows_a[name]) if name in rows_a else "-"
    sb = _specs(rows_b[name]) if name in rows_b else "-"
    if name in rows_a and name in rows_b:
      va, vb = rows_a[name].value, rows_b[name].value
      if (tuple(va.shape), va.dtype) != (tuple(vb.shape), vb.dtype):
        sa += f" {tuple(va.shape)} {va.dtype}"
        sb += f" {tuple(vb.shape)} {vb.dtype}"
    if sa != sb:
      changed.append((path_str(name), sa, sb))
  specs = _collapse(changed)
  ca = {(r["stage"], r["kind"], r["axes"]): (r["count"], r["bytes"])
        for r in collective_rows(a)}
  cb = {(r["stage"], r["kind"], r["axes"]): (r["count"], r["bytes"])
        for r in collective_rows(b)}
  collectives = tuple((*k, ca.get(k), cb.get(k)) for k in list(ca) +
                      [k for k in cb if k not in ca] if ca.get(k) != cb.get(k))
  ma, mb = memory_by_kind(a), memory_by_kind(b)
  fa, fb = dict(a.fingerprint), dict(b.fingerprint)
  differ = [k for k in ("program", "arguments") if fa.get(k) != fb.get(k)]
  note = (f"the plans are of different {' and '.join(differ)} (fingerprints differ)"
          if differ and fa and fb else "")
  return PlanDiff(specs=specs, collectives=collectives,
                  memory={k: (ma.get(k, 0), mb.get(k, 0)) for k in {**ma, **mb}},
                  objective=(a.objective, b.objective), header=(_header(a), _header(b)),
                  note=note)


def _collapse(changed) -> tuple[tuple[str, str, str], ...]:
  """Changed leaves whose names differ only in numbers, and whose change is
  the same, as one row (``Block_{0..23}/...``)."""
  groups: dict[tuple, list[str]] = {}
  for name, sa, sb in changed:
    groups.setdefault((re.sub(r"\d+", "#", name), sa, sb), []).append(name)
  return tuple((collapsed_name(pattern, names), sa, sb)
               for (pattern, sa, sb), names in groups.items())
