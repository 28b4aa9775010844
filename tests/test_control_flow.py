"""Control flow is planned through: scan (a scanned layer stack, with and
without remat), cond and while. Numerics equal single-device jax.jit."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import autopar
from models import ScanTransformer, assert_trees_close, lm_setup, single_device

SGD = optax.sgd(0.1, momentum=0.9)


def run_and_compare(step, make_state, batch, method):
  p = autopar.parallelize(step, method=method)
  exe = p.get_executable(make_state(), batch)
  ref_state, ref_loss = single_device(step)(make_state(), batch)
  state, loss = p(make_state(), batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_trees_close(state.params, ref_state.params)
  return exe.plan


def nested(plan):
  """Plan entries for values inside control-flow bodies."""
  return [v for v in plan.intermediates if "." in v.name.split("/")[1]]


@pytest.mark.parametrize("remat", [False, True])
def test_scanned_transformer(remat):
  make_state, step, batch = lm_setup(
      ScanTransformer(d=128, heads=4, layers=3, remat=remat), batch=8, tx=SGD)
  option = autopar.AutoShardingOption(plan_cache=False)
  plan = run_and_compare(step, make_state, batch, autopar.ShardParallel(
      mesh=jax.make_mesh((2, 4), ("data", "model")), num_micro_batches=2,
      option=option))
  assert nested(plan), "nothing was planned inside the scan body"
  stacked = [v for v in plan.inputs if "ScanBlock" in v.name]
  # The stacked (layer) dimension is never split; each layer's slice is.
  assert stacked and all(len(v.spec) == 0 or v.spec[0] is None for v in stacked)
  assert any(any(e is not None for e in v.spec) for v in stacked)


def test_scanned_transformer_without_marker_free_scan():
  # The same model planned as data parallel over all 8 devices also works.
  make_state, step, batch = lm_setup(ScanTransformer(d=32, heads=4, layers=2),
                                     batch=16, tx=SGD)
  run_and_compare(step, make_state, batch, autopar.DataParallel(num_micro_batches=2))


class CondMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    dense = nn.Dense(256)
    h = dense(x)
    # The branch depends on the weights, not on the batch (a batch statistic
    # would differ between micro-batches and devices, as batch norm does).
    first = jnp.sum(dense.variables["params"]["kernel"]) > 0
    h = jax.lax.cond(first, jax.nn.relu, jnp.tanh, h)
    return nn.Dense(4)(h)


def cond_setup(batch=16):
  model = CondMLP()
  rng = np.random.RandomState(0)
  x = rng.randn(batch, 32).astype(np.float32)
  y = rng.randn(batch, 4).astype(np.float32)
  params = model.init(jax.random.PRNGKey(0), x[:1])

  def make_state():
    return train_state.TrainState.create(
        apply_fn=model.apply, params=jax.tree.map(jnp.array, params), tx=SGD)

  def step(state, batch):
    def loss_fn(p):
      return jnp.mean((state.apply_fn(p, batch["x"]) - batch["y"]) ** 2)
    loss, grads = autopar.value_and_grad(loss_fn)(state.params)
    # A while loop in the update: decay the gradients a data-dependent
    # number of times (until their norm is below 10, at most 3 times).
    def cond(c):
      i, g = c
      return (i < 3) & (optax.global_norm(g) > 10.0)
    _, grads = jax.lax.while_loop(
        cond, lambda c: (c[0] + 1, jax.tree.map(lambda t: t * 0.5, c[1])), (0, grads))
    return state.apply_gradients(grads=grads), loss

  return make_state, step, {"x": x, "y": y}


@pytest.mark.parametrize("mesh_shape,n", [((8,), 1), ((2, 4), 2)])
def test_cond_and_while(mesh_shape, n):
  make_state, step, batch = cond_setup()
  names = ("model",) if len(mesh_shape) == 1 else ("data", "model")
  plan = run_and_compare(step, make_state, batch, autopar.ShardParallel(
      mesh=jax.make_mesh(mesh_shape, names), num_micro_batches=n,
      option=autopar.AutoShardingOption(plan_cache=False)))
  assert nested(plan)
