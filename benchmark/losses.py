"""The losses language models train with: what the whole batch's gradient costs.

    python benchmark/losses.py [--batch 64] [--seq 128] [--width 256] [--reps 10]

A small causal LM (embedding, 4 residual MLP blocks, a tied-free head) on 8
simulated CPU devices, data parallel over all of them, for 1 and 4
micro-batches, with three losses:

* ``mean``: ``mean(nll)`` over every token;
* ``token mean``: ``sum(nll * mask) / sum(mask)`` over a padding mask (a
  quarter of the rows wholly padding): its cotangent reads the mask's sum
  over the whole batch, which a first pass (``loss_sums``) computes;
* ``ratio``: ``-log(sum(exp(-nll) * mask))``: its cotangent reads a sum
  that depends on the parameters, so the first pass runs the forward pass.

For each it prints the stages one step runs, the step time against a
hand-written ``jax.jit`` of the same step (batch split over the mesh, state
replicated and donated: one program, the whole batch's loss), timed
interleaved in the same run (median of ``--reps``), and the largest
difference of the updated parameters from that step's.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import time  # noqa: E402
import warnings  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import autopar  # noqa: E402

VOCAB = 512


def init(width: int, seed: int = 0):
  keys = jax.random.split(jax.random.PRNGKey(seed), 10)
  normal = lambda k, *shape: jax.random.normal(k, shape) * 0.02
  return {"embed": normal(keys[0], VOCAB, width),
          "blocks": [{"w1": normal(keys[1 + 2 * i], width, 4 * width),
                      "w2": normal(keys[2 + 2 * i], 4 * width, width)} for i in range(4)],
          "head": normal(keys[9], width, VOCAB)}


def nll_of(params, tokens):
  h = params["embed"][tokens[:, :-1]]
  for b in params["blocks"]:
    h = h + jax.nn.gelu(h @ b["w1"]) @ b["w2"]
  return optax.softmax_cross_entropy_with_integer_labels(h @ params["head"], tokens[:, 1:])


LOSSES = {
    "mean": lambda p, b: jnp.mean(nll_of(p, b["tokens"])),
    "token mean": lambda p, b: jnp.sum(nll_of(p, b["tokens"]) * b["mask"]) / jnp.sum(b["mask"]),
    "ratio": lambda p, b: -jnp.log(jnp.sum(jnp.exp(-nll_of(p, b["tokens"])) * b["mask"])),
}


def make_step(loss):
  def step(state, batch):
    value, grads = autopar.value_and_grad(lambda p: loss(p, batch))(state.params)
    return state.apply_gradients(grads=grads), value
  return step


def median_time(fn, state, batch, reps):
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    state, loss = fn(state, batch)
    jax.block_until_ready((state, loss))
    times.append(time.perf_counter() - t0)
  return float(np.median(times)), state


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--seq", type=int, default=128)
  parser.add_argument("--width", type=int, default=256)
  parser.add_argument("--reps", type=int, default=10)
  opts = parser.parse_args()
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))   # Auto axes, for the jit
  rng = np.random.RandomState(0)
  tokens = rng.randint(0, VOCAB, (opts.batch, opts.seq + 1)).astype(np.int32)
  mask = (rng.rand(opts.batch, opts.seq) < 0.7).astype(np.float32)
  mask[: opts.batch // 4] = 0.0                  # a quarter of the rows: padding only
  batch = {"tokens": tokens, "mask": mask}
  tx = optax.sgd(1e-2, momentum=0.9)   # (Adam turns rounding into updates: docs)
  params = init(opts.width)
  make_state = lambda: jax.device_put(
      train_state.TrainState.create(apply_fn=None, params=jax.tree.map(jnp.copy, params),
                                    tx=tx),
      NamedSharding(mesh, P()))
  sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))
  print(f"{opts.batch} sequences of {opts.seq} tokens, width {opts.width}, "
        f"{sum(x.size for x in jax.tree.leaves(params)) / 1e6:.2f}M parameters, "
        f"DataParallel on 8 CPU devices; step time x hand-written jax.jit "
        f"(median of {opts.reps})\n")
  print(f"{'loss':<12} {'n':>2} {'stages':<58} {'x jit':>6} {'max |dparam|':>13}")
  for name, loss in LOSSES.items():
    step = make_step(loss)
    ref = jax.jit(step, donate_argnums=(0,))
    for n in (1, 4):
      pf = autopar.parallelize(step, method=autopar.DataParallel(
          mesh=mesh, num_micro_batches=n), batch_argnums=(1,))
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # the ratio's "forward pass once more"
        schedule = pf.get_executable(make_state(), sharded).schedule
        s_ap, s_ref = make_state(), make_state()
        s_ap, _ = pf(s_ap, sharded)          # compile both, one step each
        s_ref, _ = ref(s_ref, sharded)
        diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                   for a, b in zip(jax.tree.leaves(s_ap.params),
                                   jax.tree.leaves(s_ref.params)))
        t_ap, t_ref = [], []
        for _ in range(opts.reps):          # interleaved: the same machine load
          t, s_ap = median_time(pf, s_ap, sharded, 1)
          t_ap.append(t)
          t, s_ref = median_time(ref, s_ref, sharded, 1)
          t_ref.append(t)
      stages = " ".join(schedule)
      stages = stages if len(stages) <= 58 else stages[:55] + "..."
      print(f"{name:<12} {n:>2} {stages:<58} {np.median(t_ap) / np.median(t_ref):6.2f} "
            f"{diff:13.2e}")


if __name__ == "__main__":
  main()
