"""A step's compiled stages kept on disk, so that a later process loads them.

JAX's persistent compilation cache keeps each compiled module under a key
of its HLO, so a process that finds a stage there has still traced the
stage's function and lowered it to get that key: at 12 layers most of a
warm first step. Here the stages themselves (``jax.stages.Compiled``,
serialized with ``jax.experimental.serialize_executable``) are kept under
a key of everything they were made from (:func:`stage_key`):

* the step's program as traced and differentiated, its argument leaves,
  the method with its options, the mesh's axes, micro-batches and batch
  size (the plan's fingerprint, ``planner.cache.fingerprint``), and the
  values of the constants the program closes over, which the fingerprint
  counts but does not read;
* the plan: every spec it gives (inputs, gradients, outputs,
  intermediates), its batch axes and gradient sync;
* what the stages are lowered with besides: the mesh's devices in order
  (ids, kinds), the lowering's own options (accumulation dtype, one
  executable, the loss's scale), the compiler options;
* autopar's sources, jax's and jaxlib's versions, the backend's, the XLA
  flags and every option of JAX's configuration
  (``jax_compat.lowering_context``).

What the key cannot read keeps a step out: a primitive lowered by a rule
that is not JAX's or autopar's (another package's Python, run at lowering:
``jax_compat.lowered_by_jax``), and a step traced at concrete batch sizes
only (``Signature.stage_key``).

Loading is most of a warm start, so it starts before the key is known:
each kept step also leaves a *hint*, the key under what a process knows
before it traces anything (the step's name, its arguments' shapes, the
method, the devices: ``Signature.hint_key``), and :func:`prefetch` loads
the stages the hint names on threads while the step is traced and its
plan read. They are used only where the key computed then is the one they
were kept under; a guess that was wrong (the model's code changed) cost
reading the file, the threads' time and the loaded executables' memory
until the step is compiled, and the hint then names the new stages.

A stage that cannot be kept so (it calls back into the process, has side
effects, or takes constants at each call: ``jax_compat.serialize_compiled``),
or that JAX's cache answered instead of XLA compiling it (it would be kept
without some of its code), keeps the whole step out: its next process reads
JAX's cache as before. Kept where JAX's cache is autopar's (``disk.use_compilation_cache``:
``AUTOPAR_XLA_CACHE=0`` turns both off), in ``cache_root() / "stages"``,
one file per key; a file that cannot be read or loaded is ignored (the step
is compiled again), never an error. Stages that load but fail on their
first run (``Executable._first_run`` waits for it) are removed, compiled
again, and not kept under that key again (``forget``). Single-process steps only: a
multi-process one's executables span other processes' devices.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import pickle
import re
import zlib
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np

from autopar import jax_compat as jc
from autopar.disk import cache_root, source_digest, use_compilation_cache, write_bytes_atomic
from autopar.text import without_addresses

__all__ = ["keeps", "stage_key", "load", "store", "forget", "path", "consts_digest", "hint_key",
           "prefetch", "Prefetched"]

# Bumped when what a file holds changes (2: zlib-compressed).
_FORMAT = 2


def _dir() -> Path:
  return cache_root() / "stages"


def path(key: str) -> Path:
  """The file the stages kept under ``key`` are in."""
  return _dir() / key


def _failed(key: str) -> Path:
  """The file that says stages kept under ``key`` failed to run (``forget``)."""
  return _dir() / f"{key}.failed"


def _hint(hint: str) -> Path:
  """The file of the hint ``hint``: the key of the stages it names."""
  return _dir() / "hints" / hint


def keeps() -> bool:
  """Whether stages are kept here: JAX's cache is autopar's, the step runs
  in one process, and autopar's sources are readable (their digest is in
  the key: without it two builds of one version would share stages)."""
  return jax.process_count() == 1 and use_compilation_cache() and bool(source_digest())


def _digest(text: str) -> str:
  """A key of ``text``, its object addresses (a process's own: a
  function's that a pytree holds as static data, say) left out."""
  return hashlib.sha256(without_addresses(text).encode()).hexdigest()


def _devices(mesh) -> list:
  return [(d.id, d.platform, d.device_kind) for d in np.asarray(mesh.devices).flat]


def hint_key(known: Any, mesh) -> str | None:
  """The key of the hint for a step whose ``known`` (what is known of it
  before it is traced, as a repr-able value) runs on ``mesh``; None where
  nothing is kept."""
  if not keeps():
    return None
  return _digest(repr(("hint", _FORMAT, known, _devices(mesh), tuple(mesh.axis_names),
                       source_digest(), jc.lowering_context())))


def stage_key(fingerprint: Any, plan: Any, mesh, consts: str, lowering: Any) -> str | None:
  """The key of a step's stages (module docstring), or None where they are
  not kept: JAX's cache is not autopar's, or the step spans processes.

  ``fingerprint``: the plan's fingerprint entries; ``consts``:
  :func:`consts_digest` of the program; ``lowering``: the rest the stages
  are lowered with (options, sizes), as a repr-able value."""
  if not keeps():
    return None
  devices = _devices(mesh)
  specs = [(v.name, repr(v.spec)) for group in (plan.inputs, plan.grads, plan.outputs,
                                                plan.intermediates) for v in group]
  text = repr((_FORMAT, sorted(dict(fingerprint).items()), tuple(plan.batch_axes),
               plan.grad_sync, plan.num_micro_batches, specs, tuple(mesh.axis_names),
               tuple(mesh.axis_types), devices, consts, lowering, source_digest(),
               jc.lowering_context()))
  return _digest(text)


def consts_digest(closed) -> str:
  """A digest of the values of the constants ``closed`` (a ClosedJaxpr)
  closes over, its sub-programs' included: the program's digest counts
  them, and a step that closes over another array of the same shape is
  another executable."""
  from jax.extend.core import ClosedJaxpr, Jaxpr
  h = hashlib.sha256()
  seen: set[int] = set()

  def value(c) -> None:
    dtype = getattr(c, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
      h.update(str(dtype).encode())       # (the key's implementation)
      c = jax.random.key_data(c)
    a = np.asarray(jax.device_get(c) if isinstance(c, jax.Array) else c)
    h.update(f"{a.dtype}{a.shape}".encode())
    h.update(np.ascontiguousarray(a).tobytes())

  def walk(j) -> None:
    if id(j) in seen:
      return
    seen.add(id(j))
    for eqn in j.eqns:
      for p in eqn.params.values():
        for sub in (p if isinstance(p, (tuple, list)) else (p,)):
          if isinstance(sub, ClosedJaxpr):
            for c in sub.consts:
              value(c)
            walk(sub.jaxpr)
          elif isinstance(sub, Jaxpr):
            walk(sub)

  for c in closed.consts:
    value(c)
  walk(closed.jaxpr)
  return h.hexdigest()[:32]


class Prefetched:
  """The stages kept under ``key``, loading on threads (XLA loads an
  executable without holding the GIL); :meth:`result` waits for them.
  Raises OSError or an unpickling error where the file cannot be read."""

  def __init__(self, key: str, mesh):
    self.key = key
    kept = pickle.loads(zlib.decompress(path(key).read_bytes()))
    devices = list(np.asarray(mesh.devices).flat)
    self._names = [name for name, _ in kept["stages"]]
    self._schedule = tuple(kept["schedule"])
    pool = concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1)
    self._loads = [pool.submit(jc.load_compiled, saved, devices)
                   for _, saved in kept["stages"]]
    pool.shutdown(wait=False)             # (its threads end with the loads)

  def cancel(self) -> None:
    """Drops the loads not started (the key was another's)."""
    for f in self._loads:
      f.cancel()

  def result(self) -> tuple[dict[str, Any], tuple[str, ...]] | None:
    """(stage name -> loaded executable, schedule), or None where a stage
    could not be loaded (the step is then compiled)."""
    try:
      loaded = [f.result() for f in self._loads]
    except Exception:  # noqa: BLE001 - a file this jaxlib cannot load: compiled again
      return None
    return dict(zip(self._names, loaded, strict=True)), self._schedule


def _prefetched(key: str, mesh) -> Prefetched | None:
  try:
    return Prefetched(key, mesh)
  except Exception:  # noqa: BLE001 - a file cut short or of another format: compiled again
    return None


def prefetch(hint: str | None, mesh) -> Prefetched | None:
  """Starts loading the stages the hint ``hint`` names (``Prefetched``), or
  None where there is no such hint."""
  if hint is None:
    return None
  try:
    key = _hint(hint).read_text().strip()
  except (OSError, ValueError):
    return None
  if not re.fullmatch(r"[0-9a-f]{64}", key):
    return None
  return _prefetched(key, mesh)


def load(key: str, mesh, prefetched: Prefetched | None = None, hint: str | None = None):
  """(stage name -> loaded executable, schedule) kept under ``key``, or
  None; from ``prefetched`` where it loaded this key's. Where the hint
  ``hint`` named other stages (or none) and these load, it names these
  from now on."""
  if prefetched is not None and prefetched.key == key:
    return prefetched.result()
  if prefetched is not None:
    prefetched.cancel()
  found = _prefetched(key, mesh)
  loaded = None if found is None else found.result()
  if loaded is not None and hint is not None:
    try:
      write_bytes_atomic(_hint(hint), key.encode())
    except OSError:
      pass
  return loaded


def forget(key: str) -> None:
  """Removes the stages kept under ``key``, ones that failed to run, and
  keeps none under it again (a file ``<key>.failed`` says so): the step's
  later processes compile it. (Its hint is left, naming a key no file is
  under: nothing is prefetched.)"""
  try:
    path(key).unlink(missing_ok=True)
    write_bytes_atomic(_failed(key), b"")
  except OSError:
    pass


def store(key: str, stages: dict[str, Any], schedule: Sequence[str],
          hint: str | None = None) -> bool:
  """Keeps ``stages`` under ``key`` (and ``hint`` naming it); False
  (nothing kept) where a stage cannot be serialized, or stages kept under
  ``key`` before failed to run (``forget``)."""
  if _failed(key).exists():
    return False
  saved = []
  for name, compiled in stages.items():
    s = jc.serialize_compiled(compiled)
    if s is None:
      return False
    saved.append((name, s))
  try:
    # (zlib's fastest level: a fifth of the bytes, for 0.05 s per 7 MB.)
    data = pickle.dumps({"stages": saved, "schedule": tuple(schedule)})
    write_bytes_atomic(path(key), zlib.compress(data, 1))
    if hint is not None:
      write_bytes_atomic(_hint(hint), key.encode())
  except (OSError, pickle.PicklingError, TypeError):
    return False          # (a full or read-only disk: the next process compiles)
  return True
