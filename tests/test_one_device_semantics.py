"""Same results as one device on the steps people write: random draws,
outputs that depend on the batch's shape, saved plans tied to their program,
the user's sharding hints, accumulation precision."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopar
from models import assert_trees_close, mlp_setup, single_device

SGD = optax.sgd(0.1, momentum=0.9)


def mesh_of(shape, names=("data", "model")):
  return jax.make_mesh(shape, names[:len(shape)])


# -- saved plans ---------------------------------------------------------------

def test_a_saved_plan_is_tied_to_its_program():
  make_state, step, batch = mlp_setup(tx=SGD)
  mesh = mesh_of((2, 4))
  saved = autopar.parallelize(step, method=autopar.ShardParallel(
      mesh=mesh, num_micro_batches=2)).plan(make_state(), batch).to_json()

  def other(state, batch):            # the same arguments, another loss
    def loss_fn(p):
      return jnp.mean(jnp.abs(state.apply_fn(p, batch["x"]) - batch["y"]))
    loss, grads = autopar.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  def method(text):
    return autopar.ShardParallel(mesh=mesh, num_micro_batches=2,
                                 plan=autopar.Plan.from_json(text))

  with pytest.raises(autopar.PlanError, match="made for another program"):
    autopar.parallelize(other, method=method(saved))(make_state(), batch)
  d = json.loads(saved)
  d["fingerprint"]["autopar"] = "0.0.1"
  with pytest.raises(autopar.PlanError, match="made by autopar 0.0.1"):
    autopar.parallelize(step, method=method(json.dumps(d)))(make_state(), batch)
  # Its own program takes it.
  state, _ = autopar.parallelize(step, method=method(saved))(make_state(), batch)
  ref_state, _ = single_device(step)(make_state(), batch)
  assert_trees_close(state.params, ref_state.params)


def test_a_corrupt_plan_is_a_plan_error():
  with pytest.raises(autopar.PlanError, match="not valid JSON"):
    autopar.Plan.from_json("{")
  with pytest.raises(autopar.PlanError, match="format"):
    autopar.Plan.from_json('{"format": 1}')
  make_state, step, batch = mlp_setup(tx=SGD)
  d = json.loads(autopar.parallelize(step, method=autopar.DataParallel(
      mesh=mesh_of((8,)))).plan(make_state(), batch).to_json())
  del d["inputs"]
  with pytest.raises(autopar.PlanError, match="incomplete or corrupt"):
    autopar.Plan.from_json(json.dumps(d))
