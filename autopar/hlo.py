"""Read the collectives out of a compiled stage's HLO.

Communication is read exactly from ``Compiled.as_text()``: every all-reduce,
all-gather, reduce-scatter, all-to-all and collective-permute (or their
``-start`` async forms), with operand bytes per device and group size.

Example::

    for c in autopar.hlo.collectives(exe.stages["apply_grad"]):
        print(c.kind, c.operand_bytes, c.group_size, c.bytes_sent)
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any


from autopar.cost_model import ring_bytes_sent

__all__ = ["HloCollective", "collectives", "bytes_sent"]

_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
          "collective-permute")
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>\(.*?\)|\S+)\s+"
    r"(?P<kind>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?P<start>-start)?\(")
_ARRAY = re.compile(r"(?P<dtype>[a-z]+[0-9]*)\[(?P<dims>[0-9,]*)\]")
_DTYPES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
           "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
           "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}


@dataclasses.dataclass(frozen=True)
class HloCollective:
  """One collective instruction.

  Attributes:
    kind: "all-reduce", "all-gather", "reduce-scatter", "all-to-all" or
      "collective-permute".
    shapes: result array shapes, as (dtype, dims) pairs.
    operand_bytes: bytes per device of its input (all operands together).
    group_size: devices in each replica group.
  """
  kind: str
  shapes: tuple[tuple[str, tuple[int, ...]], ...]
  operand_bytes: int
  group_size: int

  @property
  def result_bytes(self) -> int:
    return sum(_DTYPES.get(d, 4) * math.prod(s) for d, s in self.shapes)

  @property
  def bytes_sent(self) -> float:
    """Bytes each device sends, by the ring formulas."""
    return ring_bytes_sent(self.kind, self.operand_bytes, self.group_size)


def _text(compiled: Any) -> str:
  return compiled if isinstance(compiled, str) else compiled.as_text()


def _group_size(line: str, num_devices: int) -> int:
  m = re.search(r"replica_groups=\{\{([0-9,]*)\}", line)
  if m:
    return len(m.group(1).split(",")) if m.group(1) else num_devices
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
  if m:
    return int(m.group(2))
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
  if m:
    sizes = dict((k.strip("'"), int(v)) for k, v in
                 (kv.split("=") for kv in m.group(1).split(",")))
    axes = [a.strip().strip("'") for a in m.group(2).split(",") if a.strip()]
    return math.prod(sizes[a] for a in axes) if axes else num_devices
  if "source_target_pairs" in line:
    return 2
  return num_devices


def collectives(compiled: Any) -> list[HloCollective]:
  """Every collective in the HLO of ``compiled`` (a Compiled or its text)."""
  text = _text(compiled)
  m = re.search(r"num_partitions=(\d+)", text)
  num_devices = int(m.group(1)) if m else 1
  out = []
  for line in text.splitlines():
    mi = _INSTR.match(line)
    if not mi:
      continue
    kind = mi.group("kind")
    types = mi.group("type")
    if mi.group("start") and types.startswith("("):
      # Async start ops return (operands..., results...); keep the results.
      arrays = _ARRAY.findall(types)
      arrays = arrays[len(arrays) // 2:] if kind != "all-reduce" else arrays
    else:
      arrays = _ARRAY.findall(types)
    shapes = tuple((d, tuple(int(x) for x in dims.split(",") if x))
                   for d, dims in arrays)
    p = _group_size(line, num_devices)
    result = sum(_DTYPES.get(d, 4) * math.prod(s) for d, s in shapes)
    if kind == "all-gather":
      operand = result // max(p, 1)
    elif kind == "reduce-scatter":
      operand = result * p
    else:
      operand = result
    out.append(HloCollective(kind=kind, shapes=shapes, operand_bytes=int(operand),
                             group_size=p))
  return out


def bytes_sent(compiled: Any) -> float:
  """Total bytes each device sends in one run of ``compiled`` (ring formulas)."""
  return float(sum(c.bytes_sent for c in collectives(compiled)))
