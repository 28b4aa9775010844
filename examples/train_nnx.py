"""A GPT written in Flax NNX, trained with autopar, both ways NNX users write
a train step.

    python examples/train_nnx.py

1. ``nnx.jit`` style: the model, an ``nnx.Optimizer`` and an
   ``nnx.MultiMetric`` are passed in and changed in place; the step returns
   nothing. The only change from NNX: ``autopar.value_and_grad`` for
   ``nnx.value_and_grad``.
2. ``nnx.split`` / ``nnx.merge`` style: the graph definition and the state
   go in, the new state comes out.

Each is planned first for an abstract 2 x 4 x 8 mesh (64 devices, none of
them here), then run on 8 simulated CPU devices with 2 micro-batches, and
compared with ``nnx.jit`` of the same step on one device.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import autopar  # noqa: E402

VOCAB, SEQ, D, HEADS, LAYERS = 64, 16, 64, 4, 3


class Block(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.ln1, self.ln2 = nnx.LayerNorm(D, rngs=rngs), nnx.LayerNorm(D, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(HEADS, D, decode=False, rngs=rngs)
    self.up, self.down = nnx.Linear(D, 4 * D, rngs=rngs), nnx.Linear(4 * D, D, rngs=rngs)
    self.drop = nnx.Dropout(0.1, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.ln1(x), mask=nnx.make_causal_mask(x[..., 0]))
    return x + self.drop(self.down(nnx.gelu(self.up(self.ln2(x)))))


class GPT(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
    self.head = nnx.Linear(D, VOCAB, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x)
    return self.head(x)


def make():
  model = GPT(nnx.Rngs(0, dropout=1))
  optimizer = nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)
  metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(),
                            loss=nnx.metrics.Average("loss"))
  return model, optimizer, metrics


def batches(num, batch=32, seed=0):
  """A learnable toy language: each sequence counts up from a random start."""
  rng = np.random.RandomState(seed)
  for _ in range(num):
    start = rng.randint(0, VOCAB, size=(batch, 1))
    yield ((start + np.arange(SEQ + 1)) % VOCAB).astype(np.int32)


def loss_fn(model, tokens):
  logits = model(tokens[:, :-1])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
  return loss, logits


def in_place_step(value_and_grad):
  """As NNX's tutorial writes it, with ``value_and_grad`` passed in."""
  def train_step(model, optimizer, metrics, tokens):
    (loss, logits), grads = value_and_grad(loss_fn, has_aux=True)(model, tokens)
    metrics.update(loss=loss, logits=logits, labels=tokens[:, 1:])
    optimizer.update(model, grads)
  return train_step


def split_step(graphdef, state, tokens):
  model, optimizer = nnx.merge(graphdef, state)
  (loss, _), grads = autopar.value_and_grad(loss_fn, has_aux=True)(model, tokens)
  optimizer.update(model, grads)
  return nnx.split((model, optimizer))[1], loss


def params(model):
  return jax.tree.leaves(nnx.state(model, nnx.Param))


def main(steps=4):
  data = list(batches(steps))

  # 1. Planned for 64 devices that are not here.
  big = jax.sharding.AbstractMesh((2, 4, 8), ("host", "data", "model"))
  planned = autopar.parallelize(in_place_step(autopar.value_and_grad),
                                method=autopar.ShardParallel(mesh=big, num_micro_batches=2))
  plan = planned.plan(*jax.eval_shape(lambda: (*make(), data[0])))
  print(f"planned for {dict(zip(big.axis_names, big.axis_sizes))}: batch over "
        f"{plan.batch_axes}, objective {plan.objective:.3g} s")

  # 2. Run on 8 devices, in place, beside nnx.jit on one device.
  model, optimizer, metrics = make()
  ref_model, ref_optimizer, ref_metrics = make()
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  step = autopar.parallelize(in_place_step(autopar.value_and_grad),
                             method=autopar.ShardParallel(mesh=mesh, num_micro_batches=2))
  ref_step = nnx.jit(in_place_step(nnx.value_and_grad))
  for i, tokens in enumerate(data):
    step(model, optimizer, metrics, tokens)
    ref_step(ref_model, ref_optimizer, ref_metrics, tokens)
    got, want = metrics.compute(), ref_metrics.compute()
    print(f"step {i}: loss {float(got['loss']):.4f} (nnx.jit {float(want['loss']):.4f}), "
          f"accuracy {float(got['accuracy']):.4f} (nnx.jit {float(want['accuracy']):.4f})")
  diff = max(float(np.max(np.abs(a - b))) for a, b in zip(params(model), params(ref_model)))
  print(f"in place: optimizer step {int(optimizer.step[...])}, largest parameter "
        f"difference from nnx.jit {diff:.2e}")
  assert diff < 1e-4

  # 3. The split / merge style.
  graphdef, state = nnx.split(make()[:2])
  ref_graphdef, ref_state = nnx.split(make()[:2])
  split = autopar.parallelize(split_step, method=autopar.DataParallel(
      mesh=jax.make_mesh((8,), ("data",)), num_micro_batches=2))
  ref_split = nnx.jit(split_step, static_argnums=0)
  for tokens in data:
    state, loss = split(graphdef, state, tokens)
    ref_state, ref_loss = ref_split(ref_graphdef, ref_state, tokens)
  print(f"split/merge: last loss {float(loss):.4f} (nnx.jit {float(ref_loss):.4f})")
  assert abs(float(loss) - float(ref_loss)) < 1e-4


if __name__ == "__main__":
  main()
