"""The ``autopar`` command (also ``python -m autopar``).

    autopar show plan.json [--full]        the plan's summary
    autopar diff a.json b.json              what changed between two plans
    autopar report plan.json -o plan.html   the self-contained HTML report
    autopar plan module:function --mesh 8x8 --args module:make_args -o plan.json
                                            plans a step for an abstract mesh

Errors (a missing or corrupt file, a name that does not import) print one
line naming the file or name and what is wrong, and exit with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Sequence

from jax.sharding import AbstractMesh

import autopar
from autopar.errors import AutoparError, PlanError
from autopar.plan import Plan
from autopar.tools.diff import diff

__all__ = ["main"]


class _Fail(Exception):
  """A one-line error for the user."""


def _load(path: str) -> Plan:
  if not os.path.isfile(path):
    raise _Fail(f"{path}: no such file (expected a plan saved with Plan.to_json())")
  try:
    with open(path, encoding="utf-8") as f:
      return Plan.from_json(f.read())
  except (OSError, UnicodeDecodeError) as e:
    raise _Fail(f"{path}: cannot read it ({e})") from e
  except PlanError as e:
    raise _Fail(f"{path}: {str(e).splitlines()[0]}") from e


def _attr(spec: str, what: str):
  """``module:name`` imported (the current directory on the path)."""
  if ":" not in spec:
    raise _Fail(f"{what} {spec!r}: expected module:name (e.g. train:train_step)")
  module, name = spec.split(":", 1)
  sys.path.insert(0, os.getcwd())
  try:
    obj = importlib.import_module(module)
  except Exception as e:   # noqa: BLE001 - the user's module: any error is theirs
    raise _Fail(f"{what} {spec!r}: importing {module!r} failed: "
                f"{type(e).__name__}: {e}") from e
  for part in name.split("."):
    if not hasattr(obj, part):
      raise _Fail(f"{what} {spec!r}: {module!r} has no {name!r}")
    obj = getattr(obj, part)
  return obj


def _mesh(text: str, names: str | None) -> AbstractMesh:
  try:
    shape = tuple(int(x) for x in text.lower().split("x"))
  except ValueError:
    raise _Fail(f"--mesh {text!r}: expected sizes joined by x, e.g. 8x8") from None
  if not shape or any(s < 1 for s in shape):
    raise _Fail(f"--mesh {text!r}: expected positive sizes joined by x, e.g. 8x8")
  axis = (tuple(n.strip() for n in names.split(",")) if names else
          ("data", "model", "pipe")[:len(shape)] if len(shape) <= 3 else
          tuple(f"axis{k}" for k in range(len(shape))))
  if len(axis) != len(shape):
    raise _Fail(f"--axis-names {names!r}: {len(axis)} name(s) for a mesh of "
                f"{len(shape)} axes {shape}")
  return AbstractMesh(shape, axis)


def _show(a):
  print(_load(a.plan).summary(full=a.full))


def _diff(a):
  print(diff(_load(a.a), _load(a.b)))


def _report(a):
  plan = _load(a.plan)
  out = a.output or os.path.splitext(a.plan)[0] + ".html"
  try:
    plan.to_html(out, title=f"autopar plan: {os.path.basename(a.plan)}")
  except OSError as e:
    raise _Fail(f"{out}: cannot write the report ({e})") from e
  print(out)


def _plan(a):
  fn = _attr(a.function, "function")
  make_args = _attr(a.args, "--args")
  mesh = _mesh(a.mesh, a.axis_names)
  args = make_args()
  if not isinstance(args, tuple):
    raise _Fail(f"--args {a.args!r}: expected it to return a tuple of the step's "
                f"arguments, got {type(args).__name__}")
  methods = {"ShardParallel": autopar.ShardParallel, "DataParallel": autopar.DataParallel,
             "Zero2Parallel": autopar.Zero2Parallel, "Zero3Parallel": autopar.Zero3Parallel,
             "PipeshardParallel": autopar.PipeshardParallel}
  method = methods[a.method](mesh=mesh, num_micro_batches=a.num_micro_batches)
  if isinstance(fn, autopar.ParallelizedFunction):
    step = fn.with_method(method)
  elif callable(fn):
    step = autopar.parallelize(fn, method=method)
  else:
    raise _Fail(f"function {a.function!r}: not callable ({type(fn).__name__})")
  plan = step.plan(*args)
  out = a.output or "plan.json"
  with open(out, "w", encoding="utf-8") as f:
    f.write(plan.to_json())
  print(plan.summary())
  print(f"\nwrote {out}")


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="autopar", description="Read and make autopar plans.")
  sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")
  s = sub.add_parser("show", help="print a plan's summary",
                     description="Print the summary of a saved plan.")
  s.add_argument("plan", help="a plan JSON file (Plan.to_json())")
  s.add_argument("--full", action="store_true", help="every leaf on its own line")
  s.set_defaults(run=_show)
  s = sub.add_parser("diff", help="what changed between two plans",
                     description="List what changed from plan A to plan B: specs "
                     "(collapsed by layer), collectives, memory, objective.")
  s.add_argument("a", help="plan JSON file A")
  s.add_argument("b", help="plan JSON file B")
  s.set_defaults(run=_diff)
  s = sub.add_parser("report", help="write a self-contained HTML report",
                     description="Write a plan's HTML report (no network needed to "
                     "view it) and print its path.")
  s.add_argument("plan", help="a plan JSON file")
  s.add_argument("-o", "--output", help="the HTML file (default: the plan's name .html)")
  s.set_defaults(run=_report)
  s = sub.add_parser("plan", help="plan a step for an abstract mesh",
                     description="Plan a step for an abstract mesh, without devices, "
                     "and write the plan.")
  s.add_argument("function", help="module:function, the train step (the current "
                 "directory is on the import path)")
  s.add_argument("--mesh", required=True, help="mesh shape, e.g. 8x8")
  s.add_argument("--axis-names", help="comma-separated axis names (default "
                 "data,model,pipe)")
  s.add_argument("--args", required=True, help="module:function returning the step's "
                 "arguments as a tuple (jax.ShapeDtypeStruct leaves are enough)")
  s.add_argument("--method", default="ShardParallel",
                 choices=["ShardParallel", "DataParallel", "Zero2Parallel",
                          "Zero3Parallel", "PipeshardParallel"])
  s.add_argument("--num-micro-batches", type=int, default=1)
  s.add_argument("-o", "--output", help="the plan JSON file (default plan.json)")
  s.set_defaults(run=_plan)
  return p


def main(argv: Sequence[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  try:
    args.run(args)
  except _Fail as e:
    print(f"autopar {args.verb}: {e}", file=sys.stderr)
    return 2
  except AutoparError as e:      # one line, not a traceback
    print(f"autopar {args.verb}: {str(e).splitlines()[0]}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
