"""The Ray runtime against one process, measured side by side in one run.

    python benchmark/ray_runtime.py

Trains the same MLP (4 x 1024 hidden, batch 2048, SGD, 2 micro-batches,
DataParallel on a (2, 4) mesh) two ways, alternating steps:

* in this process on 8 simulated CPU devices;
* through ``autopar.init(cluster="ray")``: 2 host workers x 4 simulated
  devices joined by ``jax.distributed`` (gloo), the state kept on the
  workers between steps.

Prints the median step time of each and their ratio (target <= 1.5 on a
2-core machine), the time of ten steps sent before any loss is read against
ten steps each read at once (the workers return once a step is dispatched,
so steps overlap the driver's work), and the bytes sent from the driver per
step after the first (target: only the batch's shards, each row once).

Then the same step with each host loading its own rows (``autopar.DataSource``)
at batch 2048 and 4096: one step read alone, ten steps sent before the last
is read (target: no more than 10 x one step's device time + one step), and
the bytes of a call's message to a host (target: the same for both batch
sizes), against the message carrying the batch from the driver.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import autopar  # noqa: E402
from autopar.runtime import cluster  # noqa: E402
from models import MLP, StoredBatches  # noqa: E402, F401  (the workers import them too)


def setup():
  from flax.training import train_state
  model = MLP(hidden=1024, out=16, layers=4)
  rng = np.random.RandomState(0)
  batch = {"x": rng.randn(2048, 256).astype(np.float32),
           "y": rng.randn(2048, 16).astype(np.float32)}
  params = jax.device_get(model.init(jax.random.PRNGKey(0), batch["x"][:1]))

  def make_state():
    return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                         tx=optax.sgd(0.01, momentum=0.9))
  return make_state, batch


def step(state, batch):
  def loss_fn(p):
    return ((state.apply_fn(p, batch["x"]) - batch["y"]) ** 2).mean()
  loss, grads = autopar.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), loss


def main(steps=20):
  make_state, batch = setup()
  local = autopar.parallelize(step, method=autopar.DataParallel(
      mesh=jax.make_mesh((2, 4), ("data", "model")), num_micro_batches=2))
  local_state, loss = local(make_state(), batch)          # compile
  loss.block_until_ready()

  autopar.init("ray", num_hosts=2, num_devices_per_host=4)
  try:
    c = cluster.current()
    remote = autopar.parallelize(step, method=autopar.DataParallel(
        mesh=autopar.global_mesh((2, 4), ("data", "model")), num_micro_batches=2))
    remote_state, rloss = remote(make_state(), batch)     # compile, send the state
    float(rloss)
    times = {"local": [], "ray": []}
    moved, inside = [], []
    for _ in range(steps):
      t = time.perf_counter()
      local_state, loss = local(local_state, batch)
      loss.block_until_ready()
      times["local"].append(time.perf_counter() - t)
      before = c.bytes_sent
      t = time.perf_counter()
      remote_state, rloss = remote(remote_state, batch)
      float(rloss)                         # fetched: waits for the step
      times["ray"].append(time.perf_counter() - t)
      moved.append(c.bytes_sent - before)
      inside.append(max(c.last_step_seconds))
    np.testing.assert_allclose(float(rloss), float(loss), rtol=1e-4)
    # Overlap: ten steps sent without reading a loss, then the last read.
    t = time.perf_counter()
    for _ in range(10):
      remote_state, rloss = remote(remote_state, batch)
    float(rloss)
    overlapped = time.perf_counter() - t
    # The same steps with each host loading its own rows (a DataSource):
    # ten steps against one step read alone, and the bytes of a call's
    # message for two batch sizes against the batch sent by the driver.
    loaded = {}
    for rows in (len(batch["x"]), 2 * len(batch["x"])):
      data = {k: np.concatenate([v] * (rows // len(v))) for k, v in batch.items()}
      loader = StoredBatches([data])
      source = autopar.DataSource(loader, like=loader.like())
      remote_state, rloss = remote(remote_state, source)      # compile
      float(rloss)
      one = []
      for _ in range(5):
        t = time.perf_counter()
        remote_state, rloss = remote(remote_state, source)
        float(rloss)
        one.append(time.perf_counter() - t)
      t = time.perf_counter()
      for _ in range(10):
        remote_state, rloss = remote(remote_state, source)
      float(rloss)
      loaded[rows] = (float(np.median(one)), time.perf_counter() - t, c.last_call_bytes)
      remote_state, rloss = remote(remote_state, data)
      float(rloss)
      loaded[rows] += (c.last_call_bytes,)
  finally:
    autopar.shutdown()
  med = {k: float(np.median(v)) for k, v in times.items()}
  batch_bytes = sum(x.nbytes for x in batch.values())
  print(f"step time, median of {steps}: one process (8 devices) "
        f"{med['local'] * 1e3:.1f} ms, Ray 2 hosts x 4 devices {med['ray'] * 1e3:.1f} ms, "
        f"ratio {med['ray'] / med['local']:.2f} (of which the workers' dispatch of "
        f"the step {np.median(inside) * 1e3:.1f} ms)")
  print(f"ten steps sent before reading a loss: {overlapped * 1e3:.1f} ms, against "
        f"10 x one step read each time {10 * med['ray'] * 1e3:.1f} ms "
        f"(x{overlapped / (10 * med['ray']):.2f})")
  print(f"bytes sent from the driver per step after the first: "
        f"{int(np.median(moved))} (the batch is {batch_bytes} bytes)")
  for rows, (one, ten, source_bytes, driver_bytes) in loaded.items():
    print(f"batch {rows} loaded by each host (DataSource): one step {one * 1e3:.1f} ms, "
          f"ten unread steps {ten * 1e3:.1f} ms (x{ten / (10 * one):.2f} of 10 x one "
          f"step); a call's message to a host {source_bytes} bytes, {driver_bytes} "
          f"with the batch sent by the driver")


if __name__ == "__main__":
  main()
