"""Host time per steady-state call: autopar's step against ``jax.jit``'s.

    python benchmark/dispatch.py [--leaves 100 1000 5000] [--calls 30] [--rounds 3]

A step whose state has ``--leaves`` parameter leaves (a dict of small
matrices, SGD with momentum: three leaves each in the train state), on 8
simulated CPU devices, data parallel, one micro-batch. Per call, the time
until the call returns (work is dispatched asynchronously; each call's
outputs are waited for before the next call, outside the timed part), the
median over ``--calls`` calls after two warm-up calls, and of that the median
over ``--rounds`` rounds that take turns (jit, autopar, autopar with two
executables, then again):

* ``jax.jit``: the same step written by hand (batch split over the mesh,
  state replicated and donated);
* autopar ``DataParallel``: its call (at one micro-batch the gradient and
  the update are one executable, the default), against the bound issue 34
  sets: executables x ``jax.jit``'s time + 0.5 ms;
* autopar ``DataParallel(one_executable=False)``: the gradient and the
  update as two executables, against two ``jax.jit``s written by hand (the
  gradient's, then the update's) + 0.5 ms. Not against 2 x one
  ``jax.jit``: on XLA:CPU a call whose inputs are still being computed
  returns only once they are (measured: a second ``jax.jit`` call on the
  first one's state waits for it), so the second executable's dispatch
  includes the first one's run, for autopar and by hand alike; a GPU
  enqueues it and returns.

Timings are this machine's (2 CPU cores); the ratios are measured side by
side in one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import autopar  # noqa: E402


def setup(num_leaves: int, batch: int = 64, width: int = 8):
  """A train state of ``num_leaves`` parameter leaves and a batch."""
  rng = np.random.RandomState(0)
  params = {f"w{i:05d}": jnp.asarray(rng.randn(width, width).astype(np.float32) * 0.1)
            for i in range(num_leaves)}
  tx = optax.sgd(1e-3, momentum=0.9)
  state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
  data = {"x": rng.randn(batch, width).astype(np.float32),
          "y": rng.randn(batch, width).astype(np.float32)}

  def loss_fn(p, batch):
    h = batch["x"]
    total = 0.0
    for w in p.values():                # every leaf read: each has a gradient
      total = total + jnp.mean((h @ w - batch["y"]) ** 2)
    return total / len(p)

  def step(state, batch):
    loss, grads = autopar.value_and_grad(loss_fn)(state.params, batch)
    return state.apply_gradients(grads=grads), loss

  def plain_step(state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
    return state.apply_gradients(grads=grads), loss

  return state, data, step, plain_step, loss_fn


def two_jits(loss_fn, rep, shard):
  """The step as two ``jax.jit``s written by hand, the gradient's and the
  update's, called one after the other (what autopar's two executables do)."""
  grad = jax.jit(jax.value_and_grad(loss_fn), in_shardings=(rep, shard),
                 out_shardings=rep)
  apply = jax.jit(lambda state, grads: state.apply_gradients(grads=grads),
                  in_shardings=(rep, rep), out_shardings=rep, donate_argnums=(0,))

  def step(state, batch):
    loss, grads = grad(state.params, batch)
    return apply(state, grads), loss
  return step


def host_times(call, state, batch, calls: int) -> list[float]:
  """Seconds until each call returns; outputs waited for between calls."""
  out = []
  for i in range(calls + 2):
    t = time.perf_counter()
    state, loss = call(state, batch)
    dt = time.perf_counter() - t
    jax.block_until_ready((state, loss))
    if i >= 2:
      out.append(dt)
  return out


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--leaves", type=int, nargs="+", default=[100, 1000, 5000])
  parser.add_argument("--calls", type=int, default=30)
  parser.add_argument("--rounds", type=int, default=3)
  args = parser.parse_args()
  mesh = jax.make_mesh((8,), ("data",))
  print(f"host time per call, median of {args.calls} calls, median of {args.rounds} "
        f"interleaved rounds (8 CPU devices, data parallel, 1 micro-batch)")
  print(f"{'leaves':>7} {'jax.jit ms':>11} {'autopar ms':>11} {'bound ms':>9} "
        f"{'ratio':>6} {'2 jax.jit ms':>12} {'2 exes ms':>10} {'bound ms':>9} {'ratio':>6}")
  for n in args.leaves:
    state, data, step, plain_step, loss_fn = setup(n)
    rep = NamedSharding(mesh, P())
    shard = NamedSharding(mesh, P("data"))
    jitted = jax.jit(plain_step, in_shardings=(rep, shard), out_shardings=(rep, rep),
                     donate_argnums=(0,))
    batch = jax.device_put(data, shard)
    host = jax.tree.map(np.asarray, state)             # each run donates its own copy
    fresh = lambda: jax.device_put(host, rep)           # noqa: E731
    one = autopar.parallelize(step, method=autopar.DataParallel(mesh=mesh))
    two = autopar.parallelize(step, method=autopar.DataParallel(mesh=mesh,
                                                                one_executable=False))
    # (Compiled for the state as the calls pass it: its step counter an
    # array, not the weakly typed Python int of TrainState.create.)
    assert len(one.get_executable(host, data).schedule) == 1
    assert len(two.get_executable(host, data).schedule) == 2
    # Interleaved rounds: this machine's speed drifts by 10-20 % between runs
    # of a few seconds, so each figure is the median over rounds of its
    # median per round.
    calls = {"jit": jitted, "one": one, "two jits": two_jits(loss_fn, rep, shard), "two": two}
    rounds = {k: [] for k in calls}
    for _ in range(args.rounds):
      for name, call in calls.items():
        rounds[name].append(statistics.median(host_times(call, fresh(), batch, args.calls)))
    t = {k: statistics.median(v) for k, v in rounds.items()}
    print(f"{n:>7} {t['jit'] * 1e3:>11.2f} {t['one'] * 1e3:>11.2f} "
          f"{(t['jit'] + 0.5e-3) * 1e3:>9.2f} {t['one'] / t['jit']:>6.2f} "
          f"{t['two jits'] * 1e3:>12.2f} {t['two'] * 1e3:>10.2f} "
          f"{(t['two jits'] + 0.5e-3) * 1e3:>9.2f} {t['two'] / t['two jits']:>6.2f}", flush=True)


if __name__ == "__main__":
  main()
