"""A GPT step on one GPU: autopar against a hand-written ``jax.jit`` step.

    python benchmark/gpu_step.py            # on the first GPU (issue 34's sizes)
    python benchmark/gpu_step.py --tiny     # tiny sizes, on the CPU (a test runs this)
  python benchmark/gpu_step.py --attention cudnn   # cuDNN's fused attention

docs/memory.md quotes a run on one H200 (2026-11-26).

For a 12-layer hidden-768 and a 24-layer hidden-2048 GPT in bfloat16
(sequence 1024, vocabulary 32000, batch 16 sequences, Adam), with 1 and 4
micro-batches, all with per-layer rematerialization:

* autopar: ``DataParallel(num_micro_batches=n, remat="layers")`` on a mesh
  of the one device, with each ``remat_loop``: ``"unrolled"`` (the default
  on a GPU: no loop, no conditional) and ``"scan"`` (one loop, each layer's
  weights picked by a conditional whose branch index XLA:GPU reads back to
  the host);
* by hand: one ``jax.jit`` of the same loss, each block under
  ``jax.checkpoint``, the micro-batches' gradients accumulated by
  ``lax.scan`` in float32, then the same Adam update, the state donated.

All are compiled once and timed alike in one run (median of ``--steps``
steps after two warm-ups, each step's outputs waited for), and printed side
by side: step time, autopar / hand, the temp memory XLA gives each program
(autopar's: its gradient stage's, which holds the layers' activations; the
hand step's one program also holds its float32 gradient sum there, so at
four micro-batches temp does not compare), the compile time, the last loss,
the number of conditionals in the compiled programs, and model
FLOPs utilisation (PaLM's count: 6 x
parameters + 12 x layers x hidden x sequence flops per token, over the
device's bfloat16 peak: ``--peak-tflops``, 989 for an H100 SXM). Issue 34's
goal: autopar / hand <= 1.02 at one micro-batch and <= 1.05 at four; MFU
>= 45 % at the 24-layer size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

TINY = "--tiny" in sys.argv
if TINY:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import autopar  # noqa: E402

# (name, layers, hidden, heads, sequence, vocabulary, batch)
SIZES = [("GPT 12 x 768", 12, 768, 12, 1024, 32000, 16),
         ("GPT 24 x 2048", 24, 2048, 16, 1024, 32000, 16)]
TINY_SIZES = [("tiny GPT 2 x 64", 2, 64, 4, 32, 128, 8)]


def init_params(key, layers, d, vocab, seq, dtype):
  keys = iter(jax.random.split(key, 4 * layers + 3))

  def normal(shape):
    return (jax.random.normal(next(keys), shape) * 0.02).astype(dtype)

  def norm():
    return {"scale": jnp.ones(d, dtype), "bias": jnp.zeros(d, dtype)}

  layer = lambda: {"ln1": norm(), "qkv": normal((d, 3 * d)), "out": normal((d, d)),  # noqa: E731
                   "ln2": norm(), "mlp_in": normal((d, 4 * d)),
                   "mlp_out": normal((4 * d, d))}
  return {"embed": normal((vocab, d)), "pos": normal((seq, d)),
          "layers": [layer() for _ in range(layers)], "ln_f": norm(),
          "head": normal((d, vocab))}


def layer_norm(p, x):
  x32 = x.astype(jnp.float32)
  mean = x32.mean(-1, keepdims=True)
  var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
  return ((x32 - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]).astype(x.dtype)


def block(p, x, heads, attention="naive"):
  """attention: "naive" (the scores written out, softmax in float32) or an
  implementation of ``jax.nn.dot_product_attention`` ("xla", "cudnn")."""
  b, t, d = x.shape
  qkv = (layer_norm(p["ln1"], x) @ p["qkv"]).reshape(b, t, 3, heads, d // heads)
  q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
  if attention == "naive":
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(d // heads)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
    a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1).astype(x.dtype), v)
  else:
    a = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=attention)
  x = x + a.reshape(b, t, d) @ p["out"]
  return x + jax.nn.gelu(layer_norm(p["ln2"], x) @ p["mlp_in"]) @ p["mlp_out"]


def loss_fn(params, tokens, heads, checkpoint_blocks=False, attention="naive"):
  x = params["embed"][tokens[:, :-1]] + params["pos"][: tokens.shape[1] - 1]
  run = jax.checkpoint(block, static_argnums=(2, 3)) if checkpoint_blocks else block
  for p in params["layers"]:
    x = run(p, x, heads, attention)
  logits = (layer_norm(params["ln_f"], x) @ params["head"]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def autopar_step(heads, tx, mesh, n, loop, attention="naive"):
  """``loop``: a ``remat_loop`` ("unrolled" or "scan"), or None for no remat."""
  def step(state, tokens):
    params, opt = state
    loss, grads = autopar.value_and_grad(
        lambda p: loss_fn(p, tokens, heads, attention=attention))(params)
    updates, opt = tx.update(grads, opt, params)
    return (optax.apply_updates(params, updates), opt), loss
  remat = {} if loop is None else dict(remat="layers", remat_loop=loop)
  return autopar.parallelize(step, method=autopar.DataParallel(
      mesh=mesh, num_micro_batches=n, **remat), donate_argnums=(0,))


def hand_step(heads, tx, n, attention="naive"):
  """One jax.jit: the micro-batches' gradients accumulated by lax.scan in
  float32, each block rematerialized, then the update."""
  grad_fn = jax.value_and_grad(
      lambda p, t: loss_fn(p, t, heads, checkpoint_blocks=True, attention=attention))

  def step(state, tokens):
    params, opt = state
    micro = tokens.reshape(n, tokens.shape[0] // n, *tokens.shape[1:])

    def body(acc, t):
      loss, g = grad_fn(params, t)
      return jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc, (loss, g)), None
    zeros = (jnp.zeros((), jnp.float32),
             jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
    (loss, grads), _ = jax.lax.scan(body, zeros, micro)
    grads = jax.tree.map(lambda g, p: (g / n).astype(p.dtype), grads, params)
    updates, opt = tx.update(grads, opt, params)
    return (optax.apply_updates(params, updates), opt), loss / n
  return jax.jit(step, donate_argnums=(0,))


def compiled_step(step, state, tokens):
  """(a callable step, the temp bytes XLA gives its program, the number of
  conditionals in its programs), compiling it once: a jax.jit's one program,
  or an autopar step's gradient stage (which holds the layers'
  activations)."""
  if isinstance(step, autopar.ParallelizedFunction):
    exe = step.get_executable(state, tokens)
    stages = [exe.stages[name] for name in dict.fromkeys(exe.schedule)
              if name not in ("loss_sums", "zero_grad")]   # (not passes of the model)
    return step, stages[0].memory_analysis().temp_size_in_bytes, sum(
        s.as_text().count(" conditional(") for s in stages)
  compiled = step.lower(state, tokens).compile()
  return (compiled, compiled.memory_analysis().temp_size_in_bytes,
          compiled.as_text().count(" conditional("))


def seconds_per_step(step, make_state, tokens, steps) -> tuple[float, float]:
  """(median seconds per step, the last step's loss)."""
  state = make_state()
  times = []
  for i in range(steps + 2):
    t = time.perf_counter()
    state, loss = step(state, tokens)
    jax.block_until_ready((state, loss))
    if i >= 2:
      times.append(time.perf_counter() - t)
  return statistics.median(times), float(loss)


VARIANTS = ("hand", "unrolled", "scan", "none")


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser()
  parser.add_argument("--tiny", action="store_true")
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--peak-tflops", type=float, default=989.0)
  parser.add_argument("--sizes", default=None,
                      help="comma-separated indices into the size list (default: all)")
  parser.add_argument("--micro", default="1,4", help="micro-batch counts")
  parser.add_argument("--variants", default="hand,unrolled,scan",
                      help=f"which steps, from {','.join(VARIANTS)} (none: autopar "
                           "without remat); hand is always timed first, as the ratio's base")
  parser.add_argument("--attention", default="naive",
                      help='"naive" (scores written out) or a jax.nn.dot_product_attention '
                           'implementation: "xla", "cudnn" (fused, GPU only)')
  parser.add_argument("--out", default=None, help="append each row as a JSON line here")
  args = parser.parse_args(argv)
  variants = [v for v in args.variants.split(",") if v != "hand"]
  unknown = set(variants) - set(VARIANTS)
  if unknown:
    parser.error(f"--variants: unknown {sorted(unknown)}; choose from {VARIANTS}")
  sizes = TINY_SIZES if args.tiny else SIZES
  if args.sizes is not None:
    sizes = [sizes[int(i)] for i in args.sizes.split(",")]
  device = jax.devices()[0]
  mesh = jax.make_mesh((1,), ("data",), devices=[device])
  dtype = jnp.float32 if args.tiny else jnp.bfloat16
  tx = optax.adam(1e-4)
  rows = []
  print(f"one {device.device_kind} ({device.platform}), jax {jax.__version__}, "
        f"{jnp.dtype(dtype).name}, {args.attention} attention, median of {args.steps} steps")
  print(f"{'model':<18} {'micro':>5} {'step':<16} {'ms':>9} {'ratio':>6} "
        f"{'temp MiB':>9} {'MFU':>6} {'compile s':>9} {'loss':>8} {'cond':>4}")
  for name, L, d, H, T, V, B in sizes:
    params = init_params(jax.random.PRNGKey(0), L, d, V, T, dtype)
    tokens = jax.device_put(np.random.RandomState(0).randint(0, V, (B, T + 1)).astype(
        np.int32), device)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    flops = (6 * n_params + 12 * L * d * T) * B * T
    make_state = lambda: jax.tree.map(jnp.copy, (params, tx.init(params)))  # noqa: E731
    peak = args.peak_tflops * 1e12
    for n in map(int, args.micro.split(",")):
      steps = {"hand": hand_step(H, tx, n, args.attention),
               **{("autopar no remat" if v == "none" else f"autopar {v}"):
                  autopar_step(H, tx, mesh, n, None if v == "none" else v, args.attention)
                  for v in variants}}
      row = dict(model=name, micro=n)
      for what, step in steps.items():
        t = time.perf_counter()
        step, temp, conditionals = compiled_step(step, make_state(), tokens)
        compile_s = time.perf_counter() - t
        seconds, loss = seconds_per_step(step, make_state, tokens, args.steps)
        base = row["hand"]["seconds"] if what != "hand" else seconds
        r = row[what] = dict(seconds=seconds, loss=loss, temp=temp, compile_s=compile_s,
                             conditionals=conditionals,
                             ratio=seconds / base, mfu=flops / seconds / peak)
        print(f"{name:<18} {n:>5} {what:<16} {r['seconds'] * 1e3:>9.2f} {r['ratio']:>6.3f} "
              f"{r['temp'] / 2**20:>9.1f} {r['mfu']:>6.1%} {compile_s:>9.1f} "
              f"{loss:>8.4f} {conditionals:>4}", flush=True)
        if args.out:
          with open(args.out, "a") as f:
            f.write(json.dumps(dict(model=name, micro=n, step=what, device=device.device_kind,
                                    attention=args.attention,
                                    jax=jax.__version__, **r)) + "\n")
      rows.append(row)
  return rows


if __name__ == "__main__":
  main()
