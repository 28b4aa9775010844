"""The main demo job: train a small GPT-style model on 8 simulated devices.

    make demo          # or: python examples/train_demo.py

It trains for a few steps with 4 micro-batches per step, printing the loss
per step, the sharding plan autopar chose, and the stages run per step.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import time  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402

import autopar  # noqa: E402


class Block(nn.Module):
  d: int
  heads: int

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)
    h = nn.MultiHeadDotProductAttention(num_heads=self.heads)(
        h, h, mask=nn.make_causal_mask(jnp.ones(x.shape[:2])))
    x = x + h
    h = nn.Dense(4 * self.d)(nn.LayerNorm()(x))
    return x + nn.Dense(self.d)(nn.gelu(h))


class GPT(nn.Module):
  vocab: int = 256
  d: int = 128
  heads: int = 4
  layers: int = 2

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab, self.d)(tokens)
    x = x + self.param("pos", nn.initializers.normal(0.02), (tokens.shape[1], self.d))
    for _ in range(self.layers):
      x = Block(self.d, self.heads)(x)
    return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def make_batches(num, batch, seq, vocab, seed=0):
  """A learnable toy language: each sequence counts up from a random start."""
  rng = np.random.RandomState(seed)
  for _ in range(num):
    start = rng.randint(0, vocab, size=(batch, 1))
    yield {"tokens": ((start + np.arange(seq + 1)) % vocab).astype(np.int32)}


def main(steps=8, batch=64, seq=32, micro_batches=4):
  model = GPT()
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, seq), jnp.int32))
  state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.adamw(3e-3))
  mesh = jax.make_mesh((2, 4), ("data", "model"))

  @autopar.parallelize(method=autopar.ShardParallel(mesh=mesh,
                                                    num_micro_batches=micro_batches))
  def train_step(state, batch):
    def loss_fn(params):
      logits = state.apply_fn(params, batch["tokens"][:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(
          logits, batch["tokens"][:, 1:]).mean()
    loss, grads = autopar.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  print(f"autopar demo: GPT ({model.layers} layers, d={model.d}) on "
        f"{len(jax.devices())} devices, batch {batch}, {micro_batches} micro-batches")
  for i, b in enumerate(make_batches(steps, batch, seq, model.vocab)):
    t0 = time.perf_counter()
    if i == 0:
      exe = train_step.get_executable(state, b)
    state, loss = train_step(state, b)
    loss = float(loss)
    print(f"step {i}: loss {loss:.4f}  ({time.perf_counter() - t0:.3f} s)")
  print()
  print(exe.plan.summary())
  print()
  print("stages run per step:", " -> ".join(exe.schedule))
  for name, c in exe.stages.items():
    mem = c.memory_analysis()
    print(f"  {name:22s} temp {mem.temp_size_in_bytes / 2**10:8.1f} KiB per device")
  # The plan, saved and as a report to open in a browser (also: `autopar show
  # demo_plan.json`, `autopar report demo_plan.json`).
  out = os.environ.get("AUTOPAR_DEMO_DIR", os.getcwd())
  with open(os.path.join(out, "demo_plan.json"), "w") as f:
    f.write(exe.plan.to_json())
  report = os.path.join(out, "demo_plan.html")
  exe.plan.to_html(report, title="autopar demo plan")
  print(f"\nplan report: {report}")


if __name__ == "__main__":
  main()
