"""benchmark/gpu_step.py (issue 34's GPU figure) runs, on tiny sizes on the
CPU: autopar's steps (both remat loops) train the model to the hand-written
step's loss, and the programs it times are the loops it names."""

import importlib.util
import os

import pytest


def test_gpu_step_benchmark_runs_on_tiny_sizes():
  path = os.path.join(os.path.dirname(__file__), "..", "benchmark", "gpu_step.py")
  spec = importlib.util.spec_from_file_location("gpu_step", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  rows = mod.main(["--tiny", "--steps", "2"])
  assert [(r["micro"]) for r in rows] == [1, 4]
  for r in rows:
    hand = r["hand"]
    for what in ("autopar unrolled", "autopar scan"):
      ours = r[what]
      assert ours["seconds"] > 0 and ours["temp"] > 0
      assert ours["loss"] == pytest.approx(hand["loss"], rel=1e-4)
    # What the benchmark reports of the programs it times: the unrolled
    # remat loop compiles to no conditional, the scan picks each layer's
    # weights by one.
    assert r["autopar unrolled"]["conditionals"] == 0
    assert r["autopar scan"]["conditionals"] > 0
