"""Time of ``plan.explain`` and ``plan.cost_if`` once the step is gone, on
the plan the planner made, on the plan read back from its JSON, and on the
plan a second process reads from a warm plan cache.

    python benchmark/explain.py

Plans the 24-layer GPT of ``tests/test_plan_reading.py`` (d=64, batch 64,
Adam) for an abstract 8 x 8 mesh, with a plan cache of its own (a
temporary directory), drops the step, and prints the seconds of planning, of
one ``explain`` of a block's MLP kernel and of one ``cost_if`` pinning it to
another candidate: the plan solves its kept ILPs again per candidate spec
(issue 44's goal: at most 5 s on this machine, however the plan was read).
Then the same from ``Plan.from_json(plan.to_json())`` (the first explain
reads the ILPs the JSON saved, and builds their problems), and from a second
process that plans the same step, which reads the plan from the cache
(``--from-cache DIR`` runs that part alone). Also: the plan's JSON size with
and without the saved ILPs (its ``"ilp"`` entry), and the seconds to write
and read it.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import jax  # noqa: E402
import optax  # noqa: E402

import autopar  # noqa: E402
from autopar.planner import solved  # noqa: E402
from autopar.planner.cache import planner_digest  # noqa: E402
from autopar.text import same_spec  # noqa: E402
from models import transformer_setup  # noqa: E402

LEAF = "state.params['params']['Block_5']['Dense_0']['kernel']"


def _planned():
  """The step planned (the plan cache on: ``$AUTOPAR_CACHE_DIR``), the step
  dropped; (plan, seconds)."""
  make_state, step, batch = transformer_setup(tx=optax.adam(1e-3), layers=24, batch=64, d=64)
  mesh = jax.sharding.AbstractMesh((8, 8), ("data", "model"))
  t0 = time.perf_counter()
  pf = autopar.parallelize(step, method=autopar.ShardParallel(mesh=mesh))
  plan = pf.plan(jax.eval_shape(make_state), batch)
  seconds = time.perf_counter() - t0
  del pf
  gc.collect()
  return plan, seconds


def _clock(fn):
  """(fn(), wall seconds, this process's CPU seconds: what a machine shared
  with other jobs changes less)."""
  t0, c0 = time.perf_counter(), time.process_time()
  out = fn()
  return out, time.perf_counter() - t0, time.process_time() - c0


def _timed(plan, other=None) -> dict:
  """Seconds of explain (twice: the first reads what the plan kept) and of
  cost_if pinning LEAF to ``other`` (default: the first other candidate)."""
  e, first, first_cpu = _clock(lambda: plan.explain(LEAF))
  _, again, again_cpu = _clock(lambda: plan.explain(LEAF))
  if other is None:
    other = next(c.spec for c in e.candidates
                 if c.objective is not None and not same_spec(c.spec, e.chosen))
  r, pinned, pinned_cpu = _clock(lambda: plan.cost_if({LEAF: other}))
  return {"explain": first, "explain_cpu": first_cpu, "explain_again": again,
          "explain_again_cpu": again_cpu, "cost_if": pinned, "cost_if_cpu": pinned_cpu,
          "solved": sum(c.objective is not None for c in e.candidates),
          "text": str(e), "after": r.after, "other": other}


def _from_cache(cache: str) -> None:
  """The second process: the plan from the warm cache, its numbers as JSON."""
  os.environ["AUTOPAR_CACHE_DIR"] = cache
  plan, seconds = _planned()
  assert plan.replan.problems == (), "the plan was not read from the cache"
  out = _timed(plan)
  out["other"] = autopar.plan.spec_to_json(out["other"])
  print(json.dumps({"plan": seconds, **out}))


def main() -> None:
  cache = tempfile.mkdtemp(prefix="autopar-explain-bench-")
  os.environ["AUTOPAR_CACHE_DIR"] = cache
  plan, planned = _planned()
  fresh = _timed(plan)
  line = lambda what, r: (
      f"  {what}: explain {r['explain']:.2f} s (cpu {r['explain_cpu']:.2f} s; again "
      f"{r['explain_again']:.2f} s, cpu {r['explain_again_cpu']:.2f} s; {r['solved']} "
      f"candidates solved), cost_if {r['cost_if']:.2f} s (cpu {r['cost_if_cpu']:.2f} s)")
  print(f"24-layer GPT, abstract 8x8 mesh: plan {planned:.2f} s (solved, stored in the "
        f"plan cache)")
  print(line("the planner's plan", fresh))

  text = plan.to_json(indent=None)
  without = json.loads(text)
  ilp = without.pop("ilp")
  # (Plan.to_json keeps the problems' text once written: the cache wrote it)
  _, written, written_cpu = _clock(functools.partial(
      solved.encode, plan.replan.problems, planner_digest()))
  _, read, read_cpu = _clock(functools.partial(solved.decode, ilp, planner_digest()))
  loaded = autopar.Plan.from_json(text)
  print(f"  JSON: {len(text) / 1e6:.2f} MB ({len(json.dumps(without)) / 1e6:.2f} MB "
        f"without the saved ILPs, which are {len(ilp) / 1e6:.2f} MB); the ILPs written "
        f"in {written:.2f} s (cpu {written_cpu:.2f} s), read and built in {read:.2f} s "
        f"(cpu {read_cpu:.2f} s)")
  del plan
  gc.collect()
  from_json = _timed(loaded, fresh["other"])
  print(line("read from JSON", from_json))

  r = subprocess.run([sys.executable, __file__, "--from-cache", cache],
                     capture_output=True, text=True, timeout=900)
  if r.returncode != 0:
    raise SystemExit(r.stderr[-3000:])
  second = json.loads(r.stdout.strip().splitlines()[-1])
  print(line(f"a second process, from the plan cache (planned in {second['plan']:.2f} s)",
             second))
  same = fresh["text"] == from_json["text"] == second["text"]
  print(f"  the three explanations are {'the same' if same else 'NOT the same'}")


if __name__ == "__main__":
  if sys.argv[1:2] == ["--from-cache"]:
    _from_cache(sys.argv[2])
  else:
    main()
