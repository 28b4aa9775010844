"""Data parallelism with gradient accumulation: numerics, donation, HLO, caching."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import autopar
from autopar.backend import hlo
from models import (assert_trees_close, mlp_setup, single_device,
                    transformer_setup)


def mesh_of(n, kind="make_mesh"):
  shape, names = {1: ((1,), ("data",)), 2: ((2,), ("data",)),
                  4: ((2, 2), ("data", "model")), 8: ((2, 4), ("data", "model"))}[n]
  if kind == "make_mesh":      # Explicit axes, the jax 0.10 default
    return jax.make_mesh(shape, names)
  devices = np.array(jax.devices()[:n]).reshape(shape)
  return Mesh(devices, names)  # Auto axes


def train_side_by_side(p, ref, make_state, batch, steps):
  """Trains ``p`` and the reference for ``steps`` steps; losses and params agree."""
  ref_state, state = make_state(), make_state()
  for _ in range(steps):
    ref_state, ref_loss = ref(ref_state, batch)
    state, loss = p(state, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_trees_close(state.params, ref_state.params)


@pytest.mark.parametrize("devices,n,kind", [
    (1, 1, "make_mesh"), (2, 2, "make_mesh"), (4, 4, "Mesh"), (8, 1, "make_mesh"),
    (8, 2, "Mesh"), (8, 4, "make_mesh")])
def test_mlp_adam_matches_single_device(devices, n, kind):
  make_state, step, batch = mlp_setup()
  ref_state, ref_loss = single_device(step)(make_state(), batch)
  p = autopar.parallelize(step, method=autopar.DataParallel(
      mesh=mesh_of(devices, kind), num_micro_batches=n))
  state, loss = p(make_state(), batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_trees_close(state.params, ref_state.params)
  assert_trees_close(state.opt_state, ref_state.opt_state)
  assert int(state.step) == 1


@pytest.mark.parametrize("devices,n", [(1, 4), (2, 1), (4, 2), (8, 2)])
def test_transformer_sgd_momentum_three_steps(devices, n):
  make_state, step, batch = transformer_setup()
  ref = single_device(step)
  p = autopar.parallelize(step, method=autopar.DataParallel(
      mesh=mesh_of(devices), num_micro_batches=n))
  train_side_by_side(p, ref, make_state, batch, steps=3)


def test_per_example_outputs_and_counts_are_combined_in_batch_order():
  make_state, _, batch = mlp_setup()

  def step(state, batch):
    def loss_fn(p):
      pred = state.apply_fn(p, batch["x"])
      per_example = jnp.mean((pred - batch["y"]) ** 2, axis=1)
      return per_example.mean(), (per_example, jnp.sum(per_example > 1.0))
    (loss, (per_ex, count)), grads = autopar.value_and_grad(
        loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads), loss, per_ex, count

  ref = single_device(step)(make_state(), batch)
  p = autopar.parallelize(step, method=autopar.DataParallel(
      mesh=mesh_of(8), num_micro_batches=2))
  out = p(make_state(), batch)
  np.testing.assert_allclose(out[1], ref[1], rtol=1e-5)
  np.testing.assert_allclose(out[2], ref[2], rtol=1e-5, atol=1e-6)
  assert out[3].dtype == ref[3].dtype and int(out[3]) == int(ref[3])
  exe = p.get_executable(make_state(), batch)
  # Per-example outputs come back split over the batch axes.
  assert out[2].sharding.spec == exe.plan.outputs[-2].spec == P(("data", "model"))


def test_state_is_donated_and_outputs_carry_planned_shardings():
  make_state, step, batch = mlp_setup()
  mesh = mesh_of(8)
  p = autopar.parallelize(step, method=autopar.DataParallel(mesh=mesh,
                                                           num_micro_batches=2))
  exe = p.get_executable(make_state(), batch)
  state = jax.device_put(make_state(), exe.plan.input_shardings[0])
  old = jax.tree.leaves(state)
  new_state, loss = p(state, batch)
  assert all(x.is_deleted() for x in old)
  assert not any(x.is_deleted() for x in jax.tree.leaves(new_state))
  for x, s in zip(jax.tree.leaves(new_state), jax.tree.leaves(exe.plan.input_shardings[0])):
    assert x.sharding.is_equivalent_to(s, x.ndim)
    assert x.sharding.mesh.axis_types == mesh.axis_types   # the user's own mesh
  # The updated state feeds the next step without copies; the batch is not donated.
  p(new_state, batch)
  assert not any(np.asarray(v).size == 0 for v in batch.values())


def test_accumulated_gradients_are_updated_in_place():
  make_state, step, batch = mlp_setup()
  p = autopar.parallelize(step, method=autopar.DataParallel(mesh=mesh_of(8),
                                                           num_micro_batches=4))
  exe = p.get_executable(make_state(), batch)
  text = exe.stages["accumulate_grad"].as_text()
  # Every partial-sum buffer (one per gradient) is aliased to its output.
  num_grads = len(exe.plan.grads)
  aliases = re.findall(r"\(\d+, \{[^}]*\}, (?:may|must)-alias\)", text)
  assert len(aliases) >= num_grads


def _grad_collective_bytes(compiled, min_bytes):
  return sum(c.operand_bytes for c in hlo.collectives(compiled)
             if c.operand_bytes >= min_bytes)


@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_gradients_cross_devices_once_per_step(model):
  make_state, step, batch = (mlp_setup(batch=64) if model == "mlp"
                             else transformer_setup(batch=64))
  smallest_grad = None
  per_step = {}
  for n in (1, 2, 4, 8):
    p = autopar.parallelize(step, method=autopar.DataParallel(   # (stages apart)
        mesh=mesh_of(8), num_micro_batches=n, one_executable=False))
    exe = p.get_executable(make_state(), batch)
    grad_bytes = [g.bytes_per_device(exe.plan.axis_sizes) for g in exe.plan.grads]
    smallest_grad = min(grad_bytes)
    # (On CPUs the sync is a stage of its own: ParallelMethod.grad_sync.)
    assert exe.schedule == (["compute_grad_sync", "apply_grad"] if n == 1 else
                            ["zero_grad", *["accumulate_grad"] * n, "sync_grad",
                             "apply_grad"])
    if n > 1:
      assert hlo.collectives(exe.stages["accumulate_grad"]) == []
    per_step[n] = sum(_grad_collective_bytes(exe.stages[name], smallest_grad)
                      for name in exe.schedule)
  assert per_step[1] >= sum(grad_bytes)
  assert per_step[1] == per_step[2] == per_step[4] == per_step[8]


def test_same_shapes_do_not_retrace_and_new_shapes_do():
  make_state, _, batch = mlp_setup()
  traces = []

  def step(state, batch):
    traces.append(1)
    loss, grads = autopar.value_and_grad(
        lambda p: jnp.mean((state.apply_fn(p, batch["x"]) - batch["y"]) ** 2))(
            state.params)
    return state.apply_gradients(grads=grads), loss

  p = autopar.parallelize(step, method=autopar.DataParallel(mesh=mesh_of(2),
                                                           num_micro_batches=2))
  state, _ = p(make_state(), batch)
  count = len(traces)
  state, _ = p(state, batch)
  state, _ = p(state, {k: v + 1 for k, v in batch.items()})
  assert len(traces) == count
  assert p.get_executable(state, batch) is p.get_executable(state, batch)
  half = {k: v[:16] for k, v in batch.items()}
  state, _ = p(state, half)
  assert len(traces) > count


def test_step_without_marker_runs_with_one_micro_batch():
  make_state, _, batch = mlp_setup()

  def step(state, batch):
    loss, grads = jax.value_and_grad(
        lambda p: jnp.mean((state.apply_fn(p, batch["x"]) - batch["y"]) ** 2))(
            state.params)
    return state.apply_gradients(grads=grads), loss

  ref_state, ref_loss = single_device(step)(make_state(), batch)
  p = autopar.parallelize(step, method=autopar.DataParallel(mesh=mesh_of(8)))
  state, loss = p(make_state(), batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_trees_close(state.params, ref_state.params)
  assert p.get_executable(make_state(), batch).schedule == ["step"]


def test_plan_json_round_trip_and_summary():
  make_state, step, batch = mlp_setup()
  p = autopar.parallelize(step, method=autopar.DataParallel(mesh=mesh_of(8),
                                                           num_micro_batches=2))
  exe = p.get_executable(make_state(), batch)
  plan = exe.plan
  again = autopar.Plan.from_json(plan.to_json())
  assert again == plan
  assert again.to_json() == plan.to_json()
  text = plan.summary(full=True)            # every leaf on its own line
  for leaf in plan.inputs:
    assert leaf.name in text
  assert "all-reduce" in text and "gradients" in text
  assert "all-reduce" in plan.summary() and "gradients" in plan.summary()
  shardings = plan.input_shardings
  assert isinstance(shardings[1]["x"], NamedSharding)
  assert shardings[1]["x"].spec == P(("data", "model"))
  assert jax.tree.structure(shardings[0]) == jax.tree.structure(make_state())
  assert set(exe.stages) == set(exe.schedule)
  assert isinstance(plan.objective, float) and plan.objective > 0


def test_batch_axes_subset_keeps_other_axes_replicated():
  make_state, step, batch = mlp_setup()
  ref_state, _ = single_device(step)(make_state(), batch)
  p = autopar.parallelize(step, method=autopar.DataParallel(
      mesh=mesh_of(8), num_micro_batches=2, batch_axes=("data",)))
  state, _ = p(make_state(), batch)
  assert_trees_close(state.params, ref_state.params)
  exe = p.get_executable(make_state(), batch)
  assert exe.plan.batch_axes == ("data",)
  (reduce,) = [c for c in hlo.collectives(exe.stages["sync_grad"])
               if c.operand_bytes > 64]
  assert reduce.group_size == 2


def test_default_method_and_decorator_forms():
  make_state, step, batch = mlp_setup()
  ref_state, _ = single_device(step)(make_state(), batch)
  bare = autopar.parallelize(step)
  called = autopar.parallelize()(step)
  for p in (bare, called):
    state, _ = p(make_state(), batch)
    assert_trees_close(state.params, ref_state.params)
    assert p.get_executable(make_state(), batch).plan.mesh_shape == (8,)


def test_mlp_adam_several_steps():
  make_state, step, batch = mlp_setup()
  ref = single_device(step)
  p = autopar.parallelize(step, method=autopar.DataParallel(
      mesh=mesh_of(8), num_micro_batches=4))
  train_side_by_side(p, ref, make_state, batch, steps=3)


def test_state_with_prng_key_and_plain_tuple_arguments():
  def step(state, batch):
    w, key = state
    key, sub = jax.random.split(key)
    noise = 0.01 * jax.random.normal(sub, w.shape)
    loss, g = autopar.value_and_grad(lambda w: jnp.mean((batch @ w) ** 2))(w)
    return (w - 0.1 * g + noise, key), loss

  x = np.random.RandomState(0).randn(16, 3).astype(np.float32)
  make = lambda: (jnp.ones((3, 2)), jax.random.key(7))
  (ref_w, ref_key), ref_loss = single_device(step)(make(), x)
  p = autopar.parallelize(step, method=autopar.DataParallel(
      mesh=mesh_of(4), num_micro_batches=2), donate_argnums=(0,))
  (w, key), loss = p(make(), x)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  np.testing.assert_allclose(w, ref_w, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(jax.random.key_data(key)),
                                np.asarray(jax.random.key_data(ref_key)))
  assert "key<fry>" in p.get_executable(make(), x).plan.summary()


def test_saved_plan_runs_without_planning_and_is_checked():
  make_state, step, batch = mlp_setup()
  mesh = mesh_of(8)
  planned = autopar.parallelize(step, method=autopar.ShardParallel(
      mesh=mesh, num_micro_batches=2)).plan(make_state(), batch)
  loaded = autopar.Plan.from_json(planned.to_json())
  p = autopar.parallelize(step, method=autopar.ShardParallel(
      mesh=mesh, num_micro_batches=2, plan=loaded))
  ref_state, _ = single_device(step)(make_state(), batch)
  state, _ = p(make_state(), batch)
  assert_trees_close(state.params, ref_state.params)
  assert p.get_executable(make_state(), batch).plan == planned
  with pytest.raises(autopar.PlanError, match="num_micro_batches=2"):
    autopar.parallelize(step, method=autopar.ShardParallel(
        mesh=mesh, num_micro_batches=4, plan=loaded))(make_state(), batch)
  with pytest.raises(autopar.PlanError, match="does not match the arguments"):
    autopar.parallelize(step, method=autopar.ShardParallel(
        mesh=mesh, num_micro_batches=2, plan=loaded))(
            make_state(), {k: np.concatenate([v, v]) for k, v in batch.items()})


def _host_tanh(x):
  """tanh computed on the host (a ``jax.pure_callback``)."""
  return jax.pure_callback(lambda v: np.tanh(np.asarray(v)),
                           jax.ShapeDtypeStruct(x.shape, x.dtype), x,
                           vmap_method="broadcast_all")


def _partitioned_sin():
  """sin as a ``custom_partitioning`` op (as cuDNN's fused attention is)."""
  from jax.experimental.custom_partitioning import custom_partitioning

  @custom_partitioning
  def sin(x):
    return jnp.sin(x)

  def partition(mesh, arg_shapes, result_shape):
    sharding = arg_shapes[0].sharding
    return mesh, jnp.sin, sharding, (sharding,)

  sin.def_partition(infer_sharding_from_operands=lambda mesh, args, result: args[0].sharding,
                    partition=partition, sharding_rule="i j -> i j")
  return sin


def _printed(x):
  jax.debug.print("x sums to {}", x.sum())
  return x


@pytest.mark.parametrize("op", ["pure_callback", "custom_partitioning", "debug_print"])
@pytest.mark.parametrize("method", ["dp n=1", "dp n=2", "shard 2x4"])
def test_op_lowered_with_devices_on_an_explicit_mesh(op, method):
  """A step holding an op that JAX lowers with the devices in hand (a host
  callback; custom_partitioning, as cuDNN's attention) on a mesh of Explicit
  axes: JAX wants all of the program's shardings on one mesh, so autopar
  hands results back on the mesh's Auto twin. Before, the compile failed
  with JAX's "mesh should be the same across the entire program" (and the
  callback's result type kept the symbolic batch size of the one trace).
  jax.debug.print is not such an op: its step's results stay on the mesh as
  given. The loss is a masked token mean, compared with one device over 2
  steps."""
  f = {"pure_callback": _host_tanh, "debug_print": _printed,
       "custom_partitioning": _partitioned_sin()}[op]
  rng = np.random.RandomState(3)
  x = rng.randn(16, 6).astype(np.float32)
  mask = (rng.rand(16, 6) > 0.3).astype(np.float32)
  params = {"w": jnp.asarray(rng.randn(6, 6).astype(np.float32)), "b": jnp.zeros(6)}

  def step(params, x, mask):
    def loss(p):
      h = f(x) @ p["w"] + p["b"]
      return jnp.sum(mask * h ** 2) / jnp.sum(mask)
    value, grads = autopar.value_and_grad(loss)(params)
    return jax.tree.map(lambda a, g: a - 0.1 * g, params, grads), value

  mesh = jax.make_mesh((2, 4), ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  m = {"dp n=1": autopar.DataParallel(mesh=mesh),
       "dp n=2": autopar.DataParallel(mesh=mesh, num_micro_batches=2),
       "shard 2x4": autopar.ShardParallel(mesh=mesh)}[method]
  p = autopar.parallelize(step, method=m, batch_argnums=(1, 2))
  ref = single_device(step)
  ours, theirs = params, params
  for _ in range(2):
    ours, loss = p(ours, x, mask)
    theirs, ref_loss = ref(theirs, x, mask)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_trees_close(ours, theirs)
  kind = (jax.sharding.AxisType.Explicit if op == "debug_print" else
          jax.sharding.AxisType.Auto)
  assert ours["w"].sharding.mesh.axis_types == (kind, kind)
