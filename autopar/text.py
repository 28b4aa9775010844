"""Text helpers for reading plans: bytes, specs, aligned tables."""

from __future__ import annotations

import re
from typing import Sequence

from jax.sharding import PartitionSpec

__all__ = ["format_bytes", "spec_str", "same_spec", "canonical_str", "axes_str",
           "format_rows", "without_addresses"]

# A Python object's address in its repr (a function's): differs from
# process to process.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def without_addresses(text: str) -> str:
  """``text`` with the object addresses in its reprs left out: what a
  digest kept from one process to the next may hold."""
  return _ADDRESS.sub("", text) if " at 0x" in text else text


def format_bytes(n: float) -> str:
  """``n`` bytes in B, KiB, MiB, GiB or TiB."""
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
    n /= 1024
  return f"{n:.2f} TiB"


def spec_str(spec: PartitionSpec) -> str:
  """``spec`` as ``P('data', None)``."""
  entries = []
  for e in spec:
    if e is None:
      entries.append("None")
    elif isinstance(e, str):
      entries.append(repr(e))
    else:
      entries.append("(" + ", ".join(map(repr, e)) + ")")
  return "P(" + ", ".join(entries) + ")"


def same_spec(a: PartitionSpec, b: PartitionSpec) -> bool:
  """Whether ``a`` and ``b`` shard alike (``P()`` is ``P(None, None)``)."""
  return _canonical(a) == _canonical(b)


def canonical_str(spec: PartitionSpec) -> str:
  """``spec_str`` of ``spec`` without its trailing Nones."""
  return spec_str(PartitionSpec(*_canonical(spec)))


def _canonical(spec) -> tuple:
  entries = [tuple(e) if isinstance(e, (list, tuple)) else e for e in spec]
  entries = [e[0] if isinstance(e, tuple) and len(e) == 1 else e or None for e in entries]
  while entries and entries[-1] is None:
    entries.pop()
  return tuple(entries)


def axes_str(axes: Sequence[str]) -> str:
  """Mesh axes as ``(data, model)``, or ``no axes``."""
  return "(" + ", ".join(axes) + ")" if axes else "no axes"


def format_rows(rows: Sequence[Sequence[str]]) -> list[str]:
  """``rows`` (the first a header) as aligned lines, a rule under the header."""
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  out = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
         for r in rows]
  out.insert(1, "  ".join("-" * w for w in widths))
  return out
