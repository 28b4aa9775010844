"""Gradient accumulation: communication, memory and step time vs micro-batches.

    python benchmark/grad_accumulation.py [--batch 256] [--width 1024] [--reps 15]

For num_micro_batches n in {1, 2, 4, 8}, on 8 simulated CPU devices (data
parallel over all of them), prints:

* the collectives one step runs and the bytes each device sends for them
  (ring formulas over the compiled HLO of every stage in the schedule);
* peak temp memory per device (the largest ``memory_analysis()`` temp size
  of the stages), and that minus one gradient-sized copy per device (an
  estimate of the activations, which should fall roughly as 1/n);
* step time as a ratio against a hand-written ``jax.jit`` data-parallel step
  (batch split over the mesh, state replicated and donated) on the same mesh,
  timed interleaved in the same run (median of ``--reps``).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import time  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import autopar  # noqa: E402
from autopar.backend import hlo  # noqa: E402


class MLP(nn.Module):
  width: int
  layers: int = 4

  @nn.compact
  def __call__(self, x):
    for _ in range(self.layers):
      x = nn.relu(nn.Dense(self.width)(x))
    return nn.Dense(16)(x)


def setup(batch, width):
  model = MLP(width)
  rng = np.random.RandomState(0)
  data = {"x": rng.randn(batch, 256).astype(np.float32),
          "y": rng.randn(batch, 16).astype(np.float32)}
  params = model.init(jax.random.PRNGKey(0), data["x"][:1])
  tx = optax.sgd(1e-3, momentum=0.9)   # one object: it is pytree metadata

  def make_state():
    return train_state.TrainState.create(
        apply_fn=model.apply, params=jax.tree.map(jnp.array, params), tx=tx)

  def step(state, batch):
    def loss_fn(p):
      return jnp.mean((state.apply_fn(p, batch["x"]) - batch["y"]) ** 2)
    loss, grads = autopar.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  return make_state, step, data


def timed(fn, state, batch):
  t0 = time.perf_counter()
  state, loss = fn(state, batch)
  jax.block_until_ready((state, loss))
  return state, time.perf_counter() - t0


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--batch", type=int, default=4096)
  ap.add_argument("--width", type=int, default=512)
  ap.add_argument("--reps", type=int, default=21)
  args = ap.parse_args()

  # An Auto-axes mesh: the hand-written step relies on XLA's propagation.
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  make_state, step, data = setup(args.batch, args.width)
  rep = NamedSharding(mesh, P())
  bsh = NamedSharding(mesh, P("data"))
  batch = jax.device_put(data, bsh)
  hand = jax.jit(step, in_shardings=(rep, bsh), out_shardings=(rep, rep),
                 donate_argnums=(0,))
  hand_compiled = hand.lower(make_state(), batch).compile()
  hand_bytes = hlo.bytes_sent(hand_compiled)
  hand_temp = hand_compiled.memory_analysis().temp_size_in_bytes

  print(f"MLP 4x{args.width}, batch {args.batch}, data parallel on 8 CPU devices; "
        f"hand-written jit step: {hand_bytes / 2**20:.2f} MiB sent per device, "
        f"temp {hand_temp / 2**20:.2f} MiB")
  header = (f"{'n':>2}  {'collectives per step':<38} {'grad MiB sent':>13} "
            f"{'peak temp MiB':>13} {'temp-grads MiB':>14} {'vs n=1':>6} {'step ms':>8} "
            f"{'hand ms':>8} {'ratio':>6}")
  print(header)
  print("-" * len(header))
  temp1 = None
  for n in (1, 2, 4, 8):
    p = autopar.parallelize(step, method=autopar.DataParallel(
        mesh=mesh, num_micro_batches=n))
    exe = p.get_executable(make_state(), batch)
    kinds: dict[str, int] = {}
    sent = 0.0
    for name in exe.schedule:
      for c in hlo.collectives(exe.stages[name]):
        kinds[c.kind] = kinds.get(c.kind, 0) + 1
        sent += c.bytes_sent
    temp = max(c.memory_analysis().temp_size_in_bytes for c in exe.stages.values())
    # Temp beyond one gradient-sized copy: an estimate of the activations.
    grads = sum(g.bytes_per_device(exe.plan.axis_sizes) for g in exe.plan.grads)
    act = max(temp - grads, 0)
    temp1 = temp1 or act

    a_state, h_state = make_state(), jax.device_put(make_state(), rep)
    a_state, _ = timed(p, a_state, batch)          # warm up both
    h_state, _ = timed(hand_compiled, h_state, batch)
    a_times, h_times = [], []
    for _ in range(args.reps):
      a_state, t = timed(p, a_state, batch)
      a_times.append(t)
      h_state, t = timed(hand_compiled, h_state, batch)
      h_times.append(t)
    a_ms, h_ms = 1e3 * np.median(a_times), 1e3 * np.median(h_times)
    coll = ", ".join(f"{v} {k}" for k, v in sorted(kinds.items())) or "none"
    print(f"{n:>2}  {coll:<38} {sent / 2**20:>13.2f} {temp / 2**20:>13.2f} "
          f"{act / 2**20:>14.2f} {act / temp1:>6.2f} {a_ms:>8.1f} {h_ms:>8.1f} "
          f"{a_ms / h_ms:>6.3f}")


if __name__ == "__main__":
  main()
