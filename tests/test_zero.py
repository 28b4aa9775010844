"""ZeRO-2 and ZeRO-3 presets: numerics and the collectives they compile to."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import autopar
from autopar.backend import hlo
from autopar.plan import sync_stage_name
from autopar.planner.ilp import ShardingProblem
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
  sync = hlo.collectives(exe.stages[exe.schedule[0] if n == 1 else    # (grad_and_apply)
                                    sync_stage_name(n, exe.plan.grad_sync)])
  assert any(c.kind == "reduce-scatter" for c in sync)
  assert not any(c.kind == "all-reduce" and c.operand_bytes > 64 for c in sync)
  if n > 1:
    assert not [c for c in hlo.collectives(exe.stages["accumulate_grad"])
                if c.kind in ("all-reduce", "reduce-scatter")]


def test_shard_parallel_takes_zero2_where_it_is_cheaper(monkeypatch):
  """The ILP's space holds data parallelism's layout but not ZeRO's (each
  device updating its shard of the state): where ZeRO-2's layout costs less
  under the same model (a wide MLP whose Adam update's memory traffic
  dominates), ShardParallel takes it, says so, and computes what jit does.
  ZeRO's layout is priced on the ILP's problem over every axis, solved
  again with the leaves pinned (no problem built for it), at the price the
  preset's own plan gives it."""
  make_state, step, batch = mlp_setup(batch=4096, din=512, hidden=512, dout=512,
                                      layers=3)
  mesh = jax.make_mesh((8,), ("x",))
  option = autopar.AutoShardingOption(plan_cache=False)
  pf = autopar.parallelize(step, method=autopar.ShardParallel(mesh=mesh, option=option))
  built = []
  build = ShardingProblem.build
  monkeypatch.setattr(ShardingProblem, "build", lambda self: built.append(self) or build(self))
  plan = pf.plan(make_state(), batch)
  monkeypatch.undo()
  assert "Zero2Parallel's layout taken" in plan.summary()
  assert len(built) == len(plan.replan.problems)   # (the ILP's alone)
  zero2 = autopar.parallelize(step, method=autopar.Zero2Parallel(mesh=mesh)).plan(
      make_state(), batch)
  assert plan.objective == pytest.approx(zero2.objective, rel=1e-9)
  exe = pf.get_executable(make_state(), batch)
  assert exe.plan.objective == plan.objective
  assert any(v.spec != jax.P() for v in plan.inputs if "opt_state" in v.name)
  state, _ = pf(make_state(), batch)
  preset, _ = autopar.parallelize(step, method=autopar.Zero2Parallel(mesh=mesh))(
      make_state(), batch)
  assert_trees_close(state.params, preset.params, rtol=1e-6, atol=1e-7)
  # Adam divides by the root of tiny second moments: summation order moves a
  # few weights by up to lr x 1e-3.
  expected, _ = jax.jit(step)(make_state(), batch)
  assert_trees_close(state.params, expected.params, rtol=1e-3, atol=2e-5)


@pytest.mark.parametrize("setup", ["mlp", "transformer"])
@pytest.mark.parametrize("n,grad_sync", [(1, "last"), (2, "apart"), (4, "last")])
def test_zero_collectives_alone_never_cost_more_than_its_priced_layout(monkeypatch, setup,
                                                                        n, grad_sync):
  """ShardParallel prices ZeRO's layouts only where their collectives alone
  (reduce-scatter, gathers, sums) cost less than its plan
  (``plan_preset(cheaper_than=)``): that must be a lower bound on the
  price, compute and a latency per leaf's collective added (else a cheaper
  ZeRO layout could be passed over); below it nothing is priced, above the
  price the layout's plan comes back."""
  from autopar import signature
  from autopar.planner import preset
  from models import transformer_setup
  make_state, step, batch = {
      "mlp": lambda: mlp_setup(batch=256, din=64, hidden=256, dout=64, layers=3),
      "transformer": lambda: transformer_setup(batch=32, d=64, heads=4)}[setup]()
  args = jax.eval_shape(make_state), jax.eval_shape(lambda: batch)
  mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
  seen = []
  priced, plan_preset = preset._priced, signature.plan_preset

  def record(local, method, mesh, batch_axes, in_specs, traced, zero, collectives, cost,
             *rest, **kwargs):
    alone = sum(cost.collective(c.kind, c.bytes, c.axes) * c.per_step for c in collectives)
    times = priced(local, method, mesh, batch_axes, in_specs, traced, zero, collectives,
                   cost, *rest, **kwargs)
    seen.append((alone, times["gradient"]["total"] + times["apply"]["total"]))
    return times

  def priced_against(*args, **kwargs):
    plan = plan_preset(*args, **kwargs)
    alone, price = seen[-1]
    assert price == pytest.approx(plan.objective, rel=1e-12)
    assert 0 < alone <= price
    count = len(seen)
    assert plan_preset(*args, **kwargs, cheaper_than=alone * (1 - 1e-9)) is None
    assert len(seen) == count                   # (not priced)
    again = plan_preset(*args, **kwargs, cheaper_than=price * (1 + 1e-9))
    assert again.objective == plan.objective
    return plan

  monkeypatch.setattr(preset, "_priced", record)
  monkeypatch.setattr(signature, "plan_preset", priced_against)
  monkeypatch.setattr(signature.plan_cache, "load", lambda key: None)   # (planned here)
  for method in (autopar.Zero2Parallel, autopar.Zero3Parallel):
    autopar.parallelize(step, method=method(
        mesh=mesh, num_micro_batches=n, grad_sync=grad_sync)).plan(*args)
  assert len(seen) == 4


def test_pricing_zero_on_the_ilps_problem_changes_no_answer_about_the_plan(monkeypatch):
  """ZeRO's layouts are priced by solving the ILP's problem over every axis
  again with pins, on the problem the plan keeps for explain and cost_if:
  what they answer, and the problems Plan.to_json saves, are those of a plan
  whose ZeRO prices were built apart."""
  import json
  from autopar.planner import shard
  # (Wide enough that ZeRO's collectives alone do not outprice the ILP's
  # plan, which skips pricing its layout: plan_preset's cheaper_than.)
  make_state, step, batch = mlp_setup(batch=1024, din=256, hidden=256, dout=256,
                                      layers=2)
  args = jax.eval_shape(make_state), jax.eval_shape(lambda: batch)
  mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
  leaf = "*Dense_0*kernel"

  def answers():
    option = autopar.AutoShardingOption(plan_cache=False)
    pf = autopar.parallelize(step, method=autopar.ShardParallel(mesh=mesh, option=option))
    plan = pf.plan(*args)
    e = plan.explain(leaf)
    return (plan.objective, str(e.chosen),
            sorted((str(c.spec), c.objective) for c in e.candidates),
            plan.cost_if({leaf: P()}).after,
            json.loads(plan.to_json())["ilp"])

  pinned = []
  price = ShardingProblem.price_pinned
  monkeypatch.setattr(ShardingProblem, "price_pinned",
                      lambda self, *a: pinned.append(self) or price(self, *a))
  priced_on_it = answers()
  assert pinned and priced_on_it[-1]          # (priced so; problems saved)
  init = shard.LayoutPrices.__init__
  monkeypatch.setattr(shard.LayoutPrices, "__init__",
                      lambda self, problems=(): init(self))    # (built apart)
  assert answers() == priced_on_it
