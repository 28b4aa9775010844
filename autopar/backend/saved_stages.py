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
  flags and JAX's configuration that lowering reads
  (``jax_compat.lowering_context``).

A stage that cannot be kept so (it calls back into the process, has side
effects, or takes constants at each call: ``jax_compat.serialize_compiled``),
or that JAX's cache answered instead of XLA compiling it (it would be kept
without some of its code), keeps the whole step out: its next process reads
JAX's cache as before. Kept where JAX's cache is autopar's (``disk.use_compilation_cache``:
``AUTOPAR_XLA_CACHE=0`` turns both off), in ``cache_root() / "stages"``,
one file per key; a file that cannot be read or loaded is ignored (the step
is compiled again), never an error. Single-process steps only: a
multi-process one's executables span other processes' devices.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import pickle
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np

from autopar import jax_compat as jc
from autopar.disk import cache_root, source_digest, use_compilation_cache, write_bytes_atomic

__all__ = ["stage_key", "load", "store", "consts_digest"]

# Bumped when what a file holds changes.
_FORMAT = 1


def _dir() -> Path:
  return cache_root() / "stages"


def stage_key(fingerprint: Any, plan: Any, mesh, consts: str, lowering: Any) -> str | None:
  """The key of a step's stages (module docstring), or None where they are
  not kept: JAX's cache is not autopar's, or the step spans processes.

  ``fingerprint``: the plan's fingerprint entries; ``consts``:
  :func:`consts_digest` of the program; ``lowering``: the rest the stages
  are lowered with (options, sizes), as a repr-able value."""
  if jax.process_count() > 1 or not use_compilation_cache():
    return None
  devices = [(d.id, d.platform, d.device_kind) for d in np.asarray(mesh.devices).flat]
  specs = [(v.name, repr(v.spec)) for group in (plan.inputs, plan.grads, plan.outputs,
                                                plan.intermediates) for v in group]
  text = repr((_FORMAT, sorted(dict(fingerprint).items()), tuple(plan.batch_axes),
               plan.grad_sync, plan.num_micro_batches, specs, tuple(mesh.axis_names),
               tuple(mesh.axis_types), devices, consts, lowering, source_digest(),
               jc.lowering_context()))
  return hashlib.sha256(text.encode()).hexdigest()


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


def load(key: str, mesh) -> tuple[dict[str, Any], tuple[str, ...]] | None:
  """(stage name -> loaded executable, schedule) kept under ``key``, or None."""
  try:
    data = (_dir() / key).read_bytes()
  except OSError:
    return None
  try:
    kept = pickle.loads(data)
    devices = list(np.asarray(mesh.devices).flat)
    # (XLA loads an executable without holding the GIL: side by side.)
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
      loaded = pool.map(lambda saved: jc.load_compiled(saved, devices),
                        [saved for _, saved in kept["stages"]])
      stages = dict(zip([name for name, _ in kept["stages"]], loaded, strict=True))
    return stages, tuple(kept["schedule"])
  except Exception:  # noqa: BLE001 - a file this jaxlib cannot read: compiled again
    return None


def store(key: str, stages: dict[str, Any], schedule: Sequence[str]) -> bool:
  """Keeps ``stages`` under ``key``; False (nothing kept) where a stage
  cannot be serialized."""
  saved = []
  for name, compiled in stages.items():
    s = jc.serialize_compiled(compiled)
    if s is None:
      return False
    saved.append((name, s))
  try:
    write_bytes_atomic(_dir() / key, pickle.dumps({"stages": saved,
                                                   "schedule": tuple(schedule)}))
  except OSError:         # a full or read-only disk: the next process compiles
    return False
  return True
