"""Planning within a memory budget, measured: ``memory_budget_per_device`` at
fractions of ShardParallel's own plan's compiled peak, the plan that comes
back (the ILP's, or ZeRO's layout taken for the budget, under
``remat="layers"`` where nothing fits without it) and what its compiled
step holds, or the ``PlanError`` and the smallest compiled peak it
names.

    python benchmark/memory_budget.py                 # every case (~6 min)
    python benchmark/memory_budget.py mlp_4 gpt_4     # some of them

The cases: the MLP of issue 44 (4 Dense layers of 256, 512 rows, Adam,
float32; ``tests/test_memory.py``) on 4 devices and on 2 x 2, the same MLP
in bfloat16, and a GPT (2 layers of hidden 64, 16 x 16 tokens) on 4 and on
2 x 2. Simulated CPU devices; the plan cache off. Prints one markdown table
per case: budget, result, compiled peak, compiled / predicted, seconds
(planning and compiling).
"""

from __future__ import annotations

import os
import re
import sys
import time
import warnings

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import autopar  # noqa: E402
from models import Transformer, lm_setup, mlp_setup  # noqa: E402

FRACTIONS = (0.60, 0.75, 0.85, 0.93, 0.95)


def mlp(dtype=jnp.float32):
  make_state, step, batch = mlp_setup(batch=512, din=256, hidden=256, dout=256, layers=4)
  state = make_state()
  if dtype != jnp.float32:
    state = jax.tree.map(lambda x: x.astype(dtype) if hasattr(x, "dtype") and
                         jnp.issubdtype(x.dtype, jnp.floating) else x, state)
  return step, state, batch


def gpt():
  make_state, step, batch = lm_setup(Transformer(vocab=256, d=64, heads=4, layers=2),
                                     batch=16, seq=16)
  return step, make_state(), batch


CASES = {
    "mlp_4": (mlp, (4,), ("x",)),
    "mlp_2x2": (mlp, (2, 2), ("data", "model")),
    "mlp_bf16_4": (lambda: mlp(jnp.bfloat16), (4,), ("x",)),
    "gpt_4": (gpt, (4,), ("x",)),
    "gpt_2x2": (gpt, (2, 2), ("data", "model")),
}


def compiled(step, state, batch, method):
  exe = autopar.parallelize(step, method=method).get_executable(state, batch)
  return exe, exe.plan.check(exe)


def run(name: str) -> None:
  make, shape, axes = CASES[name]
  step, state, batch = make()
  mesh = jax.make_mesh(shape, axes, devices=jax.devices()[:4])
  shard = lambda budget=None: autopar.ShardParallel(mesh=mesh, option=(
      autopar.AutoShardingOption(memory_budget_per_device=budget, plan_cache=False)))
  _, own = compiled(step, state, batch, shard())
  _, zero3 = compiled(step, state, batch, autopar.Zero3Parallel(mesh=mesh))
  print(f"\n{name}: ShardParallel's own plan {own.compiled_memory:,} B, "
        f"Zero3Parallel {zero3.compiled_memory:,} B")
  print("| budget | result | compiled | compiled / predicted | seconds |")
  print("|---|---|---|---|---|")
  for f in FRACTIONS:
    budget = int(f * own.compiled_memory)
    t0 = time.perf_counter()
    try:
      with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exe, r = compiled(step, state, batch, shard(budget))
      if exe.plan.solver is None:          # (the ILP found none: no solver line)
        what = "a ZeRO layout (the ILP's model finds none)"
      else:
        m = re.search(r"(Zero\dParallel's layout[^;]*?) taken", exe.plan.solver.status)
        what = m.group(1) if m else "the ILP's plan"
      if any("remat=" in str(w.message) for w in caught) and "remat=" not in what:
        what += " with remat='layers'"
      row = (what, f"{r.compiled_memory:,}", f"x{r.memory_ratio:.2f}")
      assert r.compiled_memory <= budget
    except autopar.PlanError as e:
      smallest = re.search(r"smallest is (\d+)", str(e))
      row = ("PlanError" + (f": smallest compiled {int(smallest.group(1)):,}"
                            if smallest else ": the model finds none"), "", "")
    print(f"| {f:.2f} ({budget:,}) | {' | '.join(row)} | "
          f"{time.perf_counter() - t0:.1f} |", flush=True)


def main(argv):
  warnings.simplefilter("ignore")
  print(f"jax {jax.__version__}, {jax.devices()[0].platform}, "
        f"{time.strftime('%Y-%m-%d')}")
  for name in argv or CASES:
    run(name)


if __name__ == "__main__":
  main(sys.argv[1:])
