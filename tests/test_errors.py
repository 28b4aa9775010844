"""Bad input gets an autopar error that names the path, the shape and the fix,
and a step that fails leaves the caller's state usable."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar
from models import assert_trees_close, mlp_setup, partitioned, single_device


def mesh8():
  return jax.make_mesh((2, 4), ("data", "model"))


def run(step, n=2, mesh=None, **kw):
  return autopar.parallelize(step, method=autopar.DataParallel(
      mesh=mesh or mesh8(), num_micro_batches=n), **kw)


def assert_state_usable(state):
  assert not any(x.is_deleted() for x in jax.tree.leaves(state)
                 if isinstance(x, jax.Array))
  jax.tree.map(lambda x: np.asarray(x).sum(), state)


def test_batch_not_divisible_by_micro_batches_and_devices():
  make_state, step, batch = mlp_setup(batch=36)
  state = make_state()
  with pytest.raises(autopar.InputError) as e:
    run(step, n=2)(state, batch)
  msg = str(e.value)
  assert "batch['x']" in msg and "(36, 16)" in msg and "16" in msg
  assert "'data', 'model'" in msg and "multiple of 16" in msg
  assert isinstance(e.value, autopar.AutoparError)
  assert_state_usable(state)


def test_batch_not_divisible_by_micro_batches_on_one_device():
  make_state, step, batch = mlp_setup(batch=30)
  with pytest.raises(autopar.InputError, match=r"num_micro_batches \(4\)"):
    run(step, n=4, mesh=jax.make_mesh((1,), ("data",)))(make_state(), batch)


def test_micro_batches_without_marker():
  make_state, _, batch = mlp_setup()

  def step(state, batch):
    grads = jax.grad(lambda p: jnp.mean(state.apply_fn(p, batch["x"]) ** 2))(
        state.params)
    return state.apply_gradients(grads=grads)

  state = make_state()
  with pytest.raises(autopar.MarkerError, match="autopar.grad"):
    run(step, n=4)(state, batch)
  assert_state_usable(state)


def test_more_than_one_marker():
  make_state, _, batch = mlp_setup()

  def step(state, batch):
    f = lambda p: jnp.mean(state.apply_fn(p, batch["x"]) ** 2)
    g1 = autopar.grad(f)(state.params)
    g2 = autopar.grad(f)(state.params)
    return state.apply_gradients(grads=jax.tree.map(jnp.add, g1, g2))

  with pytest.raises(autopar.MarkerError, match="2 times"):
    run(step)(make_state(), batch)


def test_batch_leaf_without_batch_axis():
  make_state, step, batch = mlp_setup()
  bad = dict(batch, lr=np.float32(0.1))
  with pytest.raises(autopar.InputError) as e:
    run(step)(make_state(), bad)
  assert "batch['lr']" in str(e.value) and "shape ()" in str(e.value)


def test_batch_leaves_with_different_batch_sizes():
  make_state, step, batch = mlp_setup()
  bad = dict(batch, y=batch["y"][:16])
  with pytest.raises(autopar.InputError, match=r"batch\['y'\] has shape \(16, 4\)"):
    run(step)(make_state(), bad)


def test_unknown_mesh_axis():
  with pytest.raises(autopar.MeshError) as e:
    autopar.DataParallel(mesh=mesh8(), batch_axes=("batch",))
  assert "'batch'" in str(e.value) and "('data', 'model')" in str(e.value)
  with pytest.raises(autopar.MeshError, match="'dp'"):
    opt = autopar.AutoShardingOption(force_batch_dim_to_mesh_dim="dp")
    make_state, step, batch = mlp_setup()
    autopar.parallelize(step, method=autopar.ShardParallel(mesh=mesh8(), option=opt))(
        make_state(), batch)


def test_batch_value_used_after_marker():
  make_state, _, batch = mlp_setup()

  def step(state, batch):
    loss, grads = autopar.value_and_grad(
        lambda p: jnp.mean(state.apply_fn(p, batch["x"]) ** 2))(state.params)
    grads = jax.tree.map(lambda g: g * loss, grads)   # loss crosses the marker
    return state.apply_gradients(grads=grads)

  with pytest.raises(autopar.MarkerError, match="only the gradients"):
    run(step)(make_state(), batch)


def test_output_that_cannot_be_combined():
  make_state, _, batch = mlp_setup()

  def step(state, batch):
    def loss_fn(p):
      pred = state.apply_fn(p, batch["x"])
      # Rows in two dimensions: neither per-example nor a mean or a count.
      return jnp.mean(pred ** 2), pred @ pred.T
    (loss, gram), grads = autopar.value_and_grad(loss_fn, has_aux=True)(
        state.params)
    return state.apply_gradients(grads=grads), gram

  with pytest.raises(autopar.InputError, match=r"out\[1\] \(shape \(\d+, \d+\) for a "
                     r"micro-batch.*rows in more than one dimension.*output_reductions"):
    run(step)(make_state(), batch)


def test_bad_arguments_to_parallelize_and_methods():
  make_state, step, batch = mlp_setup()
  with pytest.raises(autopar.InputError, match="num_micro_batches=0"):
    autopar.DataParallel(num_micro_batches=0)
  with pytest.raises(autopar.MeshError, match="jax.sharding.Mesh"):
    autopar.DataParallel(mesh=(2, 4))
  with pytest.raises(autopar.InputError, match="batch_argnums"):
    autopar.parallelize(step, batch_argnums=(5,))(make_state(), batch)
  with pytest.raises(autopar.InputError, match="both batch_argnums and donate_argnums"):
    autopar.parallelize(step, donate_argnums=(1,))(make_state(), batch)
  with pytest.raises(autopar.InputError, match="'auto'"):
    autopar.parallelize(step, donate_argnums="yes")


def test_marker_inside_control_flow():
  make_state, _, batch = mlp_setup()

  def step(state, batch):
    def body(c, x):
      g = autopar.grad(lambda p: jnp.mean(state.apply_fn(p, x) ** 2))(state.params)
      return c, g
    _, gs = jax.lax.scan(body, 0, batch["x"].reshape(2, -1, 16))
    return state.apply_gradients(grads=jax.tree.map(lambda g: g.mean(0), gs))

  with pytest.raises(autopar.MarkerError, match="scan"):
    run(step)(make_state(), batch)


def test_abstract_mesh_cannot_run():
  make_state, step, batch = mlp_setup()
  mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
  p = autopar.parallelize(step, method=autopar.DataParallel(mesh=mesh))
  plan = p.plan(make_state(), batch)     # planning works
  assert plan.mesh_shape == (2, 4)
  state = make_state()
  with pytest.raises(autopar.PlanError, match="AbstractMesh"):
    p(state, batch)
  assert_state_usable(state)


def test_tied_donated_weights_are_an_error_before_anything_runs():
  """One array passed as two donated leaves (tied weights built by reuse),
  or as a donated and a kept leaf: an autopar error naming both paths
  (plain jax.jit on a multi-device mesh crashes the process here)."""
  import optax
  from flax.training import train_state

  w = jnp.ones((8, 8)) / 8
  state = train_state.TrainState.create(apply_fn=None, params={"a": w, "b": w},
                                        tx=optax.sgd(0.1))

  def step(state, x):
    def loss_fn(p):
      return jnp.mean((x @ p["a"] @ p["b"]) ** 2)
    loss, grads = autopar.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  x = jnp.ones((16, 8))
  with pytest.raises(autopar.InputError, match=r"state.params\['a'\] and "
                     r"state.params\['b'\] are the same array"):
    run(step, n=1)(state, x)
  assert_state_usable(state)

  def step_kept(state, x, extra):
    new, loss = step(state, x)
    return new, loss + jnp.sum(extra)
  state = train_state.TrainState.create(apply_fn=None, params={"a": w, "b": w + 1},
                                        tx=optax.sgd(0.1))
  with pytest.raises(autopar.InputError, match=r"extra .* same array as the donated "
                     r"leaf state.params\['a'\]"):
    run(step_kept, n=1, batch_argnums=(1,))(state, x, state.params["a"])
  assert_state_usable(state)


def test_the_steps_own_error_comes_first():
  """A step that fails whatever the batch split (a shape error of its own)
  fails with its own error, under every method, not with advice about
  batch_argnums or symbolic batch sizes."""
  make_state, _, batch = mlp_setup()

  def step(state, batch):
    def loss_fn(p):
      h = state.apply_fn(p, batch["x"])
      return jnp.mean(h @ jnp.ones((3, 3)))           # h is [batch, 4]
    loss, grads = autopar.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  for method in (autopar.DataParallel(mesh=mesh8(), num_micro_batches=2),
                 autopar.PipeshardParallel(mesh=mesh8(), num_micro_batches=2,
                                           num_stages=2)):
    with pytest.raises(TypeError, match="dot_general requires contracting"):
      autopar.parallelize(step, method=method)(make_state(), batch)


def test_a_donated_buffer_seen_through_another_array_object():
  """jax.device_put of an array onto its own device makes a new object on
  the same buffer: still the same donated buffer twice."""
  import optax
  from flax.training import train_state

  a = jnp.ones((8, 8)) / 8
  state = train_state.TrainState.create(
      apply_fn=None, params={"a": a, "b": jax.device_put(a, a.sharding)},
      tx=optax.sgd(0.1))

  def step(state, x):
    loss, grads = autopar.value_and_grad(
        lambda p: jnp.mean((x @ p["a"] @ p["b"]) ** 2))(state.params)
    return state.apply_gradients(grads=grads), loss

  mesh1 = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
  with pytest.raises(autopar.InputError, match="are the same array"):
    run(step, n=1, mesh=mesh1)(state, jnp.ones((4, 8)))


def test_auto_batch_never_takes_state_the_step_returns_updated():
  """step(w, ema, x): ema is returned updated (an average of the weights),
  never split as the batch, whatever the leading sizes."""
  def step(w, ema, x):
    loss, g = autopar.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
    w = w - 0.1 * g
    return w, 0.9 * ema + 0.1 * w, loss

  w, ema, x = jnp.ones((8, 4)) / 8, jnp.zeros((8, 4)), jnp.ones((8, 8))
  p = run(step, n=1, donate_argnums=())
  assert p._prepare((w, ema, x)).flags.batch == (2,)
  for a, b in zip(p(w, ema, x), jax.jit(step)(w, ema, x)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5)


def _step_with(f):
  """A two-layer step whose loss runs ``f`` on its input rows (not on the
  parameters), with a pipeline boundary between the layers."""
  def step(params, x):
    def loss(p):
      h = jnp.tanh(f(x) @ p["w1"])
      autopar.mark_pipeline_boundary()
      return jnp.mean(((h + f(x)) @ p["w2"]) ** 2)
    value, grads = autopar.value_and_grad(loss)(params)
    return jax.tree.map(lambda a, g: a - 0.1 * g, params, grads), value
  rng = np.random.RandomState(0)
  params = {"w1": jnp.asarray(rng.randn(6, 6), jnp.float32),
            "w2": jnp.asarray(rng.randn(6, 6), jnp.float32)}
  return step, params, rng.randn(16, 6).astype(np.float32)


def _printed(x):
  jax.debug.print("x sums to {}", x.sum())
  return x


def _host_tanh(x):
  return jax.pure_callback(lambda v: np.tanh(np.asarray(v)),
                           jax.ShapeDtypeStruct(x.shape, x.dtype), x,
                           vmap_method="broadcast_all")


def test_host_callback_where_the_batch_is_split_over_some_axes():
  """JAX lowers a host callback only where every mesh axis is manual or none
  is: with the batch split over "data" alone, autopar says which callback,
  where, and the fix, instead of JAX's NotImplementedError or "The context
  mesh cannot be empty"."""
  for f, name in ((_printed, "debug_print"), (_host_tanh, "pure_callback")):
    step, params, x = _step_with(f)
    p = autopar.parallelize(step, method=autopar.DataParallel(
        mesh=mesh8(), num_micro_batches=2, batch_axes="data"))
    with pytest.raises(autopar.InputError, match=rf"calls back to the host \({name}.*"
                       r"split over the mesh axes \('data',\) and not over \('model',\)"
                       r".*Fix: split the batch over all of the mesh's axes"):
      p(params, x)
    assert_state_usable(params)


@pytest.mark.parametrize("op", ["pure_callback", "custom_partitioning"])
def test_pipeline_stage_with_an_op_jax_lowers_with_the_devices(op):
  """A host callback or a custom_partitioning op in a pipeline stage: JAX
  lowers one only in a computation manual over every mesh axis or none, so
  a stage splits its batch over all of its submesh's axes (the axis of size
  1 too) or none, and the step is jit's. Before, the stages' forward failed
  to lower (an InputError that said which op and what to do)."""
  step, params, x = _step_with(_host_tanh if op == "pure_callback" else
                               partitioned(jnp.sin))
  ref, ref_loss = single_device(step)(params, x)
  p = autopar.parallelize(step, method=autopar.PipeshardParallel(
      mesh=mesh8(), num_micro_batches=2, num_stages=2), donate_argnums=())
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")         # (custom_partitioning: no sharding rule)
    got, loss = p(params, x)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_trees_close(got, ref)
  for st in p.get_executable(params, x).plan.stages:
    assert st.batch_axes in ((), ("data", "model")), st.batch_axes
