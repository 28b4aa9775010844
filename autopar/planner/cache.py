"""What a plan was made for, and solved plans kept on disk.

Every :class:`~autopar.plan.Plan` carries a *fingerprint* (:func:`fingerprint`):
the autopar version, a digest of the traced program (every equation with its
parameters, shapes and dtypes: :func:`program_digest`), a digest of the
argument leaves (paths, shapes, dtypes, which are batch data and which are
donated), the mesh's axis names and sizes, the method with its options, the
number of micro-batches and the batch size. A saved plan given back to a
step is checked against the step's own fingerprint
(:func:`check_fingerprint`), so a plan made for another program is an error
that says what differs, never pins put on the wrong equations.

Solved plans are stored as their JSON under ``$AUTOPAR_CACHE_DIR`` (default
``~/.cache/autopar``), in ``plans/<key>.json``, the ILPs they were solved
with included (``Plan.to_json``'s ``"ilp"``), so that a plan the cache gives
back explains itself (``replan.py``); the key is a SHA-256 of the
fingerprint (:func:`plan_key`). A changed model, mesh, option or autopar
version is a new key (and so is an edited autopar: the key also digests
autopar's own sources); nothing is ever invalidated in place. A cache file
that cannot be read is ignored (and solved again), never an error.

``AutoShardingOption(plan_cache=False)`` turns the cache off for a step.
The presets' plans (``plan_preset``) are kept the same way, under a key that
also holds the costs of the mesh's devices they are priced with
(``Signature.plan_uncached``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Mapping

from autopar.disk import cache_root, source_digest, write_atomic
from autopar.errors import PlanError
from autopar.method import ParallelMethod, axis_sizes_of
from autopar.plan import PLAN_FORMAT, Plan
from autopar.text import without_addresses
from autopar.version import __version__

__all__ = ["cache_dir", "fingerprint", "check_fingerprint", "plan_key", "planner_digest",
           "load", "store", "program_digest"]


def cache_dir() -> Path:
  """Where plans are kept: ``cache_root() / "plans"``."""
  return cache_root() / "plans"


def _sha(text: str) -> str:
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def fingerprint(split, method: ParallelMethod, mesh, batch_size: int) -> dict[str, str]:
  """What a plan for ``split`` under ``method`` on ``mesh`` is made for.

  ``split``: the step as the planner reads it (at a symbolic batch size where
  it can be traced so). Each entry is short text: digests for the program,
  the argument leaves and the options, the rest spelled out.
  """
  traced = split.traced
  h = hashlib.sha256()
  program_digest(traced.jaxpr, h)
  option = getattr(method, "option", None)
  options = "" if option is None else repr(tuple(
      (f.name, getattr(option, f.name)) for f in dataclasses.fields(option)
      if f.name not in ("verbose", "plan_cache")))
  settings = repr(tuple((f.name, getattr(method, f.name))
                        for f in dataclasses.fields(method)
                        if f.name not in ("mesh", "plan", "option")))
  return {
      "autopar": __version__,
      "format": str(PLAN_FORMAT),
      "program": h.hexdigest()[:16],
      "arguments": _sha(repr([(l.path, tuple(l.shape), str(l.dtype), l.is_batch,
                               l.is_donated) for l in traced.leaves])),
      "mesh": ", ".join(f"{a}={s}" for a, s in axis_sizes_of(mesh).items()),
      "method": f"{type(method).__name__} {_sha(settings + options)}",
      "micro_batches": str(method.micro_batches),
      "batch_size": str(batch_size),
  }


# What must match for a saved plan to be used, with how to say it differs.
_MUST_MATCH = {
    "autopar": "it was made by autopar {saved}; this is autopar {now}",
    "mesh": "it is for mesh ({saved}); the method's mesh is ({now})",
    "micro_batches": "it is for num_micro_batches={saved}; the method has "
                     "num_micro_batches={now}",
    "batch_size": "it is for a batch of {saved} rows; the step was given {now}",
    "arguments": "it does not match the arguments (their paths, shapes, dtypes, "
                 "batch or donated leaves; digest {saved}, this step's {now})",
    "program": "it was made for another program (digest {saved}; this step's is "
               "{now}): another step function, model or remat setting",
}


def check_fingerprint(saved: Plan, now: Mapping[str, str], name: str,
                      details: Mapping[str, str] | None = None) -> None:
  """Raises :class:`PlanError` listing what ``saved`` was made for that
  differs from this step's fingerprint ``now``; ``details``: a better way to
  say that an entry differs, where the caller knows one."""
  was = dict(saved.fingerprint)
  details = details or {}
  diffs = [details.get(k) or why.format(saved=was.get(k, "?"), now=now[k])
           for k, why in _MUST_MATCH.items() if was.get(k) != now[k]]
  if diffs:
    raise PlanError(
        f"{name}: the saved plan does not fit this step: " + "; ".join(diffs) +
        ". Fix: plan again for this step and mesh (parallelize(step, "
        "method=ShardParallel(mesh=...)).plan(*args)), or give the plan to the "
        "step, mesh and arguments it was made for.")


def plan_key(fp: Mapping[str, str]) -> str:
  """The cache key of a plan with fingerprint ``fp``, and of the planner's
  own source: a changed planner (an edited checkout, between versions) is a
  new key, so it never reads plans an older planner solved."""
  return hashlib.sha256((repr(sorted(fp.items())) + planner_digest()).encode()).hexdigest()


def planner_digest() -> str:
  """A digest of autopar's Python sources (``disk.source_digest``)."""
  return source_digest()


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
    return without_addresses(repr(value))

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
  try:
    write_atomic(cache_dir() / f"{key}.json", plan.to_json(indent=None))
  except OSError:
    pass
