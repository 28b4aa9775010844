"""Pausing CPython's cyclic garbage collector around work that makes
millions of long-lived objects (planning, tracing and lowering a step)."""

from __future__ import annotations

import contextlib
import gc

__all__ = ["gc_paused"]


@contextlib.contextmanager
def gc_paused():
  """Pauses CPython's cyclic garbage collector while a step is planned
  (``signature.py``), while its stages are traced, lowered and first run,
  and while a plan's problems are written or read (``planner/solved.py``).

  Tracing and planning a large model make millions of objects that live
  until planning ends, and saved problems are hundreds of thousands of small
  lists and tuples, all kept; the collector would walk them again and again
  (about a quarter of the planning time of a 96-layer model; longer than
  writing the problems). Nothing is lost: the collector runs as usual once
  it is back on.
  """
  if not gc.isenabled():
    yield
    return
  gc.disable()
  try:
    yield
  finally:
    gc.enable()
