"""Train a GPT-style model on a Ray cluster: one worker per host.

On one machine (starts a local Ray instance; 2 simulated hosts x 4 CPU
devices, gloo collectives between them):

    python examples/train_gpt_ray.py --num-hosts 2 --devices-per-host 4 --mesh 2,4

On a cluster started with ``ray start`` (docs/ray.md has the whole recipe,
token authentication included), on the head node:

    python examples/train_gpt_ray.py --address auto --mesh 2,4

With ``ray job submit``, on the head node (the job runs the Python named):

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \\
        "$PWD/.venv/bin/python" examples/train_gpt_ray.py --address auto --mesh 2,4

``--mesh`` alone sizes the cluster too: a host per node (a node's GPUs
each, or the mesh's devices split evenly over the nodes as simulated CPU
devices: one CPU node gives one host of 8 devices for ``2,4``);
``--num-hosts`` and ``--devices-per-host`` choose otherwise.

The driver plans the step for the global mesh (its first axis spans the
hosts), the workers compile and run it, and the state stays on the workers
between steps. A checkpoint is written every ``--checkpoint-every`` steps;
``--resume`` continues from the last one (e.g. after a host was lost).
"""

import argparse
import math
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import autopar


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
    for _ in range(self.layers):
      x = Block(self.d, self.heads)(x)
    return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def batches(batch, seq, vocab, seed):
  """A learnable toy language: each sequence counts up from a random start."""
  rng = np.random.RandomState(seed)
  while True:
    start = rng.randint(0, vocab, size=(batch, 1))
    yield {"tokens": ((start + np.arange(seq + 1)) % vocab).astype(np.int32)}


def train_step(state, batch):
  def loss_fn(params):
    logits = state.apply_fn(params, batch["tokens"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["tokens"][:, 1:]).mean()
  loss, grads = autopar.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), loss


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--address", default=None, help="Ray cluster to join ('auto')")
  ap.add_argument("--num-hosts", type=int, default=None)
  ap.add_argument("--devices-per-host", type=int, default=None)
  ap.add_argument("--mesh", default=None,
                  help="e.g. 2,4; the cluster gets as many devices (default: all "
                       "devices, 1-D)")
  ap.add_argument("--method", choices=["shard", "data"], default="shard")
  ap.add_argument("--steps", type=int, default=10)
  ap.add_argument("--micro-batches", type=int, default=2)
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--layers", type=int, default=2, help="transformer blocks")
  ap.add_argument("--checkpoint-dir", default="/tmp/autopar_gpt_ckpt")
  ap.add_argument("--checkpoint-every", type=int, default=5)
  ap.add_argument("--resume", action="store_true")
  args = ap.parse_args()

  shape = tuple(int(s) for s in args.mesh.split(",")) if args.mesh else None
  autopar.init("ray", address=args.address, num_hosts=args.num_hosts,
               num_devices_per_host=args.devices_per_host,
               num_devices=math.prod(shape) if shape else None)
  try:
    total = autopar.runtime.cluster.current().num_devices
    shape = shape or (total,)
    names = ("data", "model")[:len(shape)] if len(shape) <= 2 else \
        tuple(f"axis{i}" for i in range(len(shape)))
    mesh = autopar.global_mesh(shape, names)
    cls = autopar.ShardParallel if args.method == "shard" else autopar.DataParallel
    step = autopar.parallelize(train_step, method=cls(
        mesh=mesh, num_micro_batches=args.micro_batches))

    model = GPT(layers=args.layers)
    data = batches(args.batch, 32, model.vocab, seed=0)
    first = next(data)
    def make_state():
      params = model.init(jax.random.PRNGKey(0), first["tokens"][:1, :-1])
      return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                           tx=optax.adamw(3e-3))
    state, start = make_state(), 0
    latest = os.path.join(args.checkpoint_dir, "latest")
    if args.resume and os.path.isdir(latest):
      target = jax.eval_shape(make_state)
      shardings = step.plan(target, first).input_shardings[0]
      state = autopar.restore_checkpoint(latest, target, shardings)
      start = int(np.asarray(state.step))
      print(f"resumed from {latest} at step {start}")
    print(f"{autopar.runtime.cluster.current().num_hosts} hosts, {total} devices, mesh "
          f"{dict(zip(names, shape))}")
    batch = first
    for _ in range(start):                 # the same data as an uninterrupted run
      batch = next(data)
    for i in range(start, args.steps):
      state, loss = step(state, batch)
      print(f"step {i}: loss {float(loss):.4f}", flush=True)
      if (i + 1) % args.checkpoint_every == 0:
        autopar.save_checkpoint(latest, state)
      batch = next(data)
    print(step.plan(state, batch).summary().splitlines()[0])
  finally:
    autopar.shutdown()


if __name__ == "__main__":
  main()
