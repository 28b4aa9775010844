"""What autopar keeps on disk (plans, calibrations, JAX's compiled stages):
its root directory, whole-or-nothing writes, and JAX's persistent
compilation cache under that root. A leaf: imports nothing of autopar's."""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
from pathlib import Path

__all__ = ["cache_root", "write_atomic", "use_compilation_cache", "source_digest",
           "write_bytes_atomic"]


def cache_root() -> Path:
  """What autopar keeps on disk: ``$AUTOPAR_CACHE_DIR`` or ``~/.cache/autopar``."""
  return Path(os.environ.get("AUTOPAR_CACHE_DIR") or Path.home() / ".cache" / "autopar")


def write_atomic(path: Path, text: str) -> None:
  """Writes ``text`` to ``path`` whole or not at all (its directory made)."""
  write_bytes_atomic(path, text.encode())


@functools.cache
def source_digest() -> str:
  """A digest of autopar's Python sources (read once per process): what
  autopar keeps on disk is keyed by it, so that an edited checkout or
  another version never reads what an older autopar made. Empty where the
  sources are not readable as files."""
  h = hashlib.sha256()
  root = Path(__file__).parent          # the autopar package
  try:
    for path in sorted(root.rglob("*.py")):
      h.update(str(path.relative_to(root)).encode())
      h.update(path.read_bytes())
  except OSError:
    return ""
  return h.hexdigest()[:16]


def write_bytes_atomic(path: Path, data: bytes) -> None:
  """Writes ``data`` to ``path`` whole or not at all (its directory made)."""
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
    os.replace(tmp, path)
  except BaseException:
    Path(tmp).unlink(missing_ok=True)
    raise


def use_compilation_cache() -> bool:
  """Turns on JAX's persistent compilation cache in ``cache_root() / "xla"``,
  so that a second process reads the step's compiled stages instead of
  compiling them. Left alone where the user chose a directory
  (``jax_compilation_cache_dir``) or turned the cache off
  (``jax_enable_compilation_cache``), and with ``AUTOPAR_XLA_CACHE=0``.
  Returns whether the cache in use is autopar's: then autopar keeps every
  stage there however quickly it compiled (``lower.StageCompiler``); JAX
  keeps what else it compiles for at least
  ``jax_persistent_cache_min_compile_time_secs`` (1 s by default)."""
  import jax
  from jax.experimental.compilation_cache import compilation_cache

  ours = str(cache_root() / "xla")
  if (os.environ.get("AUTOPAR_XLA_CACHE", "1") == "0"
      or not jax.config.jax_enable_compilation_cache):
    return False
  if jax.config.jax_compilation_cache_dir:
    return jax.config.jax_compilation_cache_dir == ours
  compilation_cache.set_cache_dir(ours)
  # JAX decides once per process whether to use the cache, at its first
  # compile (the user's model.init, say): decide again with the directory.
  compilation_cache.reset_cache()
  return True
