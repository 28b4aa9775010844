"""Time to the first step: autopar against jax.jit of the same step.

    python benchmark/first_step.py [layers]        # default 24

The model is benchmark/planner.py's GPT written in plain JAX (a Python loop
over the layers; here hidden 128, 4 heads, vocab 256, 64 tokens, batch 16,
Adam: 16 leaves a layer, 390 for 24 layers), on 8 simulated CPU devices.
Each figure is one fresh process's first call, from the call to the
updated state on the host:

- jax.jit cold: ``jax.jit(step)`` (``autopar.value_and_grad`` is
  ``jax.value_and_grad`` there), JAX's persistent compilation cache off;
- autopar cold, per method (DataParallel with 2 micro-batches, ShardParallel
  2 x 4 with 2 micro-batches): empty plan and compilation caches,
  planning included;
- autopar warm: a second process on the same caches (the plan and the
  compiled stages are read from $AUTOPAR_CACHE_DIR).

Printed: seconds, and each figure's ratio to jax.jit cold measured in the
same run.
"""

from __future__ import annotations

import json
import os
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
  if mode == "jit":
    step = jax.jit(lm_step)
  else:
    mesh = (jax.make_mesh((8,), ("data",)) if mode == "dp" else
            jax.make_mesh((2, 4), ("data", "model")))
    method = (autopar.DataParallel(mesh=mesh, num_micro_batches=2) if mode == "dp" else
              autopar.ShardParallel(mesh=mesh, num_micro_batches=2,
                                    option=autopar.AutoShardingOption(verbose=False)))
    step = autopar.parallelize(lm_step, method=method)
  t0 = time.perf_counter()
  new_state, loss = step(state, tokens)
  jax.block_until_ready(new_state)
  seconds = time.perf_counter() - t0
  print(json.dumps({"seconds": seconds, "loss": float(loss),
                    "leaves": len(jax.tree.leaves(state))}))


def run(mode: str, layers: int, cache: str | None) -> dict:
  env = dict(os.environ)
  if cache is None:
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    env["AUTOPAR_CACHE_DIR"] = tempfile.mkdtemp(prefix="first-step-jit-")
  else:
    env["AUTOPAR_CACHE_DIR"] = cache
  out = subprocess.run([sys.executable, __file__, "--child", mode, str(layers)],
                       check=True, capture_output=True, text=True, env=env).stdout
  return json.loads(out.strip().splitlines()[-1])


def main(layers: int) -> None:
  rows = []
  jit = run("jit", layers, None)
  rows.append(("jax.jit, cold", jit["seconds"]))
  for mode, name in (("dp", "DataParallel"), ("sp", "ShardParallel")):
    cache = tempfile.mkdtemp(prefix=f"first-step-{mode}-")
    cold = run(mode, layers, cache)
    warm = run(mode, layers, cache)
    assert abs(cold["loss"] - jit["loss"]) < 1e-4 * abs(jit["loss"]), (cold, jit)
    rows.append((f"{name}, cold (empty caches)", cold["seconds"]))
    rows.append((f"{name}, warm (second process)", warm["seconds"]))
  print(f"first call of a {layers}-layer GPT ({jit['leaves']} leaves), 8 CPU devices")
  print(f"{'':40s} {'seconds':>8s} {'x jax.jit cold':>15s}")
  for name, s in rows:
    print(f"{name:40s} {s:8.2f} {s / jit['seconds']:15.2f}")


if __name__ == "__main__":
  if sys.argv[1:2] == ["--child"]:
    child(sys.argv[2], int(sys.argv[3]))
  else:
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 24)
