"""orbax checkpoints of sharded training state, in this process."""

import jax
import numpy as np
import optax
import pytest

import autopar
from models import assert_trees_close, mlp_setup


def test_sharded_state_round_trip_and_training_continues(tmp_path):
  make_state, step, batch = mlp_setup(batch=32, tx=optax.sgd(0.1, momentum=0.9))
  method = autopar.Zero3Parallel(mesh=jax.make_mesh((8,), ("data",)))
  p = autopar.parallelize(step, method=method)
  state, _ = p(make_state(), batch)
  path = str(tmp_path / "ckpt")
  autopar.save_checkpoint(path, state)
  expected = jax.device_get(state.params)
  after, loss = p(state, batch)                  # donates `state`

  shardings = p.get_executable(make_state(), batch).plan.input_shardings[0]
  back = autopar.restore_checkpoint(path, jax.eval_shape(make_state), shardings)
  assert_trees_close(back.params, expected)
  leaf = back.params["params"]["Dense_0"]["kernel"]
  assert leaf.sharding.spec == shardings.params["params"]["Dense_0"]["kernel"].spec
  again, loss2 = p(back, batch)
  np.testing.assert_allclose(loss2, loss, rtol=1e-6)
  assert_trees_close(again.params, after.params)


def test_missing_checkpoint_is_named(tmp_path):
  make_state, _, _ = mlp_setup()
  with pytest.raises(autopar.InputError, match="no checkpoint"):
    autopar.restore_checkpoint(str(tmp_path / "missing"), make_state())
