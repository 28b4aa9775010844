"""Planning time on meshes with axes of size 1, beside the same mesh without them.

    python benchmark/unit_axes.py [--real] [--limit S] [layers]   # default: 4 layers

Plans (``.plan()``, nothing compiled) the GPT-style model of
``benchmark/planner.py`` (hidden 1024, 16 heads, batch 64, Adam; 4 layers by
default) under every method, with the plan cache off, on

* ``(8,)`` and ``(8, 1, 1, 1, 1, 1, 1, 1)``: one axis of 8, then the same
  with 7 axes of size 1 after it;
* MaxText's 12 axes ("data", "stage", "fsdp", ..., "autoregressive") with
  "fsdp" = 8 and the others 1;
* ``(2, 4)`` ("data", "tensor"), and MaxText's 12 axes with "data" = 2 and
  "tensor" = 4;

and prints the seconds per method and mesh side by side, each plan in a
fresh process (a process that planned already traces faster). An
``AbstractMesh`` by default; ``--real``: ``jax.make_mesh`` over 8 simulated
CPU devices, what users pass. An axis of size 1 splits nothing: the planner
searches the axes of size > 1 alone, so each mesh with axes of size 1 should
plan in about the time of the mesh without them. A plan not made within
``--limit`` seconds (default 600) is shown as "> S s".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402

import autopar  # noqa: E402
from planner import abstract_args, lm_step  # noqa: E402  (benchmark/planner.py)

MAXTEXT_AXES = ("data", "stage", "fsdp", "fsdp_transpose", "sequence", "context",
                "context_autoregressive", "tensor", "tensor_transpose", "tensor_sequence",
                "expert", "autoregressive")


def maxtext(**sizes) -> tuple[tuple[int, ...], tuple[str, ...]]:
  return tuple(sizes.get(a, 1) for a in MAXTEXT_AXES), MAXTEXT_AXES


MESHES = {
    "(8,)": ((8,), ("data",)),
    "(8,)+7x1": ((8,) + (1,) * 7, ("data",) + tuple(f"one{i}" for i in range(7))),
    "12 axes fsdp=8": maxtext(fsdp=8),
    "(2,4)": ((2, 4), ("data", "tensor")),
    "12 axes 2x4": maxtext(data=2, tensor=4),
}
METHODS = ("ShardParallel", "DataParallel", "Zero2Parallel", "Zero3Parallel",
           "PipeshardParallel")


def plan_one(method: str, mesh_name: str, real: bool, layers: int) -> dict:
  """Plans the model under ``method`` on mesh ``mesh_name``: seconds, and
  what the plan chose."""
  shape, names = MESHES[mesh_name]
  mesh = (jax.make_mesh(shape, names) if real
          else jax.sharding.AbstractMesh(shape, names))
  option = autopar.AutoShardingOption(plan_cache=False, verbose=False)
  kwargs = {"mesh": mesh}
  if method in ("ShardParallel", "PipeshardParallel"):
    kwargs["option"] = option
  if method == "PipeshardParallel":
    kwargs.update(num_micro_batches=4, num_stages=2, layers="auto")
  step = autopar.parallelize(lm_step, method=getattr(autopar, method)(**kwargs))
  args = abstract_args(layers)
  t0 = time.perf_counter()
  plan = step.plan(*args)
  seconds = time.perf_counter() - t0
  return {"seconds": seconds, "objective": plan.objective,
          "batch_axes": list(plan.batch_axes),
          "variables": plan.solver.num_variables if plan.solver else None}


def run_fresh(*argv, limit: float) -> dict | None:
  """``plan_one`` in a fresh process; None past ``limit`` seconds."""
  try:
    out = subprocess.run([sys.executable, __file__, *argv], check=True,
                         capture_output=True, text=True, timeout=limit).stdout
  except subprocess.TimeoutExpired:
    return None
  return json.loads(out.strip().splitlines()[-1])


def main(real: bool, layers: int, limit: float):
  print(f"{layers}-layer GPT, planning seconds on "
        f"{'jax.make_mesh (8 CPU devices)' if real else 'AbstractMesh'}; "
        f"objective equal to the mesh without axes of size 1: '=' (else the ratio)")
  width = max(map(len, MESHES)) + 2
  print(f"{'':18}" + "".join(f"{m:>{width}}" for m in MESHES))
  for method in METHODS:
    cells, base = [], None
    for mesh_name in MESHES:
      r = run_fresh("--one", method, mesh_name, "real" if real else "abstract",
                    str(layers), limit=limit)
      if r is None:
        cells.append(f"> {limit:.0f} s  ")
        continue
      if mesh_name in ("(8,)", "(2,4)"):       # the meshes without axes of size 1
        base = r["objective"]
        mark = " "
      else:
        mark = "=" if abs(r["objective"] - base) <= 1e-9 * abs(base) else \
            f"x{r['objective'] / base:.3f}"
      cells.append(f"{r['seconds']:.2f} s {mark}")
    print(f"{method:18}" + "".join(f"{c:>{width}}" for c in cells), flush=True)


if __name__ == "__main__":
  if sys.argv[1:2] == ["--one"]:
    method, mesh_name, kind, layers = sys.argv[2:6]
    print(json.dumps(plan_one(method, mesh_name, kind == "real", int(layers))))
  else:
    argv = sys.argv[1:]
    limit = 600.0
    if "--limit" in argv:
      i = argv.index("--limit")
      limit = float(argv[i + 1])
      del argv[i:i + 2]
    rest = [a for a in argv if a != "--real"]
    main("--real" in argv, int(rest[0]) if rest else 4, limit)
