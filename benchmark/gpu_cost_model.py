"""The cost model on a real GPU: predicted, compiled and measured step time.

    python benchmark/gpu_cost_model.py

On the first GPU (a mesh of one device: no collectives, so this checks the
compute side of the model), for an MLP and a GPT with float32 and with
bfloat16 parameters, and a scanned GPT: plans ShardParallel with the device
kind read from the GPU, compiles, and prints per model

* the plan's predicted time per step (``Plan.predicted_time``: flops,
  memory traffic, the roofline and the total);
* ``plan.check``'s roofline of the compiled stages (flops and bytes from
  ``hlo.module_cost``) with the same constants;
* the measured step time (median of 20 steps after 3 warm-ups);
* the compiled peak memory against the plan's.

The model's rates are the device kind's datasheet peaks (``devices.py``);
the measured time includes what no roofline holds (kernel launches, the
host's dispatch of the stages).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import autopar  # noqa: E402


def mlp(width, depth, batch, dtype):
  keys = jax.random.split(jax.random.PRNGKey(0), depth)
  params = [{"w": (jax.random.normal(k, (width, width)) / width ** 0.5).astype(dtype),
             "b": jnp.zeros((width,), dtype)} for k in keys]

  def loss(p, batch):
    x = batch["x"]
    for layer in p:
      x = jax.nn.gelu(x @ layer["w"] + layer["b"])
    return jnp.mean((x.astype(jnp.float32) - batch["y"]) ** 2)
  data = {"x": jnp.ones((batch, width), dtype), "y": jnp.zeros((batch, width))}
  return params, loss, data


def gpt(d, layers, seq, batch, vocab, dtype, scanned=False):
  k = jax.random.split(jax.random.PRNGKey(0), 6)
  def w(key, shape):
    return (jax.random.normal(key, shape) / shape[-2] ** 0.5).astype(dtype)
  block = {"qkv": w(k[0], (layers, d, 3 * d)), "out": w(k[1], (layers, d, d)),
           "up": w(k[2], (layers, d, 4 * d)), "down": w(k[3], (layers, 4 * d, d))}
  params = {"embed": w(k[4], (vocab, d)), "head": w(k[5], (d, vocab)), "blocks": block}
  heads = d // 64

  def layer(x, p):
    b, t, _ = x.shape
    h = x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
    q, kk, v = jnp.split(h @ p["qkv"], 3, -1)
    q, kk, v = (a.reshape(b, t, heads, 64) for a in (q, kk, v))
    att = jnp.einsum("bthd,bshd->bhts", q, kk) / 8.0
    att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
    o = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(att, -1), v).reshape(b, t, d)
    x = x + o @ p["out"]
    h = x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
    return x + jax.nn.gelu(h @ p["up"]) @ p["down"]

  def loss(p, batch):
    x = p["embed"][batch["tokens"][:, :-1]]
    if scanned:
      x = jax.lax.scan(lambda c, lp: (layer(c, lp), None), x, p["blocks"])[0]
    else:
      for i in range(layers):
        x = layer(x, jax.tree.map(lambda a: a[i], p["blocks"]))
    logits = (x @ p["head"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["tokens"][:, 1:]).mean()
  data = {"tokens": jax.random.randint(k[0], (batch, seq + 1), 0, vocab)}
  return params, loss, data


def step_of(loss, tx):
  def step(state, batch):
    params, opt = state
    value, grads = autopar.value_and_grad(loss)(params, batch)
    updates, opt = tx.update(grads, opt, params)
    return (optax.apply_updates(params, updates), opt), value
  return step


def run(name, params, loss, data):
  tx = optax.adam(1e-4)
  state = (params, tx.init(params))
  mesh = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])
  option = autopar.AutoShardingOption(plan_cache=False)
  pf = autopar.parallelize(step_of(loss, tx), method=autopar.ShardParallel(
      mesh=mesh, option=option), donate_argnums=(0,))
  exe = pf.get_executable(state, data)
  plan, result = exe.plan, exe.plan.check(exe)
  # GPU_COST_MODEL_HLO=folder GPU_COST_MODEL_HLO_CASE=text: each stage's HLO
  # of the cases whose name holds the text, written there.
  dump = os.environ.get("GPU_COST_MODEL_HLO")
  if dump and os.environ.get("GPU_COST_MODEL_HLO_CASE", "") in name:
    for stage, compiled in exe.stages.items():
      with open(os.path.join(dump, f"{name.split(',')[0].replace(' ', '_')}"
                             f"_{stage}.txt"), "w") as f:
        f.write(compiled.as_text())
  for _ in range(3):
    state, value = pf(state, data)
  jax.block_until_ready(state)
  times = []
  for _ in range(20):
    t0 = time.perf_counter()
    state, value = pf(state, data)
    jax.block_until_ready(state)
    times.append(time.perf_counter() - t0)
  measured = statistics.median(times)
  t = plan.predicted_time
  pred = {k: sum(t[s][k] for s in t) for k in ("flops", "memory", "total")}
  print(f"{name:<34} predicted {pred['total'] * 1e3:8.3f} ms (flops {pred['flops'] * 1e3:.3f}, "
        f"memory {pred['memory'] * 1e3:.3f}) | compiled roofline "
        f"{result.compiled_time * 1e3:8.3f} ms (x{result.time_ratio:.2f}) | measured "
        f"{measured * 1e3:8.3f} ms (x{measured / pred['total']:.2f} of predicted) | "
        f"memory compiled/predicted x{result.memory_ratio:.2f} | loss {float(value):.4f}",
        flush=True)


def main():
  warnings.filterwarnings("ignore", message="autopar: no sharding rule")
  dev = jax.devices()[0]
  print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}", flush=True)
  cases = [
      ("MLP 4096 x 4, batch 4096, f32", mlp(4096, 4, 4096, jnp.float32)),
      ("MLP 4096 x 4, batch 4096, bf16", mlp(4096, 4, 4096, jnp.bfloat16)),
      ("GPT d=1024 x 8, 8 x 1024, f32", gpt(1024, 8, 1024, 8, 8192, jnp.float32)),
      ("GPT d=1024 x 8, 8 x 1024, bf16", gpt(1024, 8, 1024, 8, 8192, jnp.bfloat16)),
      ("scanned GPT d=1024 x 8, bf16", gpt(1024, 8, 1024, 8, 8192, jnp.bfloat16, True)),
  ]
  only = sys.argv[1:]
  for name, (params, loss, data) in cases:
    if not only or any(o in name for o in only):
      try:
        run(name, params, loss, data)
      except Exception as e:       # one case's failure must not hide the others'
        print(f"{name:<34} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
  main()
