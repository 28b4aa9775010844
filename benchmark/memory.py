"""Memory and step time of remat="layers" and the chunked loss, side by side.

    python benchmark/memory.py                 # 12 layers, hidden 768, seq 1024, vocab 32k
    python benchmark/memory.py --layers 4 --seq 256 --vocab 8192   # a quick smoke test
                                     # (so small that weights, not activations, dominate:
                                     # its ratios say little)
    python benchmark/memory.py --gpu           # one GPU: adds tokens/s, MFU, largest batch

A GPT-style model in plain JAX (the layers a Python loop, as users write
them), trained with Adam under ``DataParallel`` on all devices (8 simulated
CPU devices by default), in five configurations: plain, ``remat="layers"``,
the chunked loss (``autopar.nn.chunked_cross_entropy``), both, and remat
with a ``jax.checkpoint`` policy that saves the matmul outputs. For each
it prints the per-device temp memory of the gradient stage
(``memory_analysis()``) and the measured step time, as ratios against the
plain step measured in the same run.

Two rows isolate what each technique targets, also from ``memory_analysis()``:

* activation memory: how much the gradient stage's temp memory grows per
  extra sequence per device (two sequences per device against one), plain
  against ``remat="layers"``: the memory that scales with the batch, without
  the fixed cost of weights and gradients;
* logits memory: the loss head alone (hidden states and unembedding to the
  loss and its gradients), ``optax`` on the full logits against the chunked
  loss, as raw temp memory and without the chunked backward's float32
  accumulator of the unembedding's gradient (which the plain head writes to
  its output instead).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

_ARGS = argparse.ArgumentParser(description=__doc__.split("\n")[0])
_ARGS.add_argument("--layers", type=int, default=12)
_ARGS.add_argument("--hidden", type=int, default=768)
_ARGS.add_argument("--heads", type=int, default=12)
_ARGS.add_argument("--seq", type=int, default=1024)
_ARGS.add_argument("--vocab", type=int, default=32768)
_ARGS.add_argument("--batch", type=int, default=None,
                   help="sequences per step (default: one per device)")
_ARGS.add_argument("--chunk", type=int, default=128,
                   help="chunked-loss chunk size (tokens per device must exceed it)")
_ARGS.add_argument("--steps", type=int, default=2,
                   help="timed steps per configuration (0: memory only, nothing runs)")
_ARGS.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
_ARGS.add_argument("--gpu", action="store_true",
                   help="run on the GPU; also report tokens/s, MFU and the largest batch")
_ARGS.add_argument("--dtype", default=None, help="float32 or bfloat16 (GPU default)")
_ARGS.add_argument("--max-batch", type=int, default=256,
                   help="largest batch the GPU search tries")
_ARGS.add_argument("--only", default=None,
                   help="comma-separated parts to run: steps, isolated, gpu (default: all)")
OPTS = _ARGS.parse_args()

if not OPTS.gpu:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={OPTS.devices}")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402

import autopar  # noqa: E402

DTYPE = jnp.dtype(OPTS.dtype or ("bfloat16" if OPTS.gpu else "float32"))


# -- the model -------------------------------------------------------------------

def init_params(key, layers, d, vocab, seq):
  keys = iter(jax.random.split(key, 4 * layers + 3))
  normal = lambda shape, scale=0.02: (jax.random.normal(next(keys), shape) * scale
                                      ).astype(DTYPE)
  def layer():
    return {"ln1": {"scale": jnp.ones(d, DTYPE), "bias": jnp.zeros(d, DTYPE)},
            "qkv": normal((d, 3 * d)), "out": normal((d, d)),
            "ln2": {"scale": jnp.ones(d, DTYPE), "bias": jnp.zeros(d, DTYPE)},
            "mlp_in": normal((d, 4 * d)), "mlp_out": normal((4 * d, d))}
  return {"embed": normal((vocab, d)), "pos": normal((seq, d)),
          "layers": [layer() for _ in range(layers)],
          "ln_f": {"scale": jnp.ones(d, DTYPE), "bias": jnp.zeros(d, DTYPE)},
          "head": normal((d, vocab))}


def layer_norm(p, x):
  x32 = x.astype(jnp.float32)
  mean = x32.mean(-1, keepdims=True)
  var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
  y = (x32 - mean) * jax.lax.rsqrt(var + 1e-5)
  return (y * p["scale"] + p["bias"]).astype(x.dtype)


def block(p, x, heads):
  b, t, d = x.shape
  qkv = (layer_norm(p["ln1"], x) @ p["qkv"]).reshape(b, t, 3, heads, d // heads)
  q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(d // heads)
  s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
  a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1).astype(x.dtype), v)
  x = x + a.reshape(b, t, d) @ p["out"]
  h = jax.nn.gelu(layer_norm(p["ln2"], x) @ p["mlp_in"])
  return x + h @ p["mlp_out"]


def hidden_states(params, tokens, heads):
  x = params["embed"][tokens] + params["pos"][: tokens.shape[1]]
  for p in params["layers"]:          # a Python loop: one block per layer
    x = block(p, x, heads)
  return layer_norm(params["ln_f"], x)


def lm_loss(params, tokens, heads, chunked, chunk):
  h = hidden_states(params, tokens[:, :-1], heads)
  labels = tokens[:, 1:]
  if chunked:
    return autopar.nn.chunked_cross_entropy(h, params["head"], labels, chunk_size=chunk)
  logits = (h @ params["head"]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def make_step(loss_fn):
  def step(state, batch):
    loss, grads = autopar.value_and_grad(loss_fn)(state.params, batch["tokens"])
    return state.apply_gradients(grads=grads), loss
  return step


# The configurations compared: (name, the method's remat, chunked loss). The
# policy saves the layers' matmul outputs: more memory than "layers", less
# recomputation; like "layers" it reads the weights in place.
CONFIGS = [("plain", "none", False), ('remat="layers"', "layers", False),
           ("chunked loss", "none", True), ("both", "layers", True),
           ("remat dots policy", jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
            False)]


# -- measuring -------------------------------------------------------------------

def temp_bytes(exe) -> int:
  return exe.stages[exe.schedule[0]].memory_analysis().temp_size_in_bytes


def measure(step, make_state, batch, mesh, remat, steps):
  """(per-device temp bytes of the gradient stage, seconds per step)."""
  # (The gradient stage's own temp memory: the stages apart.)
  p = autopar.parallelize(step, method=autopar.DataParallel(mesh=mesh, remat=remat,
                                                            one_executable=False),
                          donate_argnums=(0,))
  state = make_state()
  exe = p.get_executable(state, batch)
  if not steps:                             # memory only: nothing runs
    return temp_bytes(exe), float("nan"), float("nan")
  state, loss = p(state, batch)             # the first step
  jax.block_until_ready(loss)
  t0 = time.perf_counter()
  for _ in range(steps):
    state, loss = p(state, batch)
  jax.block_until_ready((state, loss))
  return temp_bytes(exe), (time.perf_counter() - t0) / steps, float(loss)


def gib(b):
  return f"{b / 2**30:8.3f}"


def main():
  devices = jax.devices()
  mesh = jax.make_mesh((len(devices),), ("data",))
  L, d, H, T, V = OPTS.layers, OPTS.hidden, OPTS.heads, OPTS.seq, OPTS.vocab
  B = OPTS.batch or len(devices)
  params = init_params(jax.random.PRNGKey(0), L, d, V, T)
  tokens = np.random.RandomState(0).randint(0, V, (B, T + 1)).astype(np.int32)
  batch = {"tokens": tokens}
  tx = optax.adam(1e-4)
  make_state = lambda: train_state.TrainState.create(   # fresh buffers: steps donate
      apply_fn=None, params=jax.tree.map(jnp.copy, params), tx=tx)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  print(f"GPT {L} layers, hidden {d}, {H} heads, seq {T}, vocab {V}, batch {B}, "
        f"{n_params / 1e6:.1f}M parameters, {DTYPE.name}, DataParallel on "
        f"{len(devices)} {devices[0].platform} device(s)\n", flush=True)

  parts = set((OPTS.only or "steps,isolated,gpu").split(","))
  if "steps" in parts:
    whole_steps(make_state, batch, mesh, H)
  if "isolated" in parts:
    isolated(make_state, mesh, devices, B, d, T, V, H)
  if OPTS.gpu and "gpu" in parts:
    gpu_figures(make_state, mesh, n_params, L, d, T, V, H, tx)


def whole_steps(make_state, batch, mesh, H):
  # The configurations of the whole step.
  print(f"{'configuration':<18} {'temp GiB/dev':>12} {'x plain':>8} {'step s':>8} "
        f"{'x plain':>8} {'loss':>9}")
  rows = {}
  for name, remat, chunked in CONFIGS:
    step = make_step(lambda p, t, c=chunked: lm_loss(p, t, H, c, OPTS.chunk))
    temp, secs, loss = measure(step, make_state, batch, mesh, remat, OPTS.steps)
    rows[name] = (temp, secs)
    t0, s0 = rows["plain"]
    print(f"{name:<18} {gib(temp):>12} {temp / t0:8.3f} {secs:8.3f} {secs / s0:8.3f} "
          f"{loss:9.4f}", flush=True)

  worst = max(rows[n][1] / rows["plain"][1] for n in rows)
  print(f"slowest configuration: x{worst:.2f} the plain step time (target <= 1.4)")


def isolated(make_state, mesh, devices, B, d, T, V, H):
  # What each technique targets, in isolation.
  # Activation memory is the memory that grows with the batch: the gradient
  # stage's temp at two sequences per device minus at one (the plain loss).
  def step_temp(remat, rows):
    n = rows * len(devices)
    toks = np.zeros((n, T + 1), np.int32)
    step = make_step(lambda p, t: lm_loss(p, t, H, False, OPTS.chunk))
    # (The stages apart, as docs/memory.md's figures were measured.)
    p = autopar.parallelize(step, method=autopar.DataParallel(mesh=mesh, remat=remat,
                                                              one_executable=False))
    return temp_bytes(p.get_executable(make_state(), {"tokens": toks}))
  act = {r: step_temp(r, 2) - step_temp(r, 1) for r in ("none", "layers")}

  # Logits memory: the loss head alone (hidden states and unembedding to the
  # loss and both gradients) at one device's tokens.
  tokens_dev = (B // len(devices)) * T
  w = jax.ShapeDtypeStruct((d, V), DTYPE)
  def head_temp(chunked, tokens=tokens_dev):
    h = jax.ShapeDtypeStruct((tokens, d), DTYPE)
    labels = jnp.zeros((tokens,), jnp.int32)
    def f(h, w):
      if chunked:
        return autopar.nn.chunked_cross_entropy(h, w, labels, chunk_size=OPTS.chunk)
      logits = (h @ w).astype(jnp.float32)
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    c = jax.jit(jax.value_and_grad(f, argnums=(0, 1))).lower(h, w).compile()
    return c.memory_analysis().temp_size_in_bytes
  full, chunk = head_temp(False), head_temp(True)
  # Growth with the token count: what each further `tokens_dev` tokens cost.
  grow = {c: head_temp(c, 2 * tokens_dev) - head_temp(c) for c in (False, True)}
  # The chunked backward sums the unembedding's gradient over chunks in a
  # float32 loop carry, which XLA keeps in temp memory; the plain head writes
  # that gradient straight to its output. It is not logits memory.
  dw_carry = d * V * 4

  print(f"\nactivation memory (temp growth per extra sequence per device, GiB): plain "
        f"{gib(act['none'])}, remat=\"layers\" {gib(act['layers'])}: "
        f"{act['none'] / act['layers']:.1f}x lower (target >= 4x)")
  print(f"loss head alone, {tokens_dev} tokens per device (temp GiB): full logits "
        f"{gib(full)}, chunked ({OPTS.chunk}) {gib(chunk)}: {full / chunk:.1f}x lower")
  print(f"logits memory (loss head temp less the chunked loop's {gib(dw_carry).strip()} GiB "
        f"float32 unembedding-gradient carry): {gib(full)} against {gib(chunk - dw_carry)}: "
        f"{full / max(chunk - dw_carry, 1):.1f}x lower (target >= 10x)")
  print(f"loss head temp growth per further {tokens_dev} tokens: full logits "
        f"{grow[False] / 2**20:.1f} MiB, chunked {grow[True] / 2**10:.1f} KiB")


def gpu_figures(make_state, mesh, n_params, L, d, T, V, H, tx):
  """Tokens/s and model FLOPs utilisation per configuration, at batch 8 and at
  the largest batch that fits (doubling from 8 until compilation or the step
  runs out of memory, or --max-batch)."""
  peak = float(os.environ.get("PEAK_TFLOPS", "989")) * 1e12    # H100 SXM dense bf16
  flops_per_token = 6 * n_params + 12 * L * d * T                # PaLM's MFU formula
  print(f"\n{'configuration':<16} {'tokens/s @8':>12} {'MFU @8':>7} {'largest batch':>14} "
        f"{'tokens/s':>10} {'MFU':>6}")
  for name, remat, chunked in CONFIGS:
    step = make_step(lambda p, t, c=chunked: lm_loss(p, t, H, c, OPTS.chunk))
    tps, b = {}, OPTS.batch or 8
    while b <= OPTS.max_batch:
      tokens = np.random.RandomState(0).randint(0, V, (b, T + 1)).astype(np.int32)
      try:
        _, secs, _ = measure(step, make_state, {"tokens": tokens}, mesh, remat, 3)
      except Exception as e:  # noqa: BLE001 - out of memory ends the search
        if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
          raise
        break
      tps[b] = b * T / secs
      b *= 2
    if not tps:
      print(f"{name:<16} does not fit at batch {OPTS.batch or 8}")
      continue
    first, last = min(tps), max(tps)
    mfu = lambda t: t * flops_per_token / peak
    print(f"{name:<16} {tps[first]:12.0f} {mfu(tps[first]):7.1%} {last:>14} "
          f"{tps[last]:10.0f} {mfu(tps[last]):6.1%}", flush=True)


if __name__ == "__main__":
  main()
