"""A second process on the caches the first left compiles nothing, and
plans nothing: the plan comes from the plan cache; an SPMD step's stages
are loaded from the stages autopar kept under $AUTOPAR_CACHE_DIR (nothing
traced or lowered), a pipeline's read from JAX's persistent compilation
cache there, however quickly they compiled (issue 46). Stages kept for one
step are never another's: a step that closes over other values is compiled
again."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")

CHILD = r'''
import json
import jax
import numpy as np
from jax import monitoring
import autopar
from autopar.planner import lp
from models import mlp_setup

solve = lp.solve
def counted(*args):
  events["solves"] = events.get("solves", 0) + 1
  return solve(*args)
lp.solve = counted

from autopar.backend import saved_stages
prefetch = saved_stages.prefetch
def prefetching(*args):
  found = prefetch(*args)
  events["prefetched"] = events.get("prefetched", 0) + (found is not None)
  return found
saved_stages.prefetch = prefetching

events = {}
monitoring.register_event_listener(
    lambda name, **kw: events.__setitem__(name, events.get(name, 0) + 1))
monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: events.__setitem__(name, events.get(name, 0) + 1))
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
               "read": asked, "solves": events.get("solves", 0), "loss": float(loss),
               "state": [np.asarray(x).tolist() for x in jax.tree.leaves(new)],
               "prefetched": events.get("prefetched", 0),
               "lowered": events.get("/jax/core/compile/jaxpr_to_mlir_module_duration", 0),
               "traced": events.get("/jax/core/compile/jaxpr_trace_duration", 0)}
print(json.dumps(out))
'''


def _run(cache, child=CHILD, **env) -> dict:
  env = dict(os.environ, AUTOPAR_CACHE_DIR=str(cache), **env,
             PYTHONPATH=os.pathsep.join([ROOT, TESTS, os.environ.get("PYTHONPATH", "")]))
  r = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True,
                     text=True, timeout=600)
  assert r.returncode == 0, r.stderr
  return json.loads(r.stdout.splitlines()[-1])


def test_a_second_process_compiles_nothing(tmp_path):
  cold = _run(tmp_path)
  warm = _run(tmp_path)
  for name in cold:
    assert cold[name]["compiled"] > 0, cold
    assert warm[name]["compiled"] == 0 and warm[name]["solves"] == 0, (name, warm)
    assert warm[name]["loss"] == cold[name]["loss"], (name, cold, warm)
    assert warm[name]["state"] == cold[name]["state"], name
  # The SPMD steps' stages loaded whole, from the hint the first process
  # left (while the step was traced): none traced, lowered or compiled.
  for name in ("dp", "sp"):
    assert warm[name]["lowered"] == 0 and warm[name]["read"] == 0, (name, warm)
    assert cold[name]["prefetched"] == 0 and warm[name]["prefetched"] == 1, (name, warm)
  assert warm["pp"]["read"] >= cold["pp"]["compiled"], (cold, warm)


# A step that closes over an array (the digest of its program counts the
# array, not its values), under ShardParallel, in bfloat16 summed as such.
CONSTANT = r'''
import json, os
import jax, jax.numpy as jnp, numpy as np
from jax import monitoring
import autopar

events = {}
monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: events.__setitem__(name, events.get(name, 0) + 1))
weights = np.linspace(0.5, float(os.environ["TOP"]), 6).astype(np.float32)

def step(w, batch):
  def loss_fn(w):
    return jnp.sum(weights * jnp.tanh(batch @ w)) / batch.shape[0]
  loss, g = autopar.value_and_grad(loss_fn)(w)
  return w - 0.1 * g, loss

w = jnp.asarray(np.random.RandomState(0).randn(4, 6), jnp.bfloat16)
x = jnp.asarray(np.random.RandomState(1).randn(16, 4), jnp.bfloat16)
method = autopar.ShardParallel(mesh=jax.make_mesh((4, 2), ("data", "model")),
                               num_micro_batches=2, grad_accumulation_dtype=None,
                               option=autopar.AutoShardingOption(verbose=False))
events.clear()
new, loss = autopar.parallelize(step, method=method)(w, x)
print(json.dumps({"loss": float(loss), "w": np.asarray(new, np.float32).tolist(),
                  "lowered": events.get("/jax/core/compile/jaxpr_to_mlir_module_duration", 0)}))
'''


def test_kept_stages_are_the_steps_own(tmp_path):
  one = _run(tmp_path / "a", CONSTANT, TOP="1.0")
  again = _run(tmp_path / "a", CONSTANT, TOP="1.0")
  other = _run(tmp_path / "a", CONSTANT, TOP="3.0")
  fresh = _run(tmp_path / "b", CONSTANT, TOP="3.0")
  assert one["lowered"] > 0 and again["lowered"] == 0, (one, again)
  assert (again["loss"], again["w"]) == (one["loss"], one["w"])
  # Other constants: compiled again, as a process on empty caches does.
  assert other["lowered"] > 0, other
  assert (other["loss"], other["w"]) == (fresh["loss"], fresh["w"])
  assert other["loss"] != one["loss"]


# Stages kept broken (here: read from JAX's cache, which the store's check
# is made not to see; reloaded, such an executable lacks some of its code
# and fails once its outputs are read).
BROKEN = r'''
import json, warnings
from unittest import mock
import jax, numpy as np
import autopar
from autopar.backend import lower, saved_stages
from models import mlp_setup

make_state, step, batch = mlp_setup(batch=32, din=8, hidden=16, dout=4, layers=2)
method = autopar.DataParallel(mesh=jax.make_mesh((8,), ("data",)), num_micro_batches=2)
run = lambda donate: autopar.parallelize(step, method=method, donate_argnums=donate)
flat = lambda tree: [np.asarray(x).tolist() for x in jax.tree.leaves(tree)]
out = {}
with mock.patch.object(saved_stages, "keeps", lambda: False):
  new, loss = run("auto")(make_state(), batch)             # in JAX's cache only
  out["expected"] = [float(loss), flat(new)]

def broken(donate):
  with mock.patch.object(lower.StageCompiler, "compiled_here", lambda self: True):
    run(donate)(make_state(), batch)                        # kept from JAX's cache
  return len([f for f in saved_stages._dir().iterdir() if f.is_file()])

out["kept"] = broken(())
step_ = run(())
with warnings.catch_warnings(record=True) as caught:
  warnings.simplefilter("always")
  new, loss = step_(make_state(), batch)                    # nothing donated: run again
  out["again"] = [float(loss), flat(new)]
out["warned"] = [str(w.message) for w in caught if "failed on their first run" in str(w.message)]
out["removed"] = sorted(f.suffix for f in saved_stages._dir().iterdir() if f.is_file())
new, loss = step_(make_state(), batch)
out["second"] = [float(loss), flat(new)]

broken("auto")
step_, state = run("auto"), make_state()
try:
  step_(state, batch)
  out["raised"] = None
except autopar.KeptStagesError as e:
  out["raised"] = str(e)
new, loss = step_(make_state(), batch)                      # the stages compiled since
out["after"] = [float(loss), flat(new)]
print(json.dumps(out))
'''


def test_kept_stages_that_fail_to_run_are_compiled_again(tmp_path):
  out = _run(tmp_path, BROKEN)
  assert out["kept"] == 1, out
  assert out["warned"] and out["again"] == out["expected"], out
  # The file is gone, and marked so that its key is not kept again.
  assert out["removed"] == [".failed"], out
  assert out["second"] == out["expected"]
  # Where the failed run used up the donated state, the error says so.
  assert out["raised"] and "used up the arrays the step donates" in out["raised"], out
  assert out["after"] == out["expected"]


# Within one process: a second step of the same program on the same mesh
# loads the stages the first kept; on the mesh's devices in another order,
# or under a JAX option read only when the stages compile, it compiles its
# own. (A process of its own: stages loaded onto the wrong devices abort it.)
DEVICES = r'''
import dataclasses, json
import jax, jax.numpy as jnp, numpy as np
import autopar

def step(w, x):
  def loss_fn(w):
    return jnp.mean(jnp.sin(x @ w) ** 2)
  loss, g = autopar.value_and_grad(loss_fn)(w)
  return w - 0.5 * g, loss

w = np.random.RandomState(0).randn(6, 3).astype(np.float32)
x = np.random.RandomState(1).randn(16, 6).astype(np.float32)
devices = np.asarray(jax.devices()[:8]).reshape(4, 2)
mesh = jax.sharding.Mesh(devices, ("data", "model"))
flipped = jax.sharding.Mesh(devices[::-1, ::-1], ("data", "model"))
make = lambda mesh: autopar.parallelize(
    step, method=autopar.DataParallel(mesh=mesh, num_micro_batches=2))

def run(mesh):
  f = make(mesh)
  new, loss = f(w, x)
  return [f.get_executable(w, x).lowered.loaded_from is not None,
          np.asarray(new).tolist(), float(loss)]

out = {"first": run(mesh)}
# Loaded, and copied with another plan before its first run (as the memory
# budget's choice is): the copy's first run is checked too.
exe = make(mesh).get_executable(w, x)
copy = dataclasses.replace(exe, plan=exe.plan)
checked = [exe.recompile is not None, copy.recompile is not None]
new, loss = copy(w, x)
out["copy"] = [checked + [copy.recompile is None], np.asarray(new).tolist(), float(loss)]
out["again"] = run(mesh)
out["other order"] = run(flipped)
jax.config.update("jax_disable_most_optimizations", True)
out["other option"] = run(mesh)
print(json.dumps(out))
'''


def test_kept_stages_load_only_for_their_devices_and_configuration(tmp_path):
  import numpy as np
  out = _run(tmp_path, DEVICES)
  assert not out["first"][0] and out["again"][0], out
  assert out["copy"][0] == [True, True, True], out
  assert not out["other order"][0] and not out["other option"][0], out
  for name in ("copy", "again", "other order", "other option"):
    np.testing.assert_allclose(out[name][1], out["first"][1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out[name][2], out["first"][2], rtol=1e-5)
