"""A second process on the caches the first left compiles nothing: every
stage of every method, pipeline stages included, is read from JAX's
persistent compilation cache under $AUTOPAR_CACHE_DIR, however quickly it
compiled, and the plan from the plan cache (issue 46)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")

CHILD = r'''
import json
import jax
from jax import monitoring
import autopar
from autopar.planner import lp
from models import mlp_setup

solve = lp.solve
def counted(*args):
  events["solves"] = events.get("solves", 0) + 1
  return solve(*args)
lp.solve = counted

events = {}
monitoring.register_event_listener(
    lambda name, **kw: events.__setitem__(name, events.get(name, 0) + 1))
make_state, step, batch = mlp_setup(batch=32, din=8, hidden=16, dout=4, layers=4)
quiet = autopar.AutoShardingOption(verbose=False)
methods = {
    "dp": autopar.DataParallel(mesh=jax.make_mesh((8,), ("data",)), num_micro_batches=2),
    "sp": autopar.ShardParallel(mesh=jax.make_mesh((2, 4), ("data", "model")),
                                num_micro_batches=2, option=quiet),
    "pp": autopar.PipeshardParallel(mesh=jax.make_mesh((8,), ("data",)),
                                    num_micro_batches=2, num_stages=2, option=quiet),
}
out = {}
for name, method in methods.items():
  state = make_state()
  jax.block_until_ready(state)
  events.clear()
  new, loss = autopar.parallelize(step, method=method)(state, batch)
  jax.block_until_ready(new)
  asked = events.get("/jax/compilation_cache/compile_requests_use_cache", 0)
  out[name] = {"compiled": asked - events.get("/jax/compilation_cache/cache_hits", 0),
               "read": asked, "solves": events.get("solves", 0), "loss": float(loss)}
print(json.dumps(out))
'''


def _run(cache) -> dict:
  env = dict(os.environ, AUTOPAR_CACHE_DIR=str(cache),
             PYTHONPATH=os.pathsep.join([ROOT, TESTS, os.environ.get("PYTHONPATH", "")]))
  r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                     text=True, timeout=600)
  assert r.returncode == 0, r.stderr
  return json.loads(r.stdout.splitlines()[-1])


def test_a_second_process_compiles_nothing(tmp_path):
  cold = _run(tmp_path)
  warm = _run(tmp_path)
  for name in cold:
    assert cold[name]["compiled"] > 0, cold
    assert warm[name]["compiled"] == 0 and warm[name]["solves"] == 0, (name, warm)
    assert warm[name]["read"] >= cold[name]["compiled"], (name, cold, warm)
    assert warm[name]["loss"] == cold[name]["loss"], (name, cold, warm)
