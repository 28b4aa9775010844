"""ZeRO-2 and ZeRO-3 presets: numerics and the collectives they compile to."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import autopar
from autopar import hlo
from models import assert_trees_close, mlp_setup, single_device


@pytest.mark.parametrize("method", [autopar.Zero2Parallel, autopar.Zero3Parallel])
@pytest.mark.parametrize("n", [1, 2])
def test_zero_matches_single_device(method, n):
  make_state, step, batch = mlp_setup(hidden=64)
  ref_state, ref_loss = single_device(step)(make_state(), batch)
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  p = autopar.parallelize(step, method=method(mesh=mesh, num_micro_batches=n))
  state, loss = p(make_state(), batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_trees_close(state.params, ref_state.params)
  assert_trees_close(state.opt_state, ref_state.opt_state)
  state, loss = p(state, batch)      # and the sharded state feeds the next step

  exe = p.get_executable(make_state(), batch)
  plan = exe.plan
  kernel = [v for v in plan.inputs if v.name.endswith("['Dense_0']['kernel']")]
  param, mu = kernel[0], kernel[1]
  assert "opt_state" in mu.name and mu.spec == P(("data", "model"))
  assert param.spec == (P(("data", "model")) if method is autopar.Zero3Parallel
                        else P())
  sync = hlo.collectives(exe.stages[exe.schedule[n - 1]])
  assert any(c.kind == "reduce-scatter" for c in sync)
  assert not any(c.kind == "all-reduce" and c.operand_bytes > 64 for c in sync)
  for name in exe.schedule[:n - 1]:
    assert not [c for c in hlo.collectives(exe.stages[name])
                if c.kind in ("all-reduce", "reduce-scatter")]
