"""A transformer written in Equinox, trained with autopar as Equinox users
write a train step.

    python examples/train_equinox.py

The step takes the model, the optax state and the batch as four arguments
(``model, opt_state, x, y``), computes a filtered gradient and returns the
new model: what ``eqx.filter_jit`` users write, with
``autopar.filter_value_and_grad`` for ``eqx.filter_value_and_grad``. The
model's non-array leaves (activation functions, dropout rates) are static,
as under ``eqx.filter_jit``; autopar finds the batch (``x`` and ``y``) by
their leading dimension.

It is planned first for an abstract 4 x 16 mesh (64 devices, none of them
here), then run on 8 simulated CPU devices with 2 micro-batches and
``remat="layers"``, and compared with ``eqx.filter_jit`` on one device.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import autopar  # noqa: E402

VOCAB, SEQ, D, HEADS, LAYERS = 64, 16, 64, 4, 3


class Block(eqx.Module):
  attn: eqx.nn.MultiheadAttention
  mlp: eqx.nn.MLP
  ln1: eqx.nn.LayerNorm
  ln2: eqx.nn.LayerNorm

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    self.attn = eqx.nn.MultiheadAttention(HEADS, D, key=k1)
    self.mlp = eqx.nn.MLP(D, D, 4 * D, 1, activation=jax.nn.gelu, key=k2)
    self.ln1, self.ln2 = eqx.nn.LayerNorm(D), eqx.nn.LayerNorm(D)

  def __call__(self, x):
    h = jax.vmap(self.ln1)(x)
    mask = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
    x = x + self.attn(h, h, h, mask=mask)
    return x + jax.vmap(self.mlp)(jax.vmap(self.ln2)(x))


class Transformer(eqx.Module):
  embed: eqx.nn.Embedding
  blocks: list
  head: eqx.nn.Linear

  def __init__(self, key):
    keys = jax.random.split(key, LAYERS + 2)
    self.embed = eqx.nn.Embedding(VOCAB, D, key=keys[0])
    self.blocks = [Block(k) for k in keys[1:-1]]
    self.head = eqx.nn.Linear(D, VOCAB, key=keys[-1])

  def __call__(self, tokens):
    x = jax.vmap(self.embed)(tokens)
    for block in self.blocks:
      x = block(x)
    return jax.vmap(self.head)(x)


OPTIMIZER = optax.adamw(3e-3)


def make_step(filter_value_and_grad):
  def train_step(model, opt_state, x, y):
    def loss_fn(model, x, y):
      logits = jax.vmap(model)(x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    loss, grads = filter_value_and_grad(loss_fn)(model, x, y)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss
  return train_step


def make():
  model = Transformer(jax.random.key(0))
  return model, OPTIMIZER.init(eqx.filter(model, eqx.is_array))


def batches(num, batch=32, seed=0):
  """A learnable toy language: each sequence counts up from a random start."""
  rng = np.random.RandomState(seed)
  for _ in range(num):
    start = rng.randint(0, VOCAB, size=(batch, 1))
    t = ((start + np.arange(SEQ + 1)) % VOCAB).astype(np.int32)
    yield t[:, :-1], t[:, 1:]


def main(steps=4):
  data = list(batches(steps))

  # 1. Planned for 64 devices that are not here (arrays abstract, the rest as is).
  big = jax.sharding.AbstractMesh((4, 16), ("data", "model"))
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
                          if eqx.is_array(x) else x, (*make(), *data[0]))
  plan = autopar.parallelize(make_step(autopar.filter_value_and_grad),
                             method=autopar.ShardParallel(mesh=big, num_micro_batches=2)
                             ).plan(*abstract)
  print(f"planned for {dict(zip(big.axis_names, big.axis_sizes))}: batch over "
        f"{plan.batch_axes}, objective {plan.objective:.3g} s")

  # 2. Run on 8 devices, beside eqx.filter_jit on one device.
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  step = autopar.parallelize(make_step(autopar.filter_value_and_grad),
                             method=autopar.ShardParallel(mesh=mesh, num_micro_batches=2,
                                                          remat="layers"))
  ref_step = eqx.filter_jit(make_step(eqx.filter_value_and_grad))
  (model, opt_state), (ref_model, ref_opt_state) = make(), make()
  for i, (x, y) in enumerate(data):
    model, opt_state, loss = step(model, opt_state, x, y)
    ref_model, ref_opt_state, ref_loss = ref_step(ref_model, ref_opt_state, x, y)
    print(f"step {i}: loss {float(loss):.4f} (eqx.filter_jit {float(ref_loss):.4f})")
  arrays = lambda m: jax.tree.leaves(eqx.filter(m, eqx.is_array))
  diff = max(float(np.max(np.abs(a - b))) for a, b in zip(arrays(model), arrays(ref_model)))
  print(f"largest parameter difference from eqx.filter_jit: {diff:.2e}; activation "
        f"kept: {model.blocks[0].mlp.activation is jax.nn.gelu}")
  assert diff < 1e-4
  exe = step.get_executable(model, opt_state, *data[0])
  print("layers rolled into loops:", exe.as_text()["accumulate_grad"].count(" while("),
        "(forward and backward)")


if __name__ == "__main__":
  main()
