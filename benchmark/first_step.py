"""Time to the first step: autopar against jax.jit of the same step.

    python benchmark/first_step.py [layers ...] [--rounds 3]   # default: 12 24

The model is benchmark/planner.py's GPT written in plain JAX (a Python loop
over the layers; here hidden 128, 4 heads, vocab 256, 64 tokens, batch 16,
Adam: 377 leaves of the train state at 12 layers, 737 at 24), on 8 simulated CPU devices.
Each figure is one fresh process's first call, from the call to the
updated state on the host:

- jax.jit cold: ``jax.jit(step)`` (``autopar.value_and_grad`` is
  ``jax.value_and_grad`` there), JAX's persistent compilation cache empty;
- jax.jit warm: a second process on the same JAX persistent cache (what a
  user of jax.jit gets on a second run);
- autopar cold, per method (DataParallel with 2 micro-batches, ShardParallel
  2 x 4 with 2 micro-batches, both at CPUs' default ``grad_sync="apart"``,
  one gradient module; DataParallel with ``grad_sync="last"``, GPUs'
  default, two gradient modules; PipeshardParallel with 2 stages of 4 devices
  and 4 micro-batches): empty plan and compilation caches, planning
  included;
- autopar warm: a second process on the same caches (the plan and the
  compiled stages are read from $AUTOPAR_CACHE_DIR: an SPMD step's stages
  loaded whole, a pipeline's read from JAX's cache).

The processes of a round run one after the other, rounds take turns, and
each figure is the median over ``--rounds`` rounds. Printed per depth:
seconds, each figure's ratio to jax.jit cold, and each warm figure's ratio
to jax.jit warm, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child(mode: str, layers: int) -> None:
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, os.path.join(HERE, ".."))
  sys.path.insert(0, HERE)
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from flax.training import train_state

  import autopar
  from planner import init_params, lm_step, make_apply

  d, heads, vocab, seq, batch = 128, 4, 256, 64, 16
  shapes = init_params(layers, d, heads, vocab, seq)
  rng = np.random.RandomState(0)
  params = jax.tree.map(lambda s: jnp.asarray(rng.randn(*s.shape) * 0.02, s.dtype), shapes)
  state = train_state.TrainState.create(apply_fn=make_apply(heads), params=params,
                                        tx=optax.adam(1e-3))
  tokens = {"tokens": rng.randint(0, vocab, size=(batch, seq + 1)).astype(np.int32)}
  quiet = autopar.AutoShardingOption(verbose=False)
  if mode == "jit":
    step = jax.jit(lm_step)
  elif mode == "dp":
    step = autopar.parallelize(lm_step, method=autopar.DataParallel(
        mesh=jax.make_mesh((8,), ("data",)), num_micro_batches=2))
  elif mode == "dpl":
    step = autopar.parallelize(lm_step, method=autopar.DataParallel(
        mesh=jax.make_mesh((8,), ("data",)), num_micro_batches=2, grad_sync="last"))
  elif mode == "sp":
    step = autopar.parallelize(lm_step, method=autopar.ShardParallel(
        mesh=jax.make_mesh((2, 4), ("data", "model")), num_micro_batches=2, option=quiet))
  else:
    step = autopar.parallelize(lm_step, method=autopar.PipeshardParallel(
        mesh=jax.make_mesh((8,), ("data",)), num_micro_batches=4, num_stages=2,
        option=quiet))
  t0 = time.perf_counter()
  new_state, loss = step(state, tokens)
  jax.block_until_ready(new_state)
  seconds = time.perf_counter() - t0
  print(json.dumps({"seconds": seconds, "loss": float(loss),
                    "leaves": len(jax.tree.leaves(state))}))


def run(mode: str, layers: int, cache: str) -> dict:
  """One fresh process's first call, on the caches in ``cache``."""
  env = dict(os.environ)
  env["AUTOPAR_CACHE_DIR"] = cache
  if mode == "jit":
    # jax.jit on JAX's persistent cache, kept as autopar keeps its stages.
    env["JAX_COMPILATION_CACHE_DIR"] = os.path.join(cache, "jax")
  out = subprocess.run([sys.executable, __file__, "--child", mode, str(layers)],
                       check=True, capture_output=True, text=True, env=env).stdout
  return json.loads(out.strip().splitlines()[-1])


MODES = (("jit", "jax.jit"), ("dp", "DataParallel"), ("dpl", "DataParallel last"),
         ("sp", "ShardParallel"), ("pp", "PipeshardParallel"))


def main(depths, rounds: int) -> None:
  for layers in depths:
    times: dict[tuple[str, str], list[float]] = {}
    loss = {}
    leaves = 0
    for _ in range(rounds):
      for mode, _name in MODES:
        cache = tempfile.mkdtemp(prefix=f"first-step-{mode}-")
        for kind in ("cold", "warm"):
          got = run(mode, layers, cache)
          times.setdefault((mode, kind), []).append(got["seconds"])
          loss.setdefault(mode, got["loss"])
          leaves = got["leaves"]
        shutil.rmtree(cache, ignore_errors=True)
    for mode, name in MODES[1:]:
      assert abs(loss[mode] - loss["jit"]) < 1e-4 * abs(loss["jit"]), (name, loss)
    med = {k: statistics.median(v) for k, v in times.items()}
    cold, warm = med["jit", "cold"], med["jit", "warm"]
    print(f"first call of a {layers}-layer GPT ({leaves} leaves), 8 CPU devices, "
          f"medians of {rounds} rounds")
    print(f"{'':36s} {'seconds':>8s} {'x jit cold':>11s} {'x jit warm':>11s}")
    for mode, name in MODES:
      for kind in ("cold", "warm"):
        s = med[mode, kind]
        versus = f"{s / warm:11.2f}" if kind == "warm" else f"{'':11s}"
        print(f"{name + ', ' + kind:36s} {s:8.2f} {s / cold:11.2f} {versus}")
    print(flush=True)


if __name__ == "__main__":
  if sys.argv[1:2] == ["--child"]:
    child(sys.argv[2], int(sys.argv[3]))
  else:
    parser = argparse.ArgumentParser()
    parser.add_argument("layers", nargs="*", type=int, default=[12, 24])
    parser.add_argument("--rounds", type=int, default=3)
    a = parser.parse_args()
    main(a.layers, a.rounds)
