"""How pipeline activations cross hosts on a Ray cluster: JAX's cross-host
transfer (what PipeshardParallel uses, ``runtime/transfer.py``) against
Ray's object store, and against a move between submeshes in one process.

    python benchmark/pipeline_transfer.py    # about a minute on 2 CPU cores

Two host workers (``autopar.init("ray", num_hosts=2,
num_devices_per_host=4)``, joined by ``jax.distributed``); a float32
activation of each size, rows split over host 0's 4 devices, goes to host 1:

* ``jax, same size``: to host 1's 4 devices, shard to shard
  (``transfer.move``; every shard streams device to device);
* ``jax, 4 -> 2``: to 2 of host 1's devices (gathered on one device, sent,
  spread there);
* ``object store``: host 0 copies the array to NumPy and ``ray.put``s it,
  the driver passes the ObjectRef on, host 1 ``ray.get``s it and puts it on
  its devices (the other design: the driver relays a reference per value);
* ``in one process``: ``jax.device_put`` between two 4-device submeshes of
  one process's 8 devices (no host crossing), for scale.

Each figure is the median of 5 runs, from the first host starting to the
last finishing (wall clocks of one machine). On this machine both "hosts"
share 2 cores and the loopback: the figures compare the mechanisms' costs
here, not a network's.
"""

import os
import statistics
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax                                        # noqa: E402
import numpy as np                                # noqa: E402
import ray                                        # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P   # noqa: E402

import autopar                                    # noqa: E402
from autopar.runtime import cluster                       # noqa: E402

SIZES_MIB = (0.25, 4, 32)
REPEATS = 5


def _sharding(first: int, count: int):
  devices = np.array(jax.devices())[first:first + count]
  return NamedSharding(Mesh(devices, ("d",)), P("d"))


def _make(self, rows: int, cols: int):
  """Both workers: the activation on host 0's devices (a placeholder on host 1)."""
  src = _sharding(0, 4)
  if src.addressable_devices:
    x = jax.make_array_from_callback(
        (rows, cols), src, lambda idx: np.ones((rows, cols), np.float32)[idx],
        dtype=np.float32)
  else:
    x = jax.make_array_from_single_device_arrays((rows, cols), src, [], dtype=np.float32)
  self._bench_x = jax.block_until_ready(x)


def _jax_move(self, count: int):
  """Both workers: move to host 1's first ``count`` devices."""
  from autopar.runtime.transfer import move
  start = time.time()
  y = jax.block_until_ready(move(self._bench_x, _sharding(4, count)))
  ok = all(float(np.asarray(s.data).min()) == 1.0 for s in y.addressable_shards)
  return start, time.time(), ok


def _send(self):
  """Host 0: to NumPy, into the object store."""
  start = time.time()
  ref = ray.put(np.asarray(self._bench_x))
  return start, [ref]                       # (a list: the ref is not resolved here)


def _receive(self, refs):
  """Host 1: out of the object store, onto its 4 devices."""
  x = ray.get(refs[0])
  y = jax.block_until_ready(jax.device_put(x, _sharding(4, 4)))
  return time.time(), bool(float(np.asarray(y.addressable_shards[0].data).min()) == 1.0)


def main():
  autopar.init("ray", num_hosts=2, num_devices_per_host=4)
  try:
    measure(*cluster.current().workers)
  finally:
    autopar.shutdown()


def measure(w0, w1):
  print(f"{'MiB':>6} {'jax, same size':>15} {'jax, 4 -> 2':>12} {'object store':>13} "
        f"{'in one process':>15}   (ms, median of {REPEATS})")
  for mib in SIZES_MIB:
    rows, cols = 64, int(mib * 2 ** 20 / 4 / 64)
    ray.get([w.__ray_call__.remote(_make, rows, cols) for w in (w0, w1)])
    times = {"same": [], "4to2": [], "store": []}
    for _ in range(REPEATS + 1):                 # the first: warm-up
      for key, count in (("same", 4), ("4to2", 2)):
        r = ray.get([w.__ray_call__.remote(_jax_move, count) for w in (w0, w1)])
        assert all(ok for _, _, ok in r)
        times[key].append(max(e for _, e, _ in r) - min(s for s, _, _ in r))
      start, refs = ray.get(w0.__ray_call__.remote(_send))
      end, ok = ray.get(w1.__ray_call__.remote(_receive, refs))
      assert ok
      times["store"].append(end - start)
    x = jax.device_put(np.ones((rows, cols), np.float32), _sharding(0, 4))
    t = []
    for _ in range(REPEATS + 1):
      s = time.perf_counter()
      jax.block_until_ready(jax.device_put(x, _sharding(4, 4)))
      t.append(time.perf_counter() - s)
    med = {k: statistics.median(v[1:]) * 1e3 for k, v in times.items()}
    print(f"{mib:>6} {med['same']:>15.2f} {med['4to2']:>12.2f} {med['store']:>13.2f} "
          f"{statistics.median(t[1:]) * 1e3:>15.2f}")


if __name__ == "__main__":
  main()
