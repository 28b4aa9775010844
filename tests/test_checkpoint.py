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


def test_stage_format_round_trip_keeps_each_arrays_devices(tmp_path):
  """The format a Ray pipeline's state is saved in (each array written from
  its own devices, as a stage's lie): restored here onto given shardings, or
  onto the default device; bfloat16, integer, scalar and PRNG key leaves
  come back bit for bit, non-array leaves from the target."""
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from autopar.runtime import checkpoint
  devices = np.array(jax.devices())
  first = Mesh(devices[:4].reshape(2, 2), ("a", "b"))
  second = Mesh(devices[4:].reshape(1, 4), ("a", "b"))
  state = {"w": jax.device_put(jnp.linspace(-3, 3, 24, dtype=jnp.bfloat16).reshape(4, 6),
                               NamedSharding(first, P("a", "b"))),
           "step": jax.device_put(jnp.arange(8, dtype=jnp.int32), NamedSharding(second, P("b"))),
           "key": jax.device_put(jax.random.split(jax.random.key(3), 4),
                                 NamedSharding(second, P("b"))),
           "scale": jax.device_put(jnp.float32(2.5), NamedSharding(second, P())),
           "name": "kept from the target"}
  path = str(tmp_path / "ckpt")
  checkpoint.save_stages(path, state)
  written = {r["path"]: r["sharding"] for r in checkpoint.stage_manifest(path)}
  assert written["['w']"]["devices"] == [0, 1, 2, 3]
  assert written["['step']"]["devices"] == [4, 5, 6, 7]
  shardings = jax.tree.map(lambda x: x.sharding if hasattr(x, "sharding") else None, state)
  for where in (shardings, None):
    back = autopar.restore_checkpoint(path, state, where)
    for k in ("w", "step", "scale"):
      np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(state[k]))
      assert back[k].dtype == state[k].dtype
      assert where is None or back[k].sharding == state[k].sharding
    np.testing.assert_array_equal(jax.random.key_data(back["key"]),
                                  jax.random.key_data(state["key"]))
    assert back["name"] == "kept from the target"
  with pytest.raises(autopar.InputError, match=r"target\['step'\] is float32\[3\]"):
    autopar.restore_checkpoint(path, {**state, "step": jnp.zeros(3)})
  renamed = {("steps" if k == "step" else k): v for k, v in state.items()}
  with pytest.raises(autopar.InputError, match=r"target\['steps'\] is where the "
                                               r"checkpoint .* holds \['step'\]"):
    autopar.restore_checkpoint(path, renamed)        # (same shapes, same order)
