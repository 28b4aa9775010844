"""Solved plans kept on disk, so the same step is not solved twice.

A plan is stored as its JSON under ``$AUTOPAR_CACHE_DIR`` (default
``~/.cache/autopar``), in ``plans/<key>.json``. The key is a SHA-256 over
everything the solver's answer depends on: the traced program (every
equation with its parameters, shapes and dtypes: ``program_digest``), the
argument leaves, the mesh's axis names and sizes, the method with its
options, the number of micro-batches, the batch size and the plan format. A changed model, mesh or option is a new key;
nothing is ever invalidated in place. A cache file that cannot be read is
ignored (and solved again), never an error.

``AutoShardingOption(plan_cache=False)`` turns the cache off for a step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
from pathlib import Path

from autopar.errors import PlanError
from autopar.method import ShardParallel, axis_names_of, axis_sizes_of
from autopar.plan import PLAN_FORMAT, Plan

__all__ = ["cache_dir", "plan_key", "load", "store"]


def cache_dir() -> Path:
  """Where plans are kept: ``$AUTOPAR_CACHE_DIR/plans`` or ``~/.cache/autopar/plans``."""
  root = os.environ.get("AUTOPAR_CACHE_DIR") or Path.home() / ".cache" / "autopar"
  return Path(root) / "plans"


def plan_key(split, method: ShardParallel, mesh, batch_size: int) -> str:
  """The cache key of planning ``split`` with ``method`` on ``mesh``."""
  traced = split.traced
  option = tuple((f.name, getattr(method.option, f.name))
                 for f in dataclasses.fields(method.option) if f.name != "verbose")
  h = hashlib.sha256()
  for part in (f"format {PLAN_FORMAT}", type(method).__name__, repr(option),
               repr(axis_names_of(mesh)), repr(tuple(axis_sizes_of(mesh).values())),
               f"n {method.micro_batches} batch {batch_size}",
               repr([(l.path, tuple(l.shape), str(l.dtype), l.is_batch)
                     for l in traced.leaves]),
               ):
    h.update(part.encode())
    h.update(b"\0")
  program_digest(traced.jaxpr, h)
  return h.hexdigest()


def program_digest(closed, h) -> None:
  """Feeds ``closed`` (a ClosedJaxpr) into the hash ``h``: every equation's
  primitive, parameters, operands and results with their shapes and dtypes,
  sub-jaxprs (loop bodies, branches) included.

  It says what ``str(jaxpr)`` says, in a fifth of the time: JAX's pretty
  printer takes seconds on a 36,000-equation step.
  """
  from jax.extend.core import ClosedJaxpr, Jaxpr, Literal
  import numpy as np
  names: dict = {}
  avals: dict = {}       # id(aval) -> (its text, the aval, kept alive by this)

  def aval(v) -> str:
    a = v.aval
    hit = avals.get(id(a))
    if hit is None:
      hit = avals[id(a)] = (str(a), a)
    return hit[0]

  def name(v) -> str:
    if type(v) is Literal:         # its bytes: numpy's repr is slow
      return f"lit({np.asarray(v.val).tobytes().hex()}:{aval(v)})"
    n = names.get(v)
    if n is None:
      n = names[v] = f"v{len(names)}:{aval(v)}"
    return n

  def param(value):
    if isinstance(value, ClosedJaxpr):
      jaxpr(value.jaxpr)
      return f"closed({len(value.consts)})"
    if isinstance(value, Jaxpr):
      jaxpr(value)
      return "jaxpr"
    if isinstance(value, (tuple, list)) and any(
        isinstance(x, (ClosedJaxpr, Jaxpr)) for x in value):
      return "(" + ",".join(param(x) for x in value) + ")"
    return repr(value)

  def jaxpr(j) -> None:
    h.update(("{" + " ".join([name(v) for v in (*j.constvars, *j.invars)]) + ";").encode())
    update = h.update
    for eqn in j.eqns:
      params = ",".join([f"{k}={param(v)}" for k, v in sorted(eqn.params.items())])
      update(f"{' '.join([name(v) for v in eqn.outvars])}={eqn.primitive.name}"
             f"[{params}]({' '.join([name(v) for v in eqn.invars])});".encode())
    h.update((" ".join([name(v) for v in j.outvars]) + "}").encode())

  jaxpr(closed.jaxpr)
  h.update(f"consts {len(closed.consts)}".encode())


def load(key: str) -> Plan | None:
  """The stored plan for ``key``, or None."""
  path = cache_dir() / f"{key}.json"
  try:
    return Plan.from_json(path.read_text())
  except (OSError, PlanError, KeyError, TypeError, ValueError):
    return None


def store(key: str, plan: Plan) -> None:
  """Stores ``plan`` under ``key`` (atomically; errors are ignored)."""
  directory = cache_dir()
  try:
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
      f.write(plan.to_json(indent=None))
    os.replace(tmp, directory / f"{key}.json")
  except OSError:
    pass
