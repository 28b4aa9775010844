"""Pausing CPython's cyclic garbage collector around work that makes
millions of long-lived objects (planning, tracing and lowering a step)."""

from __future__ import annotations

import contextlib
import gc
import threading

__all__ = ["gc_paused"]


@contextlib.contextmanager
def gc_paused():
  """Pauses CPython's cyclic garbage collector while a step is planned
  (``signature.py``), while its stages are traced, lowered and compiled
  (each try of a memory budget apart) and a pipeline's first step runs,
  and while a plan's problems are written or read (``planner/solved.py``).

  Tracing and planning a large model make millions of objects that live
  until planning ends, and saved problems are hundreds of thousands of small
  lists and tuples, all kept; the collector would walk them again and again
  (about a quarter of the planning time of a 96-layer model; longer than
  writing the problems). Nothing is lost: the collector runs as usual once
  it is back on.
  """
  global _depth, _was_enabled
  with _lock:
    if _depth == 0:
      _was_enabled = gc.isenabled()
      gc.disable()
    _depth += 1
  try:
    yield
  finally:
    with _lock:
      _depth -= 1
      if _depth == 0 and _was_enabled:
        gc.enable()


# Pauses may nest and overlap across threads (two steps compiled at once):
# the collector is back on when the last one ends, if it was on before the
# first began.
_lock = threading.Lock()
_depth = 0
_was_enabled = False
