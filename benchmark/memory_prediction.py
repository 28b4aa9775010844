"""Prediction against compilation, beyond the tests: ``plan.check`` over
models, meshes, methods and micro-batch counts that
``tests/test_plan_check.py`` does not list.

    python benchmark/memory_prediction.py            # 10 models, 200 rows (~8 min)
    python benchmark/memory_prediction.py gpt64 conv_b

On 8 simulated CPU devices, each model's step is compiled under
DataParallel, ZeRO-2, ZeRO-3 and ShardParallel on meshes of 8 and 4 x 2
with one and two micro-batches, and of 4 with four. A row prints the
compiled / predicted peak memory per device and bytes sent per step, and
what ``plan.check`` finds off (over 15 % of memory, 10 % of bytes); the
last line counts the misses.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
import warnings

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

import autopar  # noqa: E402
from models import (ConvNet, ReluTransformer, ScanTransformer, Transformer,  # noqa: E402
                    image_setup, lm_setup, mlp_setup)


class ConvNet2(nn.Module):
  """GELU, a strided convolution, LayerNorm, then a flatten."""

  @nn.compact
  def __call__(self, x):
    x = nn.gelu(nn.Conv(8, (3, 3))(x))
    x = nn.relu(nn.LayerNorm()(nn.Conv(16, (3, 3), strides=2)(x)))
    x = nn.relu(nn.Conv(32, (3, 3))(x))
    return nn.Dense(10)(x.reshape(x.shape[0], -1))


MODELS = {
    # The tests' four (tests/test_plan_check.py), at meshes and counts they do not list.
    "tmlp": lambda: mlp_setup(batch=64, din=256, hidden=1024, dout=256),
    "tgpt": lambda: lm_setup(Transformer(vocab=256, d=128, heads=4, layers=2), batch=16, seq=16),
    "tscan": lambda: lm_setup(ScanTransformer(vocab=256, d=128, heads=4, layers=3),
                              batch=16, seq=16),
    "tconv": lambda: image_setup(ConvNet(), batch=32, hw=8),
    # Six others.
    "mlp3": lambda: mlp_setup(batch=128, din=128, hidden=512, dout=64, layers=3),
    "gpt64": lambda: lm_setup(Transformer(vocab=128, d=64, heads=2, layers=3), batch=32, seq=16),
    "relugpt": lambda: lm_setup(ReluTransformer(vocab=512, d=96, heads=4, layers=2),
                                batch=16, seq=32),
    "scan": lambda: lm_setup(ScanTransformer(vocab=128, d=64, heads=4, layers=4),
                             batch=32, seq=8),
    "conv_b": lambda: image_setup(ConvNet(8, 24), batch=64, hw=12),
    "conv2": lambda: image_setup(ConvNet2(), batch=32, hw=16),
}
METHODS = {"DP": autopar.DataParallel, "Z2": autopar.Zero2Parallel,
           "Z3": autopar.Zero3Parallel, "SP": autopar.ShardParallel}
# (mesh shape, axis names, micro-batch counts)
MESHES = [((8,), ("x",), (1, 2)), ((4, 2), ("data", "model"), (1, 2)), ((4,), ("x",), (4,))]


def main(names):
  warnings.filterwarnings("ignore", message="autopar: no sharding rule")
  rows = misses = 0
  for model in names:
    make_state, step, batch = MODELS[model]()
    state = make_state()
    for (shape, axes, counts), (mname, method) in itertools.product(MESHES, METHODS.items()):
      mesh = jax.make_mesh(shape, axes, devices=jax.devices()[:int(np.prod(shape))])
      for n in counts:
        t0 = time.perf_counter()
        exe = autopar.parallelize(step, method=method(mesh=mesh, num_micro_batches=n)
                                  ).get_executable(state, batch)
        result = exe.plan.check(exe)
        off = result.differences()
        rows += 1
        misses += bool(off)
        print(f"{model:8s} {mname} {str(shape):7s} n={n}: memory x{result.memory_ratio:.2f} "
              f"bytes x{result.bytes_ratio:.2f} "
              f"{'MISS ' + '; '.join(off) if off else 'ok'} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
  print(f"\n{misses} of {rows} rows off by more than 15 % of memory or 10 % of bytes")


if __name__ == "__main__":
  main(sys.argv[1:] or list(MODELS))
