"""The cost model against the hardware and against what XLA compiles:
the compute roofline, ``plan.check`` and loop-aware HLO reading."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import autopar
from autopar.backend import hlo
from autopar.costs.cost_model import MeshCost
from autopar.costs.strategies import RuleContext, strategies_for
from models import (ConvNet, ScanTransformer, Transformer, image_setup, lm_setup,
                    mlp_setup, transformer_setup)


def _eqn(fn, *avals):
  return jax.make_jaxpr(fn)(*avals).jaxpr.eqns[0]


def test_compute_is_priced_at_the_dtype_that_does_the_work():
  """A matmul at its operands' dtype's peak (an H100's bfloat16 tensor cores
  are ~15x its float32 rate; the float32 accumulation does not change it),
  element-wise work at float32's (vector units) whatever its dtype; memory
  traffic is not the rules' (the ILP counts it at fusion boundaries)."""
  sizes = {"x": 8}
  rates = {"float32": 1 / 67e12, "bfloat16": 1 / 989e12}
  ctx = RuleContext(("x",), sizes, MeshCost(sizes), seconds_per_flop=1 / 67e12,
                    flop_rates=rates)
  n = 1024
  flops = 2 * n ** 3
  for dtype, rate in (("float32", 67e12), ("bfloat16", 989e12)):
    y = jax.ShapeDtypeStruct((n, n), jnp.dtype(dtype))
    dot = {s.name: s.compute for s in strategies_for(
        _eqn(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32), y, y),
        ctx)}
    assert dot["lhs((), ()) x rhs((), ())"] == pytest.approx(flops / rate)
    assert dot["lhs(('x',), ()) x rhs((), ())"] == pytest.approx(flops / rate / 8)
    ew = {s.out_specs[0]: s.compute for s in strategies_for(_eqn(jnp.sin, y), ctx)}
    assert ew[((), ())] == pytest.approx(n * n / 67e12)
  # Given by hand, seconds_per_flop prices every dtype.
  plain = RuleContext(("x",), sizes, MeshCost(sizes), seconds_per_flop=1e-12)
  y = jax.ShapeDtypeStruct((n, n), jnp.bfloat16)
  dot = strategies_for(_eqn(jnp.matmul, y, y), plain)[0]
  assert dot.compute == pytest.approx(flops * 1e-12)


def test_module_cost_counts_loop_trips():
  """XLA's cost_analysis counts a loop body once; hlo.module_cost counts it
  its trips (the roofline plan.check judges by)."""
  def one(x, w):
    return jnp.tanh(x @ w)

  def looped(x, w):
    return jax.lax.scan(lambda c, _: (one(c, w), None), x, None, length=10)[0]
  x = jnp.ones((256, 256))
  f1, b1 = hlo.module_cost(jax.jit(one).lower(x, x).compile())
  f10, b10 = hlo.module_cost(jax.jit(looped).lower(x, x).compile())
  assert f10 == pytest.approx(10 * f1, rel=0.01)
  assert b10 == pytest.approx(10 * b1, rel=0.1)


def test_matmul_flops_by_dtype():
  """The compiled module's matmul and convolution flops (in loops counted
  their trips), by the dtype they run at: what plan.check and the judge
  price at the tensor cores' rate, the rest at float32's."""
  def f(x, w, k):
    y = jnp.tanh(x @ w)
    c = jax.lax.conv_general_dilated(k, jnp.ones((3, 3, 4, 8)), (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    z = jax.lax.scan(lambda c, _: (c @ w, None), x, None, length=5)[0]
    exact = jnp.matmul(x, w, precision=jax.lax.Precision.HIGHEST)
    return y.sum() + c.sum() + z.sum() + exact.sum()
  x, w, k = jnp.ones((64, 128)), jnp.ones((128, 128)), jnp.ones((2, 8, 8, 4))
  compiled = jax.jit(f).lower(x, w, k).compile()
  got = hlo.matmul_flops(compiled)
  dot, conv = 2 * 64 * 128 * 128, 2 * (2 * 8 * 8 * 8) * (3 * 3 * 4)
  assert got == {"tfloat32": pytest.approx(6 * dot + conv), "float32": pytest.approx(dot)}
  assert hlo.module_cost(compiled)[0] > sum(got.values())    # tanh, sums


def test_memory_bandwidth_comes_from_the_device_kind():
  make_state, step, batch = mlp_setup(batch=64, din=64, hidden=64, dout=8)
  abstract = jax.eval_shape(lambda: (make_state(), batch))
  mesh = jax.sharding.AbstractMesh((8,), ("x",))
  for kind, bandwidth in (("H100", 3.35e12), ("TPU v5e", 819e9)):
    option = autopar.AutoShardingOption(device_kind=kind, plan_cache=False)
    plan = autopar.parallelize(step, method=autopar.ShardParallel(
        mesh=mesh, option=option)).plan(*abstract)
    assert plan.costs["seconds_per_byte"] == pytest.approx(1 / bandwidth)
    assert "memory" in plan.summary()
  with pytest.raises(autopar.InputError, match="memory_bandwidth"):
    autopar.AutoShardingOption(memory_bandwidth=-1)


def test_hlo_counts_collectives_in_loops_and_reads_their_mesh_axes():
  mesh = jax.make_mesh((2, 4), ("a", "b"))

  def body(x):
    def layer(c, _):
      return jax.lax.psum(c, "b") * 0.5, None
    return jax.lax.scan(layer, x, None, length=5)[0]

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=jax.P("a", "b"),
                            out_specs=jax.P("a", "b"), check_vma=False))
  x = jax.ShapeDtypeStruct((8, 64), jnp.float32,
                           sharding=jax.NamedSharding(mesh, jax.P("a", "b")))
  compiled = f.lower(x).compile()
  colls = [c for c in hlo.collectives(compiled) if c.kind == "all-reduce"]
  assert sum(c.count for c in colls) == 5
  assert {c.mesh_axes(("a", "b"), (2, 4)) for c in colls} == {("b",)}
  one = 4 * 16 * 4                                   # f32[4, 16] per device
  assert hlo.bytes_sent(compiled) == pytest.approx(5 * 2 * one * 3 / 4)


MODELS = {
    "mlp": lambda: mlp_setup(batch=64, din=256, hidden=1024, dout=256),
    "gpt": lambda: lm_setup(Transformer(vocab=256, d=128, heads=4, layers=2),
                            batch=16, seq=16),
    "scanned gpt": lambda: lm_setup(ScanTransformer(vocab=256, d=128, heads=4, layers=3),
                                    batch=16, seq=16),
    "conv": lambda: image_setup(ConvNet(), batch=32, hw=8),
}
METHODS = {
    "DataParallel": lambda m: autopar.DataParallel(mesh=m, num_micro_batches=2),
    "Zero2Parallel": lambda m: autopar.Zero2Parallel(mesh=m, num_micro_batches=2),
    "Zero3Parallel": lambda m: autopar.Zero3Parallel(mesh=m, num_micro_batches=2),
    "ShardParallel": lambda m: autopar.ShardParallel(mesh=m, num_micro_batches=2),
    # Two stages of four devices: its memory alone is compared (plan.check
    # compares no collectives or time of a pipeline).
    "PipeshardParallel": lambda m: autopar.PipeshardParallel(
        mesh=m, num_micro_batches=2, num_stages=2),
}
# Where the prediction is known to miss, and why (docs/planner.md): (model,
# method) -> "time" / "memory" / "bytes". Anything off by more is a failure,
# and so is a listed miss that no longer misses (the table is then out of
# date). The conv net's time under every method and the scanned GPT's under
# ZeRO-3 (x1.16-1.26) were XLA:CPU's relayout copies, which the traffic now
# counts. Left:
#  * bytes and time, conv net under ShardParallel on 2 x 4 (bytes x1.43,
#    time x1.26): the plan reads Conv_1's replicated kernel split over
#    `data` in the forward convolution and whole in the backward one; XLA
#    makes the whole one by gathering the split copy (9 KiB per micro-batch)
#    instead of reading the replicated kernel, which the model does not
#    know.
KNOWN_MISSES: dict = {("conv", "ShardParallel"): ("bytes", "time")}
# The time column's tolerance (issue 32 asks for 15 %).
TIME_TOLERANCE = 0.15


@pytest.mark.parametrize("model", MODELS)
def test_plan_check_prediction_equals_compilation(model):
  """Collectives within 10 % of bytes (by kind and mesh axes), peak memory
  within 15 % and time per step (the roofline of the compiled modules with
  the plan's constants) within 15 %, on a mesh of 8 and of 2 x 4, under
  every method (a pipeline's memory alone, per stage: its stages are
  compiled as its first call runs them)."""
  make_state, step, batch = MODELS[model]()
  state = make_state()
  misses, report = {}, []
  for mesh in (jax.make_mesh((8,), ("x",)), jax.make_mesh((2, 4), ("data", "model"))):
    for name, method in METHODS.items():
      pipeline = name == "PipeshardParallel"
      pf = autopar.parallelize(step, method=method(mesh))
      if pipeline:                    # (a copy of the state, which the call donates)
        pf(jax.tree.map(jnp.copy, state), batch)
      exe = pf.get_executable(state, batch)
      result = exe.plan.check(exe)
      if pipeline:
        assert len(result.stage_memory) == len(exe.plan.stages) == 2
      else:
        assert result.compiled_bytes > 0
        assert result.times and result.predicted_time == pytest.approx(
            exe.plan.objective, rel=1e-3)
      for d in result.differences(time_tolerance=TIME_TOLERANCE):
        kind = ("memory" if d.startswith("peak memory") else
                "time" if d.startswith("time") else "bytes")
        misses.setdefault(name, set()).add(kind)
        report.append(f"{name} {dict(mesh.shape)}: {d}")
  expected = {name: {kind} if isinstance(kind, str) else set(kind)
              for (m, name), kind in KNOWN_MISSES.items() if m == model}
  assert misses == expected, "\n".join(report)


@pytest.mark.parametrize("method,n,grad_sync", [("Zero3Parallel", 4, "last"),
                                                ("Zero3Parallel", 2, "apart"),
                                                ("DataParallel", 2, "apart")])
def test_plan_check_where_the_sums_are_carried(method, n, grad_sync):
  """Stages that carry the partial sums on to the next (the middle
  micro-batches' ``accumulate_grad``; every micro-batch's under
  ``grad_sync="apart"``, with ``zero_grad`` and ``sync_grad`` beside them)
  within the tolerances of time and memory. Before, each such stage copied
  its donated sums into its output (ZeRO-3 at n=4: memory x1.19 the
  plan's), and ``"apart"``'s extra passes were not priced (time x1.3)."""
  make_state, step, batch = mlp_setup(batch=64, din=256, hidden=1024, dout=256)
  mesh = jax.make_mesh((8,), ("x",))
  exe = autopar.parallelize(step, method=getattr(autopar, method)(
      mesh=mesh, num_micro_batches=n, grad_sync=grad_sync)).get_executable(
          make_state(), batch)
  assert ("sync_grad" in exe.schedule) == (grad_sync == "apart")
  result = exe.plan.check(exe)
  assert not result.differences(time_tolerance=TIME_TOLERANCE), str(result)


def test_plan_check_under_remat_loops():
  """remat's layer loops, under the ILP: what enters each loop (a carry,
  each trip's slice of the saved activations) is pinned where the plan
  says, so XLA reshards it once per trip as planned. Unpinned, XLA took the
  plan's split of the batch into the backward loop and gathered partial
  results three times per layer (x2.2 the bytes here). The memory counts
  what the backward loop's body holds while it recomputes a layer (x1.22
  here before)."""
  make_state, step, batch = transformer_setup(layers=6, d=64, seq=8, batch=16)
  state = make_state()
  mesh = jax.make_mesh((8,), ("x",))
  for remat in ("layers", jax.checkpoint_policies.dots_with_no_batch_dims_saveable):
    exe = autopar.parallelize(step, method=autopar.ShardParallel(
        mesh=mesh, remat=remat)).get_executable(state, batch)
    result = exe.plan.check(exe)
    assert not result.differences(), str(result)
    if remat == "layers":  # a plan that splits the batch inside the layers
      assert result.compiled_bytes > 0


def test_plan_check_reports_what_differs():
  make_state, step, batch = mlp_setup(batch=64, din=256, hidden=1024, dout=256)
  mesh = jax.make_mesh((8,), ("x",))
  # One micro-batch's gradient and update in one executable (the default):
  # one phase, "step", and one time row; apart, the gradient's phase.
  for one, phase in ((None, "step"), (False, "per micro-batch")):
    exe = autopar.parallelize(step, method=autopar.DataParallel(
        mesh=mesh, one_executable=one)).get_executable(make_state(), batch)
    result = exe.plan.check(exe)
    assert [(c.phase, c.kind, c.axes) for c in result.collectives
            if c.predicted > 1024] == [(phase, "all-reduce", ("x",))]
    assert [t[0] for t in result.times] == (["step"] if one is None else
                                            ["gradient", "apply"])
    assert not result.differences(memory_tolerance=0.5), str(result)
  assert "all-reduce" in str(result) and "peak memory" in str(result)
  # A plan claiming half the memory is caught.
  import dataclasses
  wrong = dataclasses.replace(exe.plan, memory_per_device=exe.plan.memory_per_device // 2)
  assert any("peak memory" in d for d in wrong.check(exe).differences())
  with pytest.raises(autopar.PlanError, match="get_executable"):
    exe.plan.check(object())


def test_diff_compares_objectives_of_one_model():
  """DataParallel's plan is priced by the model ShardParallel's ILP
  minimises: its objective is that of ShardParallel held to the same layout,
  and ShardParallel (whose space holds it) is never dearer; autopar.diff
  reads objectives on one scale."""
  make_state, step, batch = lm_setup(Transformer(vocab=256, d=128, heads=4, layers=2),
                                     batch=16, seq=16)
  abstract = jax.eval_shape(lambda: (make_state(), batch))
  for kind in (None, "H100"):
    mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
    option = autopar.AutoShardingOption(device_kind=kind, plan_cache=False)
    dp = autopar.parallelize(step, method=autopar.DataParallel(mesh=mesh)).plan(*abstract)
    pinned = autopar.parallelize(step, method=autopar.ShardParallel(
        mesh=mesh, option=dataclasses.replace(option, force_data_parallel=True))).plan(
            *abstract)
    auto = autopar.parallelize(step, method=autopar.ShardParallel(
        mesh=mesh, option=option)).plan(*abstract)
    if kind is None:   # an AbstractMesh without a kind: both take the defaults
      assert dp.objective == pytest.approx(pinned.objective, rel=1e-3)
      assert dp.predicted_time["gradient"]["total"] > 0
    assert auto.objective <= pinned.objective * (1 + 1e-3)
    d = autopar.diff(auto, pinned)
    assert d.objective == (auto.objective, pinned.objective)
    assert f"objective: {auto.objective:.4g} s -> {pinned.objective:.4g} s" in str(d)
