"""benchmark/gpu_step.py (issue 34's GPU figure) runs, on tiny sizes on the
CPU: both steps train the same model to the same loss."""

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
    assert r["hand"] > 0 and r["autopar"] > 0 and r["ratio"] == pytest.approx(
        r["autopar"] / r["hand"])
    assert r["loss_autopar"] == pytest.approx(r["loss_hand"], rel=1e-4)
