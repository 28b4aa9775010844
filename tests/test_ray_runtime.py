"""The Ray runtime: 2 host workers x 4 simulated CPU devices joined by
jax.distributed (a real multi-process mesh, gloo collectives), against the
same methods run in this process on 8 simulated devices."""

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopar
from autopar.runtime import cluster
from models import (FailsOnce, RowsChecked, StoredBatches, assert_trees_close, dropout_setup, mlp_setup,
                    single_device, transformer_setup, wait_for_ray_start)

SGD = optax.sgd(0.1, momentum=0.9)
STEPS = 3


def methods(mesh):
  return {
      "dp": autopar.DataParallel(mesh=mesh, num_micro_batches=2),
      "shard": autopar.ShardParallel(mesh=mesh, num_micro_batches=2),
  }


def setups():
  return {"mlp": mlp_setup(batch=32, tx=SGD),
          "transformer": transformer_setup(batch=16, d=32, heads=4, tx=SGD),
          # Each host draws its rows of the whole batch's dropout masks.
          "dropout": dropout_setup(batch=32, tx=SGD)}


def train(step, make_state, batch, method, steps=STEPS, state=None):
  p = autopar.parallelize(step, method=method)
  state = make_state() if state is None else state
  losses = []
  for _ in range(steps):
    state, loss = p(state, batch)
    losses.append(float(loss))
  return state, losses, p


@pytest.fixture(scope="module")
def references():
  """Losses and final parameters in this process on 8 devices."""
  assert cluster.current() is None
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  out = {}
  for name, (make_state, step, batch) in setups().items():
    for mname, method in methods(mesh).items():
      state, losses, _ = train(step, make_state, batch, method)
      out[name, mname] = (jax.device_get(state.params), losses)
  return out


@pytest.fixture(scope="module")
def ray_head():
  """A one-node Ray cluster started as a user would (``ray start --head``),
  for autopar to join; it outlives autopar.shutdown() and ends here."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
  # Token authentication, as `ray start` sets up by default since Ray 2.59;
  # the driver (this process) must then say so too.
  saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")}
  os.environ["RAY_AUTH_MODE"] = "token"
  # Its own temp dir: `ray start` records the cluster there for ray.init()
  # to find, and a record left in the default /tmp/ray after the cluster is
  # gone would send later plain ray.init() calls on this machine to it.
  # (Under /tmp, as Ray's own: its sockets' paths must stay short.)
  temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp" if os.path.isdir("/tmp") else None)
  # The cluster's token, made here: `ray start` makes none, and a machine
  # that never ran Ray (or a fresh HOME) has no ~/.ray/auth_token to fall
  # back on. Both the head and this process (the driver) read it.
  token = os.path.join(temp_dir, "auth_token")
  with open(token, "w") as f:
    f.write(secrets.token_hex(32))
  os.environ["RAY_AUTH_TOKEN_PATH"] = token
  _reread_ray_auth()
  head = subprocess.Popen(
      [ray_cli, "start", "--head", "--block", f"--port={port}",
       "--node-ip-address=127.0.0.1", "--num-cpus=2", "--include-dashboard=false",
       "--disable-usage-stats", f"--temp-dir={temp_dir}"],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  wait_for_ray_start(head, "ray start --head")
  yield head, f"127.0.0.1:{port}"
  head.terminate()                           # --block: ends the node's processes
  head.wait(timeout=60)
  shutil.rmtree(temp_dir, ignore_errors=True)
  for k, v in saved.items():
    if v is None:
      os.environ.pop(k, None)
    else:
      os.environ[k] = v


def _reread_ray_auth() -> None:
  """Has this process's Ray read its authentication settings again from the
  environment just set (Ray reads them into a process-wide config once).
  In the whole suite something before this file had Ray read them unset,
  and the driver then could not join the token-authenticated head
  ("RAY_AUTH_MODE is currently 'disabled'"); what, was not found. Ray's
  own test helper for this, where the installed Ray has one."""
  try:
    from ray._private.authentication_test_utils import reset_auth_token_state
  except ImportError:      # (a Ray without token authentication)
    return
  reset_auth_token_state()


@pytest.fixture(scope="module")
def ray_cluster(references, ray_head):
  autopar.init("ray", address=ray_head[1], num_hosts=2, num_devices_per_host=4)
  yield cluster.current()
  autopar.shutdown()


@pytest.mark.parametrize("model", ["mlp", "transformer", "dropout"])
@pytest.mark.parametrize("mname", ["dp", "shard"])
def test_two_hosts_equal_one_process(ray_cluster, references, model, mname):
  make_state, step, batch = setups()[model]
  mesh = autopar.global_mesh((2, 4), ("data", "model"))
  assert isinstance(mesh, jax.sharding.AbstractMesh)
  state, losses, _ = train(step, make_state, batch, methods(mesh)[mname])
  ref_params, ref_losses = references[model, mname]
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  # The state stays on the workers until asked for.
  leaf = jax.tree.leaves(state.params)[0]
  assert isinstance(leaf, autopar.RemoteArray)
  assert_trees_close(jax.device_get(state.params), ref_params)


def test_steps_overlap_and_their_outputs_are_read_later(ray_cluster, references):
  """A call returns once the workers dispatched the step: three steps are
  sent before any loss is read, and each loss, read afterwards, is the one
  this process computes."""
  make_state, step, batch = setups()["mlp"]
  p = autopar.parallelize(step, method=methods(autopar.global_mesh(
      (2, 4), ("data", "model")))["dp"])
  state, kept = make_state(), []
  for _ in range(STEPS):
    state, loss = p(state, batch)
    kept.append(loss)
  np.testing.assert_allclose([float(x) for x in kept], references["mlp", "dp"][1],
                             rtol=1e-5)


def test_only_batch_shards_move_after_the_first_step(ray_cluster):
  make_state, step, batch = setups()["mlp"]
  p = autopar.parallelize(step, method=autopar.DataParallel(
      mesh=autopar.global_mesh((8,), ("data",))))
  state, _ = p(make_state(), batch)
  before = ray_cluster.bytes_sent
  state, _ = p(state, batch)
  moved = ray_cluster.bytes_sent - before
  assert moved == sum(x.nbytes for x in batch.values())   # each row once


def test_a_mesh_of_another_size_names_init_s_num_devices(ray_cluster):
  with pytest.raises(autopar.MeshError, match=r"\(2, 2\) has 4 devices but the Ray "
                     r"cluster has 8 \(2 host\(s\) x 4 device\(s\)\).*num_devices=4"):
    autopar.global_mesh((2, 2), ("data", "model"))


@pytest.mark.parametrize("mname", ["dp", "shard", "pipeline"])
def test_each_host_loads_its_rows_as_the_driver_would_send_them(ray_cluster, mname):
  """A DataSource in the batch's place: each host loads its own rows (a
  pipeline's first-stage host the inputs, its last the labels), and three
  steps on three batches give the numbers of the same batches sent through
  the driver."""
  batches = [transformer_setup(batch=16, d=32, heads=4, seed=s, tx=SGD)[2]
             for s in range(3)]
  make_state, step, _ = transformer_setup(batch=16, d=32, heads=4, tx=SGD)
  if mname == "pipeline":
    method = autopar.PipeshardParallel(
        mesh=autopar.global_mesh((2, 4), ("host", "model")), num_micro_batches=2,
        num_stages=2, stage_mesh_shapes=[(1, 4), (1, 4)])
  else:
    method = methods(autopar.global_mesh((2, 4), ("data", "model")))[mname]
  # Data parallel over both hosts: each host loads its own half of the rows.
  loader = (RowsChecked(batches, {0: (0, 8), 1: (8, 16)}) if mname == "dp" else
            StoredBatches(batches))
  source = autopar.DataSource(loader, like=loader.like())
  from_hosts = autopar.parallelize(step, method=method)
  from_driver = autopar.parallelize(step, method=method)
  a, b = make_state(), make_state()
  c = cluster.current()
  for k in range(3):
    before = c.bytes_sent
    a, loss_a = from_hosts(a, source)
    if k:                    # (the first step sends the state)
      assert c.bytes_sent == before        # no batch bytes left the driver
    b, loss_b = from_driver(b, batches[k])
    np.testing.assert_allclose(float(loss_a), float(loss_b), rtol=1e-6)
  assert_trees_close(jax.device_get(a.params), jax.device_get(b.params), rtol=1e-6)


def test_bytes_through_the_driver_do_not_grow_with_a_loaded_batch(ray_cluster):
  """Per step the driver sends a data source's hosts the same message for a
  batch of 32 rows and of 512, and the batch itself through the driver."""
  mesh = autopar.global_mesh((8,), ("data",))
  sent = {}
  for rows in (32, 512):
    make_state, step, batch = mlp_setup(batch=rows, tx=SGD)
    loader = StoredBatches([batch])
    p = autopar.parallelize(step, method=autopar.DataParallel(mesh=mesh))
    for how, data in (("source", autopar.DataSource(loader, like=loader.like())),
                      ("driver", batch)):
      state, _ = p(make_state(), data)
      state, loss = p(state, data)
      float(loss)
      sent[how, rows] = ray_cluster.last_call_bytes
  assert sent["source", 512] - sent["source", 32] <= 16, sent    # (digits of shapes)
  grown = sum(x.nbytes for x in mlp_setup(batch=512)[2].values()) - sum(
      x.nbytes for x in mlp_setup(batch=32)[2].values())
  assert sent["driver", 512] - sent["driver", 32] >= grown / 8, sent   # (per host)


def test_a_loader_failing_on_one_host_fails_the_call_and_nothing_else(ray_cluster):
  """Host 1's loader raises the first time: the call raises on the driver,
  host 0 has not started the step (no collective left waiting), the state
  is untouched, and the next call loads batch 0 again and trains on."""
  batches = [mlp_setup(batch=32, seed=s, tx=SGD)[2] for s in range(2)]
  make_state, step, _ = mlp_setup(batch=32, tx=SGD)
  loader = FailsOnce(batches, host=1)
  source = autopar.DataSource(loader, like=loader.like())
  method = autopar.DataParallel(mesh=autopar.global_mesh((2, 4), ("data", "model")))
  p, ref = autopar.parallelize(step, method=method), autopar.parallelize(step, method=method)
  state, ref_state = p(make_state(), batches[0])[0], ref(make_state(), batches[0])[0]
  with pytest.raises(OSError, match="not there yet") as e:   # the loader's own class
    p(state, source)
  assert isinstance(e.value, autopar.ClusterError) and type(e.value.__cause__) is OSError
  assert "the host's traceback" in str(e.value)
  assert source.step == 0
  for k in range(2):
    state, loss = p(state, source)
    ref_state, ref_loss = ref(ref_state, batches[k])
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
  assert source.step == 2


def test_a_loader_that_returns_other_rows_is_named(ray_cluster):
  make_state, step, batch = mlp_setup(batch=32, tx=SGD)
  like = StoredBatches([batch]).like()
  wrong = autopar.DataSource(StoredBatches([{k: v[:4] for k, v in batch.items()}]), like)
  p = autopar.parallelize(step, method=autopar.DataParallel(
      mesh=autopar.global_mesh((8,), ("data",))))
  with pytest.raises(autopar.InputError, match="shard.rows names"):
    p(make_state(), wrong)


@pytest.mark.parametrize("model,shapes,schedule", [
    ("mlp", [(1, 4), (1, 4)], "1f1b"),
    ("mlp", [(1, 4), (1, 4)], "zb-h1"),
    # 4 stages on the 2 hosts' submeshes: each micro-batch crosses hosts 3 times.
    ("mlp6", [(1, 4), (1, 4)], "interleaved-1f1b"),
    # ZB-V: the turn stays on host 1, the loss comes back to host 0; the
    # micro-batches chosen by the search (the workers run the driver's number).
    ("mlp6", [(1, 4), (1, 4)], "zb-v"),
    # Submeshes of different sizes: values gathered, sent and spread.
    ("gpt", [(1, 4), (1, 2), (1, 2)], "1f1b")])
def test_pipeline_stages_on_their_hosts_equal_jit(ray_cluster, model, shapes, schedule,
                                                  tmp_path):
  """PipeshardParallel on 2 hosts: each stage runs on the workers of the
  host its submesh lies on, activations cross hosts worker to worker (the
  driver sends only the batch), and the result equals single-device jit;
  the state is saved from the stages (no array copied over the mesh) and,
  restored onto them, trains on."""
  make_state, step, batch = (
      mlp_setup(batch=32, tx=SGD, layers=6 if model == "mlp6" else 2)
      if model.startswith("mlp") else
      transformer_setup(batch=16, d=32, heads=4, tx=SGD, layers=4))
  mesh = autopar.global_mesh((2, 4), ("host", "model"))
  method = autopar.PipeshardParallel(
      mesh=mesh, num_micro_batches="auto" if schedule == "zb-v" else 4,
      num_stages=len(shapes), stage_mesh_shapes=shapes,
      schedule=schedule, virtual_stages=2 if schedule == "interleaved-1f1b" else 1)
  p = autopar.parallelize(step, method=method, donate_argnums=(0,))
  ref_fn = single_device(step)
  state, ref = make_state(), make_state()
  c = cluster.current()
  losses, ref_losses = [], []
  for _ in range(2):
    before = c.bytes_sent
    state, loss = p(state, batch)
    ref, ref_loss = ref_fn(ref, batch)
    losses.append(float(loss))
    ref_losses.append(float(ref_loss))
  # The second step: only the batch left the driver, once, to stage 0's host
  # (and the labels to the last stage's).
  assert c.bytes_sent - before == sum(x.nbytes for x in batch.values())
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert_trees_close(jax.device_get(state.params), jax.device_get(ref.params))
  plan = p.plan(jax.eval_shape(make_state), batch)
  hosts = [{c.device_hosts[d] for d in range(st.submesh_offset,
                                             st.submesh_offset + int(np.prod(st.submesh_shape)))}
           for st in plan.stages]
  assert hosts[0] == {0} and hosts[-1] == ({0} if schedule == "zb-v" else {1})
  if schedule == "zb-v":
    assert (plan.num_micro_batches, "chosen") in [(k, w) for k, _, w in
                                                  plan.micro_batch_search]
  if model != "mlp" or schedule != "1f1b":
    return
  # Saved from the stages: every host writes its own stage's arrays, none is
  # copied over the whole mesh (the shardings written say where each lay).
  path = str(tmp_path / "ckpt")
  autopar.save_checkpoint(path, state)
  from autopar.runtime.checkpoint import stage_manifest
  written = {r["path"]: tuple(r["sharding"]["devices"]) for r in stage_manifest(path)}
  assert {len(d) for d in written.values()} == {4}       # a stage's 1 x 4 submesh each
  assert len(set(written.values())) == 2                 # both stages' arrays, each its own
  target = jax.eval_shape(make_state)
  whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  on_whole = autopar.restore_checkpoint(path, target, jax.tree.map(lambda _: whole, target))
  with pytest.raises(autopar.InputError, match="restored onto the devices it was saved"):
    autopar.restore_checkpoint(path, target, jax.tree.map(lambda _: jax.sharding.NamedSharding(
        jax.sharding.AbstractMesh((2, 2), ("host", "model")), jax.sharding.PartitionSpec()),
        target))
  # Straight back onto the stages; the next step trains on.
  state = autopar.restore_checkpoint(path, target, plan.input_shardings[0])
  assert_trees_close(jax.device_get(state.params), jax.device_get(on_whole.params))
  state, loss = p(state, batch)
  ref, ref_loss = ref_fn(ref, batch)
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
  assert_trees_close(jax.device_get(state.params), jax.device_get(ref.params))


def test_a_killed_worker_is_named_and_a_checkpoint_resumes(ray_cluster, ray_head,
                                                          references, tmp_path):
  make_state, step, batch = setups()["mlp"]
  mesh = autopar.global_mesh((2, 4), ("data", "model"))
  method = methods(mesh)["dp"]
  state, losses, p = train(step, make_state, batch, method, steps=1)
  path = str(tmp_path / "ckpt")
  autopar.save_checkpoint(path, state)

  os.kill(ray_cluster.pids[1], signal.SIGKILL)
  with pytest.raises(autopar.ClusterError, match=r"host 1 \("):
    p(state, batch)
  with pytest.raises(autopar.ClusterError, match="unusable"):
    p(state, batch)

  autopar.shutdown()
  head, address = ray_head
  assert head.poll() is None                 # the joined cluster is left running
  autopar.init("ray", address=address, num_hosts=2, num_devices_per_host=4)
  target = jax.eval_shape(make_state)
  shardings = p.plan(target, batch).input_shardings[0]
  state = autopar.restore_checkpoint(path, target, shardings)
  state, more, _ = train(step, make_state, batch, method, steps=STEPS - 1, state=state)
  ref_params, ref_losses = references["mlp", "dp"]
  np.testing.assert_allclose(losses + more, ref_losses, rtol=1e-5)
  assert_trees_close(jax.device_get(state.params), ref_params)


def test_nnx_modules_changed_in_place_on_the_workers(ray_cluster):
  """An nnx.jit-style step (model and optimizer changed in place): their
  variables take the workers' new values (RemoteArrays) after each step."""
  import warnings
  from flax import nnx
  warnings.simplefilter("ignore", DeprecationWarning)
  rng = np.random.RandomState(0)
  batch = {"x": rng.randn(32, 8).astype(np.float32), "y": rng.randn(32, 4).astype(np.float32)}

  def make():
    model = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, SGD, wrt=nnx.Param)

  def step(model, optimizer, batch):
    loss, grads = autopar.value_and_grad(
        lambda m: jnp.mean((m(batch["x"]) - batch["y"]) ** 2))(model)
    optimizer.update(model, grads)
    return loss

  ref_model, ref_opt = make()
  ref = nnx.jit(step)
  ref_losses = [float(ref(ref_model, ref_opt, batch)) for _ in range(2)]
  model, opt = make()
  p = autopar.parallelize(step, method=autopar.DataParallel(
      mesh=autopar.global_mesh((8,), ("data",))))
  losses = [float(p(model, opt, batch)) for _ in range(2)]
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert isinstance(model.kernel.get_value(), autopar.RemoteArray)
  np.testing.assert_allclose(np.asarray(model.kernel.get_value()), ref_model.kernel[...],
                             rtol=1e-5, atol=1e-6)


def test_static_argument_and_plan_on_remote_state(ray_cluster):
  make_state, step, batch = setups()["mlp"]

  def scaled(state, batch, scale):
    new, loss = step(state, batch)
    return new, loss * scale

  p = autopar.parallelize(scaled, method=autopar.DataParallel(
      mesh=autopar.global_mesh((8,), ("data",))))
  state, loss = p(make_state(), batch, 2.0)
  state, loss3 = p(state, batch, 3.0)        # another static value: another compile
  ref = autopar.parallelize(step, method=autopar.DataParallel(
      mesh=autopar.global_mesh((8,), ("data",))))
  s1, l1 = ref(make_state(), batch)
  _, l2 = ref(s1, batch)
  np.testing.assert_allclose([float(loss), float(loss3)],
                             [2 * float(l1), 3 * float(l2)], rtol=1e-5)
  plan = p.plan(state, batch, 3.0)          # RemoteArray leaves plan like arrays
  assert plan.batch_axes == ("data",)


def test_a_slow_living_host_is_waited_for_and_a_frozen_one_is_named(ray_head):
  """Liveness is apart from step time: a first step that takes longer than
  the liveness timeout (its trace sleeps) completes; a host that stops
  answering (SIGSTOP) is named within the timeout."""
  autopar.shutdown()
  autopar.init("ray", address=ray_head[1], num_hosts=2, num_devices_per_host=4,
               timeout=2.0)
  try:
    make_state, step, batch = setups()["mlp"]

    def slow_step(state, batch):
      time.sleep(3.0)          # at trace time: the workers' first call takes >= 3 s
      return step(state, batch)

    p = autopar.parallelize(slow_step, method=autopar.DataParallel(
        mesh=autopar.global_mesh((8,), ("data",))))
    state, loss = p(make_state(), batch)
    assert min(cluster.current().last_step_seconds) >= 3.0
    assert np.isfinite(float(loss))

    pid = cluster.current().pids[1]
    os.kill(pid, signal.SIGSTOP)
    try:
      # (found by the liveness check, not by the step's timeout)
      with pytest.raises(autopar.ClusterError, match=r"host\(s\) 1 \(.*liveness"):
        p(state, batch)
    finally:
      os.kill(pid, signal.SIGKILL)
  finally:
    autopar.shutdown()


def test_init_checks_its_timeouts():
  with pytest.raises(autopar.InputError, match="step_timeout=0"):
    autopar.init("ray", step_timeout=0)
  with pytest.raises(autopar.InputError, match="timeout='soon'"):
    autopar.init("ray", timeout="soon")
  with pytest.raises(autopar.InputError, match="num_devices=0"):
    autopar.init("ray", num_devices=0)
  with pytest.raises(autopar.InputError, match="num_devices_per_host=True"):
    autopar.init("ray", num_devices_per_host=True)


@pytest.mark.parametrize("nodes, asked, expected", [
    # A host per node: the mesh's devices split over the CPU nodes...
    ([0], {"num_devices": 8}, (1, 8, False)),
    ([0, 0], {"num_devices": 8}, (2, 4, False)),
    # ... or a node's GPUs each (fewer where the mesh is smaller).
    ([4, 4], {"num_devices": 8}, (2, 4, True)),
    ([8], {"num_devices": 4}, (1, 4, True)),
    # What is given is kept; the rest follows.
    ([0], {"num_devices": 8, "num_hosts": 2}, (2, 4, False)),
    ([0], {"num_devices": 8, "num_devices_per_host": 2}, (4, 2, False)),
    ([0], {"num_devices": 8, "num_hosts": 2, "num_devices_per_host": 4}, (2, 4, False)),
    # Without num_devices, as before: the nodes, 1 CPU device or a node's GPUs.
    ([0, 0, 0], {}, (3, 1, False)),
    ([0], {"num_hosts": 2, "num_devices_per_host": 4}, (2, 4, False)),
    ([2, 2], {}, (2, 2, True)),
])
def test_host_layout(nodes, asked, expected):
  from autopar.runtime.hosts import host_layout
  layout = host_layout(nodes, **asked)
  assert (layout.num_hosts, layout.devices_per_host, layout.gpus) == expected


@pytest.mark.parametrize("nodes, asked, message", [
    ([0, 0, 0], {"num_devices": 8}, r"not a multiple of the cluster's 3 node\(s\)"),
    ([0], {"num_devices": 8, "num_hosts": 3}, "not a multiple of num_hosts=3"),
    ([4], {"num_devices": 6}, "not a multiple of a node's 4 GPUs"),
    ([0], {"num_devices": 8, "num_hosts": 2, "num_devices_per_host": 2},
     "2 hosts x 2 devices is 4 devices, not num_devices=8"),
])
def test_host_layout_names_numbers_that_do_not_fit(nodes, asked, message):
  from autopar.runtime.hosts import host_layout
  with pytest.raises(autopar.InputError, match=message):
    host_layout(nodes, **asked)
