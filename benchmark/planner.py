"""Planning time and problem size against depth.

    python benchmark/planner.py [layers ...]      # default: 2 12 24 48 96

Plans (``.plan()``, nothing compiled, no device touched) a GPT-style model
written in plain JAX (hidden 1024, 16 heads, MLP 4096, vocab 1024, 128
tokens, batch 64, Adam; the layers a Python loop) for
an abstract 8x8 mesh ("data", "model"), with the plan cache off, and prints
per depth: equations in compute_grad + apply_grad, ILP nodes after merging
elementwise equations, node classes after sharing repeated layers, the chosen
problem's variables and constraints, and the planning time by stage (summed
over the batch-axes choices tried: trace at each per-device batch size,
strategy enumeration, layer classes, ILP construction, solve; a solve runs
on a thread while the next problem is built, so stage times overlap) and in
total, measured from the call to ``.plan()``: wall-clock seconds, and the
process's CPU seconds (all threads), beside JAX's own ``jax.make_jaxpr`` of
the step timed in a fresh process just before, and the ratio of the two:
this machine's speed varies with its host's load, the ratio less. Each
depth is planned in a fresh process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402

import autopar  # noqa: E402


def init_params(layers, d, heads, vocab, seq):
  """A GPT-style model's parameters (shapes only: nothing is allocated)."""
  f32 = jnp.float32
  def layer():
    return {"ln1": {"scale": (d,), "bias": (d,)},
            "qkv": (d, 3 * d), "out": (d, d),
            "ln2": {"scale": (d,), "bias": (d,)},
            "mlp_in": {"kernel": (d, 4 * d), "bias": (4 * d,)},
            "mlp_out": {"kernel": (4 * d, d), "bias": (d,)}}
  shapes = {"embed": (vocab, d), "pos": (seq, d),
            "layers": [layer() for _ in range(layers)],
            "ln_f": {"scale": (d,), "bias": (d,)}, "head": (d, vocab)}
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, f32), shapes,
                      is_leaf=lambda x: isinstance(x, tuple))


def layer_norm(p, x):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def block(p, x, heads):
  b, t, d = x.shape
  qkv = (layer_norm(p["ln1"], x) @ p["qkv"]).reshape(b, t, 3, heads, d // heads)
  q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // heads).astype(x.dtype)
  s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
  a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v).reshape(b, t, d)
  x = x + a @ p["out"]
  h = jax.nn.gelu(layer_norm(p["ln2"], x) @ p["mlp_in"]["kernel"] + p["mlp_in"]["bias"])
  return x + h @ p["mlp_out"]["kernel"] + p["mlp_out"]["bias"]


def make_apply(heads):
  def apply(params, tokens):
    x = params["embed"][tokens] + params["pos"][: tokens.shape[1]]
    for p in params["layers"]:          # a Python loop: one block per layer
      x = block(p, x, heads)
    return layer_norm(params["ln_f"], x) @ params["head"]
  return apply


def lm_step(state, batch):
  def loss_fn(p):
    logits = state.apply_fn(p, batch["tokens"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["tokens"][:, 1:]).mean()
  loss, grads = autopar.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), loss


def abstract_args(layers: int, d=1024, heads=16, vocab=1024, seq=128, batch=64):
  params = init_params(layers, d, heads, vocab, seq)
  state = jax.eval_shape(lambda p: train_state.TrainState.create(
      apply_fn=make_apply(heads), params=p, tx=optax.adam(1e-3)), params)
  return state, {"tokens": jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)}


COLUMNS = ("layers", "eqns", "nodes", "classes", "vars", "constr", "trace s",
           "strat s", "classes s", "build s", "solve s", "total s", "cpu s",
           "jaxpr s", "ratio")


def plan_one(layers: int) -> tuple:
  """Plans the ``layers``-deep model; its row of the table."""
  mesh = jax.sharding.AbstractMesh((8, 8), ("data", "model"))
  option = autopar.AutoShardingOption(plan_cache=False, verbose=False)
  args = abstract_args(layers)
  step = autopar.parallelize(lm_step, method=autopar.ShardParallel(mesh=mesh,
                                                                    option=option))
  t0, c0 = time.perf_counter(), time.process_time()
  plan = step.plan(*args)
  total, cpu = time.perf_counter() - t0, time.process_time() - c0
  s, t = plan.solver, plan.solver.timings
  return (layers, s.num_equations, s.num_nodes, s.num_classes, s.num_variables,
          s.num_constraints, t.get("trace", 0), t.get("strategies", 0),
          t.get("classes", 0), t.get("build", 0), t.get("solve", 0), total, cpu,
          list(plan.batch_axes))


def make_jaxpr_one(layers: int) -> float:
  """Seconds JAX's own ``jax.make_jaxpr`` takes to trace the step (as a user
  would call it: concrete batch size, garbage collector on)."""
  args = abstract_args(layers)
  t0 = time.perf_counter()
  jax.make_jaxpr(lm_step)(*args)
  return time.perf_counter() - t0


def run_fresh(*argv) -> object:
  out = subprocess.run([sys.executable, __file__, *argv], check=True,
                       capture_output=True, text=True).stdout
  return json.loads(out.strip().splitlines()[-1])


def main(depths):
  # Each depth is planned in a fresh process, as a script planning its one
  # model would be: in one long process the later (larger) models are traced
  # on a heap that holds the earlier ones, which slows JAX's tracing by a
  # third or more.
  #
  # "jaxpr s" is JAX's make_jaxpr of the same step alone, in a fresh process
  # run just before: the machine's speed varies (other machines share its
  # host), and "ratio" (total / jaxpr) varies less.
  print(" ".join(f"{c:>9}" for c in COLUMNS))
  rows = []
  for layers in depths:
    trace = run_fresh("--trace", str(layers))
    *row, batch_axes = run_fresh("--one", str(layers))
    row += [trace, row[COLUMNS.index("total s")] / trace]
    rows.append(dict(zip(COLUMNS, row)))
    print(" ".join(f"{v:>9}" if isinstance(v, int) else f"{v:>9.2f}" for v in row),
          flush=True)
  if len(rows) > 1:
    first, last = rows[0], rows[-1]
    print(f"\nplanning time x{last['total s'] / first['total s']:.1f} for "
          f"x{last['layers'] / first['layers']:.0f} layers; batch axes chosen: "
          f"{tuple(batch_axes)}")


if __name__ == "__main__":
  if sys.argv[1:2] == ["--one"]:
    print(json.dumps(plan_one(int(sys.argv[2]))))
  elif sys.argv[1:2] == ["--trace"]:
    print(json.dumps(make_jaxpr_one(int(sys.argv[2]))))
  else:
    main([int(a) for a in sys.argv[1:]] or [2, 12, 24, 48, 96])
