"""benchmark/gpu_step.py's GPT with cuDNN's fused attention
(``jax.nn.dot_product_attention(implementation="cudnn")``, a
``custom_partitioning`` op under a ``jax.custom_vjp``) in a pipeline
(issue 45): on one GPU.

    python benchmark/gpu_pipeline.py            # on the first GPU
    python benchmark/gpu_pipeline.py --cpu      # implementation="xla" on 8 CPU devices

A GPT (4 layers, hidden 256, 4 heads, sequence 128, bfloat16, SGD), one
step from the same parameters:

1. ``jax.jit`` of the step on the device (the reference);
2. ``ShardParallel`` on a mesh of the one device, the step run;
3. ``PipeshardParallel(num_stages=2)`` on an abstract mesh of two such
   devices: the step planned (traced at concrete sizes, which keeps the
   attention's ``custom_vjp``; each stage's ILP solved), its stage table
   printed; with ``--cpu`` (8 CPU devices, the "xla" attention, which
   ``custom_partitioning`` does not wrap) the 2-stage pipeline also runs.

Printed: each run's loss and its largest parameter difference from jit's,
over the largest parameter change (bfloat16: a few units of 2^-8).

Run 2026-11-28 on one H100 (jax 0.11.2, cuDNN attention): jit's loss
6.987787; ShardParallel on the one device 6.987787, its parameters within
0.024 of the largest change of jit's; the 2-stage pipeline planned on two
abstract devices (layers 0-2 and 3-4; modelled 16.5 ms per step). With one
GPU the two stages cannot run: on 8 CPU devices (``--cpu``, the "xla"
attention) the 2-stage pipeline's parameters are within 0.057 of the
largest change of jit's.
"""

from __future__ import annotations

import os
import sys

CPU = "--cpu" in sys.argv
if CPU:
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import warnings  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import autopar  # noqa: E402
from gpu_step import init_params, loss_fn  # noqa: E402

LAYERS, D, HEADS, SEQ, VOCAB, BATCH = 4, 256, 4, 128, 1024, 8
TX = optax.sgd(0.5)


def main():
  attention = "xla" if CPU else "cudnn"

  def step(params, tokens):
    loss, grads = autopar.value_and_grad(
        lambda p: loss_fn(p, tokens, HEADS, attention=attention))(params)
    return optax.apply_updates(params, TX.update(grads, TX.init(params))[0]), loss

  params = init_params(jax.random.PRNGKey(0), LAYERS, D, VOCAB, SEQ, jnp.bfloat16)
  tokens = np.random.RandomState(0).randint(0, VOCAB, (BATCH, SEQ + 1)).astype(np.int32)
  ref, ref_loss = jax.jit(step)(params, tokens)
  change = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
               for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(params)))
  print(f"device: {jax.devices()[0].device_kind}, attention={attention!r}")
  print(f"jax.jit: loss {float(ref_loss):.6f}; largest parameter change {change:.3g}")

  def report(name, got, loss):
    diff = max(float(jnp.max(jnp.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))
               for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)))
    print(f"{name}: loss {float(loss):.6f}; largest difference from jit "
          f"{diff:.3g} ({diff / change:.3f} of the largest change)")

  devices = jax.devices()
  one = jax.sharding.Mesh(np.array(devices[:1]), ("data",))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pf = autopar.parallelize(step, method=autopar.ShardParallel(mesh=one),
                             donate_argnums=())
    report("ShardParallel, 1 device", *pf(params, tokens))
    if CPU:
      mesh = jax.make_mesh((2, 4), ("data", "model"))
      pf = autopar.parallelize(step, method=autopar.PipeshardParallel(
          mesh=mesh, num_stages=2, num_micro_batches=2), donate_argnums=())
      report("PipeshardParallel, 2 stages of 2 x 4 CPU devices", *pf(params, tokens))
    else:
      mesh = jax.sharding.AbstractMesh((2,), ("data",))
      pf = autopar.parallelize(step, method=autopar.PipeshardParallel(
          mesh=mesh, num_stages=2, num_micro_batches=2), donate_argnums=())
      print("PipeshardParallel, 2 stages on an abstract mesh of 2 devices: planned")
    print("\n".join(plan_lines(pf, params, tokens)))


def plan_lines(pf, params, tokens):
  plan = pf.plan(params, tokens)
  return plan.summary().splitlines()[:8]


if __name__ == "__main__":
  main()
