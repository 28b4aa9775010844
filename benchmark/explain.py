"""Time of ``plan.explain`` and ``plan.cost_if`` once the step is gone.

    python benchmark/explain.py

Plans the 24-layer GPT of ``tests/test_plan_reading.py`` (d=64, batch 64,
Adam) for an abstract 8 x 8 mesh with the plan cache off, drops the step,
and prints the seconds of planning, of one ``explain`` of a block's MLP
kernel and of one ``cost_if`` pinning it to another candidate: the plan
re-solves its kept ILP per candidate spec (issue 32's goal: explain in at
most 5 s on this machine).
"""

from __future__ import annotations

import gc
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import jax  # noqa: E402
import optax  # noqa: E402

import autopar  # noqa: E402
from autopar.text import same_spec  # noqa: E402
from models import transformer_setup  # noqa: E402


def main() -> None:
  make_state, step, batch = transformer_setup(tx=optax.adam(1e-3), layers=24, batch=64, d=64)
  mesh = jax.sharding.AbstractMesh((8, 8), ("data", "model"))
  option = autopar.AutoShardingOption(plan_cache=False)
  t0 = time.perf_counter()
  pf = autopar.parallelize(step, method=autopar.ShardParallel(mesh=mesh, option=option))
  plan = pf.plan(jax.eval_shape(make_state), batch)
  planned = time.perf_counter() - t0
  del pf
  gc.collect()
  leaf = "state.params['params']['Block_5']['Dense_0']['kernel']"
  t0 = time.perf_counter()
  e = plan.explain(leaf)
  explained = time.perf_counter() - t0
  other = next(c for c in e.candidates
               if c.objective is not None and not same_spec(c.spec, e.chosen))
  t0 = time.perf_counter()
  plan.cost_if({leaf: other.spec})
  pinned = time.perf_counter() - t0
  print(f"24-layer GPT, abstract 8x8 mesh: plan {planned:.2f} s, explain {explained:.2f} s "
        f"({sum(c.objective is not None for c in e.candidates)} candidates solved), "
        f"cost_if {pinned:.2f} s")


if __name__ == "__main__":
  main()
