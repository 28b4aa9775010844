"""The ``autopar`` command (also ``python -m autopar``).

    autopar show plan.json [--full]        the plan's summary
    autopar diff a.json b.json              what changed between two plans
    autopar explain plan.json PATH [--step module:fn --args module:make_args]
                                            why a leaf has its spec (from the ILPs
                                            the plan saved; --step: planned again)
    autopar report plan.json -o plan.html   the self-contained HTML report
    autopar plan module:function --mesh 8x8 --args module:make_args -o plan.json
                                            plans a step for an abstract mesh

Errors (a missing or corrupt file, a name that does not import, autopar's
own errors) print their whole message, naming the file or name, what is
wrong and the fix, and exit with status 2; ``--traceback`` prints the
traceback too. Output cut short by its reader (``autopar show p.json |
head``) ends quietly, with status 141.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from typing import Sequence

from jax.sharding import AbstractMesh

import autopar
from autopar.errors import AutoparError, PlanError
from autopar.plan import Plan
from autopar.tools.diff import diff
from autopar.tools.explain import find_leaves
from autopar.text import format_rows, spec_str

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


def _explain(a):
  plan = _load(a.plan)
  if a.step is None:
    leaves = find_leaves(plan, a.path)
    if not leaves:
      raise _Fail(f"{a.path!r} names no leaf of {a.plan}")
    # The plan's own ILPs, saved in its JSON, solved again: no step needed.
    try:
      print(plan.explain(a.path))
      return
    except PlanError as e:
      why = str(e)
    rows = [("leaf", "shape", "spec")] + [(v.name, str(tuple(v.shape)), spec_str(v.spec))
                                          for v in leaves[:20]]
    print("\n".join(format_rows(rows)))
    print(f"\n(no candidates: {why})")
    return
  if a.args is None:
    raise _Fail("--step needs --args (module:function returning the step's arguments)")
  if plan.method != "ShardParallel":
    raise _Fail(f"{a.plan}: explain re-plans ShardParallel plans; this is a "
                f"{plan.method} plan")
  costs = plan.costs or {}
  option = autopar.AutoShardingOption(
      mesh_alpha=costs.get("alpha"), mesh_beta=costs.get("beta"),
      seconds_per_flop=costs.get("seconds_per_flop", 1e-12),
      memory_bandwidth=(1 / costs["seconds_per_byte"] if costs.get("seconds_per_byte")
                        else None),
      memory_budget_per_device=costs.get("memory_budget_per_device"), plan_cache=False)
  mesh = AbstractMesh(tuple(plan.mesh_shape), tuple(plan.mesh_axis_names))
  method = autopar.ShardParallel(mesh=mesh, num_micro_batches=plan.num_micro_batches,
                                 option=option)
  step = _step(a.step, method)         # (kept: explain re-plans it)
  again = _planned(step, _args(a.args), a.step)
  if autopar.diff(plan, again).specs:
    print(f"note: planned again for {a.plan}'s mesh and costs, the step's plan differs "
          f"from the saved one (its pins or options are not saved); explaining the new "
          f"plan")
  print(again.explain(a.path))


def _report(a):
  plan = _load(a.plan)
  out = a.output or os.path.splitext(a.plan)[0] + ".html"
  try:
    plan.to_html(out, title=f"autopar plan: {os.path.basename(a.plan)}")
  except OSError as e:
    raise _Fail(f"{out}: cannot write the report ({e})") from e
  print(out)


def _args(spec: str) -> tuple:
  make = _attr(spec, "--args")
  try:
    args = make()
  except Exception as e:   # noqa: BLE001 - the user's function: any error is theirs
    raise _Fail(f"--args {spec!r} raised {type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}") from e
  if not isinstance(args, tuple):
    raise _Fail(f"--args {spec!r}: expected it to return a tuple of the step's "
                f"arguments, got {type(args).__name__}")
  return args


def _step(spec: str, method):
  fn = _attr(spec, "function")
  if isinstance(fn, autopar.ParallelizedFunction):
    return fn.with_method(method)
  if callable(fn):
    return autopar.parallelize(fn, method=method)
  raise _Fail(f"function {spec!r}: not callable ({type(fn).__name__})")


def _planned(step, args: tuple, spec: str):
  """``step.plan(*args)``; an error of the user's step in one line."""
  try:
    return step.plan(*args)
  except AutoparError:
    raise
  except Exception as e:   # noqa: BLE001 - tracing the user's step
    raise _Fail(f"planning {spec!r} raised {type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}") from e


def _plan(a):
  mesh = _mesh(a.mesh, a.axis_names)
  methods = {"ShardParallel": autopar.ShardParallel, "DataParallel": autopar.DataParallel,
             "Zero2Parallel": autopar.Zero2Parallel, "Zero3Parallel": autopar.Zero3Parallel,
             "PipeshardParallel": autopar.PipeshardParallel}
  method = methods[a.method](mesh=mesh, num_micro_batches=a.num_micro_batches)
  plan = _planned(_step(a.function, method), _args(a.args), a.function)
  out = a.output or "plan.json"
  try:
    with open(out, "w", encoding="utf-8") as f:
      f.write(plan.to_json())
  except OSError as e:
    raise _Fail(f"{out}: cannot write the plan ({e})") from e
  print(plan.summary())
  print(f"\nwrote {out}")


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="autopar", description="Read and make autopar plans.")
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument("--traceback", action="store_true",
                      help="on an error, print its traceback too")
  sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")

  def verb(*a, **kw):
    return sub.add_parser(*a, parents=[common], **kw)
  s = verb("show", help="print a plan's summary",
                     description="Print the summary of a saved plan.")
  s.add_argument("plan", help="a plan JSON file (Plan.to_json())")
  s.add_argument("--full", action="store_true", help="every leaf on its own line")
  s.set_defaults(run=_show)
  s = verb("diff", help="what changed between two plans",
                     description="List what changed from plan A to plan B: specs "
                     "(collapsed by layer), collectives, memory, objective.")
  s.add_argument("a", help="plan JSON file A")
  s.add_argument("b", help="plan JSON file B")
  s.set_defaults(run=_diff)
  s = verb("explain", help="why a leaf has its spec",
                     description="List each spec the leaf PATH names (a pytree path, "
                     "its slash form, or a glob) could have, with the objective, "
                     "collectives and memory of the plan re-solved with it: the ILPs "
                     "the plan's JSON saved, solved again, no step needed. A plan "
                     "saved without them shows the leaf's spec and why. With --step "
                     "and --args, plan the step again for the plan's mesh and costs "
                     "and explain that plan.")
  s.add_argument("plan", help="a plan JSON file")
  s.add_argument("path", help="e.g. \"*Block_0/Dense_0/kernel\"")
  s.add_argument("--step", help="module:function, the step the plan is of")
  s.add_argument("--args", help="module:function returning the step's arguments")
  s.set_defaults(run=_explain)
  s = verb("report", help="write a self-contained HTML report",
                     description="Write a plan's HTML report (no network needed to "
                     "view it) and print its path.")
  s.add_argument("plan", help="a plan JSON file")
  s.add_argument("-o", "--output", help="the HTML file (default: the plan's name .html)")
  s.set_defaults(run=_report)
  s = verb("plan", help="plan a step for an abstract mesh",
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
  """Runs the ``autopar`` command; returns its exit status: 0, 2 on an
  error (its whole message on stderr; with ``--traceback`` the traceback
  too), 141 where the reader of its output went away (``| head``), quietly."""
  args = _parser().parse_args(argv)
  try:
    try:
      args.run(args)
    finally:
      sys.stdout.flush()          # (a closed pipe is found here, not at exit)
  except BrokenPipeError:
    # Python's advice: point stdout at /dev/null, so that its flush at exit
    # finds no closed pipe either.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 128 + 13               # as a process killed by SIGPIPE
  except (_Fail, AutoparError) as e:
    if args.traceback:
      traceback.print_exc()
    print(f"autopar {args.verb}: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
