"""autopar's apply_grad (one XLA program over every leaf) against optax jitted.

    python benchmark/fused_optimizer.py [--layers 12] [--hidden 512] [--gpu]

The optimizer update of a GPT-style parameter tree (Adam), run three ways on
one device, measured side by side in one run:

* autopar: the ``apply_grad`` stage of a parallelized step -- every
  parameter and optimizer-state leaf updated in one compiled program, the
  state's buffers donated and updated in place;
* optax jitted whole: ``tx.update`` + ``optax.apply_updates`` over the
  whole tree in one ``jax.jit`` with the parameters and state donated, as a
  hand-written JAX training loop runs it: the baseline the ratios are
  against (``x jit``). (JAX pairs donated buffers with outputs by shape and
  dtype, and a leaf's parameter and moments share both, so XLA may copy:
  see docs/memory.md);
* optax leaf by leaf: the same jitted per parameter leaf (one program per
  leaf, buffers donated), as a loop over parameters would run it;
* optax eager: the same update on the whole tree without ``jit`` (one
  dispatch per operation and leaf).

It also prints the bytes the fused program reads and writes
(``cost_analysis()``) against one pass over memory: for Adam, reading the
parameter, gradient and both moments and writing the parameter and both
moments, 7 x the parameter bytes. All give the same parameters (checked).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

_ARGS = argparse.ArgumentParser(description=__doc__.split("\n")[0])
_ARGS.add_argument("--layers", type=int, default=12)
_ARGS.add_argument("--hidden", type=int, default=512)
_ARGS.add_argument("--steps", type=int, default=10)
_ARGS.add_argument("--gpu", action="store_true", help="run on the GPU")
OPTS = _ARGS.parse_args()
if not OPTS.gpu:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402

import autopar  # noqa: E402


def gpt_params(layers, d, vocab=8192, seq=512):
  keys = iter(jax.random.split(jax.random.PRNGKey(0), 8 * layers + 4))
  normal = lambda *shape: jax.random.normal(next(keys), shape) * 0.02
  def layer():
    return {"ln1": {"scale": jnp.ones(d), "bias": jnp.zeros(d)},
            "qkv": {"kernel": normal(d, 3 * d), "bias": jnp.zeros(3 * d)},
            "out": {"kernel": normal(d, d), "bias": jnp.zeros(d)},
            "ln2": {"scale": jnp.ones(d), "bias": jnp.zeros(d)},
            "mlp_in": {"kernel": normal(d, 4 * d), "bias": jnp.zeros(4 * d)},
            "mlp_out": {"kernel": normal(4 * d, d), "bias": jnp.zeros(d)}}
  return {"embed": normal(vocab, d), "pos": normal(seq, d),
          "layers": [layer() for _ in range(layers)], "head": normal(d, vocab)}


def timed(fn, steps):
  out = fn()                       # warm-up (compiles)
  jax.block_until_ready(out)
  t0 = time.perf_counter()
  for _ in range(steps):
    out = fn()
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / steps


def main():
  dev = jax.devices()[0]
  tx = optax.adam(1e-3)
  params = gpt_params(OPTS.layers, OPTS.hidden)
  grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)
  n_leaves = len(jax.tree.leaves(params))
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  print(f"Adam over {n_leaves} leaves, {param_bytes / 2**20:.1f} MiB of parameters, "
        f"on one {dev.platform} device, {OPTS.steps} updates each\n")

  # autopar: the apply_grad stage of a parallelized step whose gradient is
  # the fixed `grads` above (the stage is called directly, in place).
  def step(state, batch):
    def loss_fn(p):
      return sum(jnp.vdot(g, x) for g, x in zip(jax.tree.leaves(grads),
                                                 jax.tree.leaves(p))) * batch["w"].mean()
    _, g = autopar.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=g)
  mesh = jax.make_mesh((1,), ("data",), devices=[dev])
  make = lambda: train_state.TrainState.create(apply_fn=None, tx=tx,
                                               params=jax.tree.map(jnp.copy, params))
  # (The update's own executable: one_executable=False.)
  p = autopar.parallelize(step, method=autopar.DataParallel(mesh=mesh, one_executable=False),
                          donate_argnums=(0,))
  batch = {"w": np.ones((1,), np.float32)}
  exe = p.get_executable(make(), batch)
  apply = exe.stages["apply_grad"]
  lw = exe.lowered
  leaves = exe.place(jax.tree.leaves((make(), batch)))
  box = {"donated": [leaves[k] for k in lw.donated]}
  kept = [leaves[k] for k in lw.kept]
  grad_leaves = jax.device_put(jax.tree.leaves(grads), apply.input_shardings[0][2])
  n_state = len(box["donated"])

  def fused():
    outs = apply(box["donated"], kept, grad_leaves)
    box["donated"] = [outs[exe.split.out_index[j]] for j in range(n_state)]
    return box["donated"]
  t_fused = timed(fused, OPTS.steps)
  fused_params = jax.tree.unflatten(jax.tree.structure(make()), box["donated"]).params

  # optax, the whole tree in one jitted update (the hand-written baseline).
  whole = {"p": jax.tree.map(jnp.copy, params)}
  whole["s"] = tx.init(whole["p"])

  def update(g, s, x):
    u, s = tx.update(g, s, x)
    return optax.apply_updates(x, u), s
  update = jax.jit(update, donate_argnums=(1, 2))

  def jitted():
    whole["p"], whole["s"] = update(grads, whole["s"], whole["p"])
    return whole["p"]
  t_jit = timed(jitted, OPTS.steps)

  # optax, one jitted update per parameter leaf.
  p_leaves = [jnp.copy(x) for x in jax.tree.leaves(params)]
  g_leaves = jax.tree.leaves(grads)
  s_leaves = [tx.init(x) for x in p_leaves]

  def one_leaf(g, s, x):
    u, s = tx.update(g, s, x)
    return optax.apply_updates(x, u), s
  one_leaf = jax.jit(one_leaf, donate_argnums=(1, 2))

  def per_leaf():
    for i in range(len(p_leaves)):
      p_leaves[i], s_leaves[i] = one_leaf(g_leaves[i], s_leaves[i], p_leaves[i])
    return p_leaves
  t_leaf = timed(per_leaf, OPTS.steps)

  # optax eager on the whole tree.
  eager = {"p": jax.tree.map(jnp.copy, params)}
  eager["s"] = tx.init(eager["p"])

  def unjitted():
    with jax.disable_jit():
      u, eager["s"] = tx.update(grads, eager["s"], eager["p"])
      eager["p"] = optax.apply_updates(eager["p"], u)
    return eager["p"]
  t_eager = timed(unjitted, max(1, OPTS.steps // 5))

  # Same numbers? (the eager run did fewer updates: compare the other two)
  for a, b, c in zip(jax.tree.leaves(fused_params), p_leaves, jax.tree.leaves(whole["p"])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-5, atol=1e-7)

  accessed = apply.cost_analysis().get("bytes accessed", float("nan"))
  print(f"{'update':<26} {'ms':>9} {'x jit':>8} {'programs':>9}")
  print(f"{'autopar apply_grad':<26} {t_fused * 1e3:9.2f} {t_fused / t_jit:8.2f} {1:>9}")
  print(f"{'optax, jit whole tree':<26} {t_jit * 1e3:9.2f} {1:8.2f} {1:>9}")
  print(f"{'optax, jit per leaf':<26} {t_leaf * 1e3:9.2f} {t_leaf / t_jit:8.2f} "
        f"{n_leaves:>9}")
  print(f"{'optax, eager':<26} {t_eager * 1e3:9.2f} {t_eager / t_jit:8.2f} "
        f"{'per op':>9}")
  print(f"\nfused program: {accessed / 2**20:.1f} MiB read and written; one pass over "
        f"memory (7 x parameters) is {7 * param_bytes / 2**20:.1f} MiB: "
        f"x{accessed / (7 * param_bytes):.2f}")


if __name__ == "__main__":
  main()
