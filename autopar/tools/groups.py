"""A plan's leaves as a person reads them: one row per parameter, with its
gradient's and optimizer state's specs beside it, and repeated layers
collapsed into one row.

A *parameter* is an input leaf that a gradient is taken of: the gradient
``grad['params']['Block_3']['kernel']`` belongs to the first input whose path
ends with ``['params']['Block_3']['kernel']`` and has its shape
(``state.params['params']['Block_3']['kernel']``); later inputs ending the
same way are its optimizer state, named by the last part of what comes
before (``state.opt_state[0].mu...`` -> ``mu``). Rows whose paths differ
only in their numbers (``Block_0`` ... ``Block_95``, ``layers[0]`` ...) and
that have the same shapes and specs are one :class:`Group`, shown as
``Block_{0..95}``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Sequence

from autopar.tools.text import canonical_str

if TYPE_CHECKING:
  from autopar.plan import Plan, ValuePlan

__all__ = ["Row", "Group", "param_rows", "other_rows", "collapse", "collapsed_name",
           "path_str", "ranges_str"]

_TOKEN = re.compile(r"\['([^']*)'\]|\[(\d+)\]|\.([A-Za-z_]\w*)|^([A-Za-z_]\w*)")


def path_str(path: str) -> str:
  """A pytree key path (``"['params']['Block_0']['kernel']"``, ``"x.y[0]"``)
  as ``params/Block_0/kernel``."""
  parts = [next(g for g in m.groups() if g is not None) for m in _TOKEN.finditer(path)]
  return "/".join(parts) if parts else path


@dataclasses.dataclass(frozen=True)
class Row:
  """One leaf (a parameter with its gradient and state, or another input)."""
  name: str                        # path_str of the parameter's own path
  value: ValuePlan                 # the parameter (or input) leaf
  grad: ValuePlan | None = None
  state: tuple[tuple[str, ValuePlan], ...] = ()     # (role, leaf)

  @property
  def signature(self) -> tuple:
    """What must be equal for rows to share one group."""
    v = self.value
    return (v.shape, v.dtype, canonical_str(v.spec),
            None if self.grad is None else canonical_str(self.grad.spec),
            tuple((r, canonical_str(s.spec)) for r, s in self.state))


@dataclasses.dataclass(frozen=True)
class Group:
  """Rows that differ only in the numbers in their names."""
  name: str                        # "Block_{0..95}/Dense_0/kernel"
  rows: tuple[Row, ...]

  @property
  def first(self) -> Row:
    return self.rows[0]

  def __len__(self) -> int:
    return len(self.rows)


def param_rows(plan: Plan) -> list[Row]:
  """One row per parameter (an input with a gradient), in input order."""
  suffixes = {}
  for g in plan.grads:
    suffix = g.name[len("grad"):] if g.name.startswith("grad") else g.name
    suffixes.setdefault(suffix, g)
  by_suffix: dict[str, list[ValuePlan]] = {}
  for v in plan.inputs:
    s = _suffix_of(v, suffixes)
    if s is not None:
      by_suffix.setdefault(s, []).append(v)
  rows = []
  for s, values in by_suffix.items():
    param, *state = values
    rows.append(Row(name=path_str(s), value=param, grad=suffixes[s],
                    state=tuple((_role(v.name[:len(v.name) - len(s)]), v)
                                for v in state)))
  order = {v.name: k for k, v in enumerate(plan.inputs)}
  return sorted(rows, key=lambda r: order[r.value.name])


def other_rows(plan: Plan) -> list[Row]:
  """The inputs that are neither parameters nor their optimizer state (the
  batch, step counters)."""
  params = param_rows(plan)
  taken = {r.value.name for r in params} | {v.name for r in params for _, v in r.state}
  return [Row(name=path_str(v.name), value=v) for v in plan.inputs if v.name not in taken]


def _suffix_of(v: ValuePlan, suffixes) -> str | None:
  """The longest gradient path ``v``'s path ends with, for a leaf of its
  shape."""
  best = None
  for s, g in suffixes.items():
    if v.name.endswith(s) and tuple(g.shape) == tuple(v.shape) and (
        best is None or len(s) > len(best)):
      best = s
  return best


def _role(prefix: str) -> str:
  """The state's name from the path before the parameter's: its last part."""
  parts = path_str(prefix).split("/")
  return parts[-1] if parts and parts[-1] else prefix


def collapse(rows: Sequence[Row]) -> list[Group]:
  """Rows grouped by the pattern of their names (numbers taken out) and
  their signature, in order of first appearance."""
  groups: dict[tuple, list[Row]] = {}
  for r in rows:
    pattern = re.sub(r"\d+", "#", r.name)
    groups.setdefault((pattern, r.signature), []).append(r)
  out = []
  for (pattern, _), members in groups.items():
    out.append(Group(name=collapsed_name(pattern, [m.name for m in members]), rows=tuple(members)))
  return out


def collapsed_name(pattern: str, names: Sequence[str]) -> str:
  """``pattern`` with each ``#`` the number the names share, or the
  ranges of numbers they have (``{0..95}``)."""
  numbers = [[int(x) for x in re.findall(r"\d+", n)] for n in names]
  pieces = pattern.split("#")
  out = [pieces[0]]
  for i, rest in enumerate(pieces[1:]):
    values = sorted({ns[i] for ns in numbers if i < len(ns)})
    out.append(str(values[0]) if len(values) == 1 else "{" + ranges_str(values) + "}")
    out.append(rest)
  return "".join(out)


def ranges_str(values: Sequence[int]) -> str:
  """``[0, 1, 2, 5, 7, 8]`` as ``"0..2,5,7..8"``."""
  out = []
  start = prev = None
  for v in sorted(values):
    if prev is not None and v == prev + 1:
      prev = v
      continue
    if start is not None:
      out.append(str(start) if start == prev else f"{start}..{prev}")
    start = prev = v
  if start is not None:
    out.append(str(start) if start == prev else f"{start}..{prev}")
  return ",".join(out)
