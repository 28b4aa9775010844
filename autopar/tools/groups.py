"""A plan's leaves as a person reads them: one row per parameter, with its
gradient's and optimizer state's specs beside it, and repeated layers
collapsed into one row.

A *parameter* is an input leaf a gradient is taken of: the plan records
which (``Plan.grad_inputs``: the leaf whose path ends with the gradient's,
of its shape, that the gradient computation reads). The other inputs whose
paths end with the gradient's path (``state.opt_state[0].mu['params']...``
for ``grad['params']...``) are its optimizer state, named by the last part
of what comes before (``mu``), whatever their shape. Rows whose names differ
only in their numbers (``Block_0`` ... ``Block_95``, ``layers/0`` ...) and
that have the same shapes and specs are one :class:`Group`, shown as
``Block_{0..95}`` when they are every combination of their numbers.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Sequence

from autopar.frontend.pytrees import ends_with_key, key_parts
from autopar.text import canonical_str

if TYPE_CHECKING:
  from autopar.plan import Plan, ValuePlan

__all__ = ["Row", "Group", "param_rows", "other_rows", "collapse", "collapsed_name",
           "path_str", "ranges_str"]

_TOKEN = re.compile(r"\['((?:[^'\\]|\\.)*)'\]|\[\"((?:[^\"\\]|\\.)*)\"\]|\[([^\]]*)\]"
                    r"|\.([A-Za-z_]\w*)|^([A-Za-z_]\w*)")


def path_str(path: str) -> str:
  """A pytree key path (``"['params']['Block_0']['kernel']"``, ``"x.y[0]"``)
  as ``params/Block_0/kernel``; text it cannot read is kept as it is."""
  parts, pos = [], 0
  for m in _TOKEN.finditer(path):
    if m.start() > pos:
      parts.append(path[pos:m.start()])
    parts.append(next(g for g in m.groups() if g is not None))
    pos = m.end()
  if pos < len(path):
    parts.append(path[pos:])
  return "/".join(parts) if parts else path


@dataclasses.dataclass(frozen=True)
class Row:
  """One leaf (a parameter with its gradient and state, or another input)."""
  name: str                        # path_str of the parameter's own path
  value: ValuePlan                 # the parameter (or input) leaf
  grad: ValuePlan | None = None
  state: tuple[tuple[str, ValuePlan], ...] = ()     # (role, leaf)
  stage: int | None = None         # in a pipeline: the stage that holds it

  @property
  def signature(self) -> tuple:
    """What must be equal for rows to share one group."""
    v = self.value
    return (self.stage, v.shape, v.dtype, canonical_str(v.spec),
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


def param_rows(plan: "Plan") -> list[Row]:
  """One row per parameter (an input a gradient is taken of), in input
  order, named by its path without the prefix all parameters share."""
  by_name = {v.name: v for v in plan.inputs}
  params: dict[str, tuple] = {}              # parameter path -> (leaf, grad, suffix)
  for g, grad in enumerate(plan.grads):
    suffix = grad.name[len("grad"):] if grad.name.startswith("grad") else grad.name
    path = plan.grad_inputs[g] if g < len(plan.grad_inputs) else _guess(plan, grad, suffix)
    if path in by_name and path not in params:
      params[path] = (by_name[path], grad, suffix)
  taken = set(params)
  rows = []
  where = _stages(plan)
  for path, (leaf, grad, suffix) in params.items():
    state = []
    for v in plan.inputs:
      if v.name not in taken and ends_with_key(v.name, suffix):
        state.append((_role(v.name, suffix), v))
    taken.update(v.name for _, v in state)
    rows.append(Row(name=path_str(path), value=leaf, grad=grad, state=tuple(state),
                    stage=where.get(path)))
  order = {v.name: k for k, v in enumerate(plan.inputs)}
  rows.sort(key=lambda r: order[r.value.name])
  common = _common_prefix([r.name for r in rows])
  if common and len(rows) > 1:
    rows = [dataclasses.replace(r, name=r.name[len(common) + 1:]) for r in rows]
  return rows


def params_prefix(rows: Sequence[Row]) -> str:
  """The path prefix the parameter rows' names leave out."""
  if len(rows) < 2:
    return ""
  return _common_prefix([path_str(r.value.name) for r in rows])


def other_rows(plan: "Plan", params: Sequence[Row] | None = None) -> list[Row]:
  """The inputs that are neither parameters nor their optimizer state (the
  batch, step counters)."""
  params = param_rows(plan) if params is None else params
  taken = {r.value.name for r in params} | {v.name for r in params for _, v in r.state}
  where = _stages(plan)
  return [Row(name=path_str(v.name), value=v, stage=where.get(v.name))
          for v in plan.inputs if v.name not in taken]


def _stages(plan: "Plan") -> dict[str, int]:
  """Input name -> the pipeline stage that holds it (empty: not a pipeline)."""
  return {name: st.index for name, st in plan.stage_of_inputs().items()}


def _guess(plan: "Plan", grad: "ValuePlan", suffix: str) -> str:
  """For a plan that does not record it (an older plan): the first input of
  the gradient's shape whose path ends with the gradient's."""
  for v in plan.inputs:
    if tuple(v.shape) == tuple(grad.shape) and ends_with_key(v.name, suffix):
      return v.name
  return ""


def _common_prefix(names: Sequence[str]) -> str:
  """The leading ``/``-separated components all ``names`` share (not the
  last component of any)."""
  if not names:
    return ""
  split = [n.split("/") for n in names]
  common = []
  for parts in zip(*(p[:-1] for p in split)):
    if len(set(parts)) != 1:
      break
    common.append(parts[0])
  return "/".join(common)


def _role(path: str, suffix: str) -> str:
  """The name of the state at ``path`` of the parameter whose gradient's
  keys are ``suffix``: the key before those (``mu`` of
  ``opt_state[0].mu['w']``)."""
  parts = key_parts(path)[:-len(key_parts(suffix))]
  return parts[-1] if parts else path


def collapse(rows: Sequence[Row]) -> list[Group]:
  """Rows grouped by the pattern of their names (numbers taken out) and
  their signature, in order of first appearance; a group whose numbers do
  not fill every combination of their ranges is split, so that its name
  (``Block_{0..3}/head_{0..1}``) names exactly its members."""
  groups: dict[tuple, list[Row]] = {}
  for r in rows:
    pattern = re.sub(r"\d+", "#", r.name)
    groups.setdefault((pattern, r.signature), []).append(r)
  out = []
  for (pattern, _), members in groups.items():
    for part in _full_products(members):
      out.append(Group(name=collapsed_name(pattern, [m.name for m in part]),
                       rows=tuple(part)))
  position = {id(r): k for k, r in enumerate(rows)}
  out.sort(key=lambda g: position[id(g.rows[0])])
  return out


def _full_products(members: Sequence[Row]) -> list[list[Row]]:
  """``members`` as one list if their numbers are every combination of
  the values at each position, else split by all positions but the last
  that varies (each part then varies in one position only)."""
  numbers = [tuple(int(x) for x in re.findall(r"\d+", m.name)) for m in members]
  sets = [set(col) for col in zip(*numbers)]
  size = 1
  for values in sets:
    size *= len(values)
  if size == len(set(numbers)):
    return [list(members)]
  varying = [i for i, values in enumerate(sets) if len(values) > 1]
  last = varying[-1]
  parts: dict[tuple, list[Row]] = {}
  for m, ns in zip(members, numbers, strict=True):
    parts.setdefault(ns[:last] + ns[last + 1:], []).append(m)
  return list(parts.values())


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
