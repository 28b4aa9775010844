"""The planner at scale: planning without the cluster, repeated layers solved
once, the plan cache, and one symbolic trace for every batch size."""

import json
import math
import os
import subprocess
import sys
import textwrap

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import autopar

from autopar.planner import ilp

from autopar.planner import shard as planner
from models import assert_trees_close, mlp_setup, single_device, transformer_setup

SGD = optax.sgd(0.1, momentum=0.9)
HERE = os.path.dirname(__file__)


def abstract(make_state, batch):
  return jax.eval_shape(make_state), jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)


def no_solver(monkeypatch):
  def fail(self, *a, **k):
    raise AssertionError("the ILP was solved again")
  monkeypatch.setattr(ilp.ShardingProblem, "solve", fail)


def test_plan_for_64_devices_in_a_process_with_one_device(tmp_path):
  script = textwrap.dedent("""
      import json, os, sys
      os.environ["JAX_PLATFORMS"] = "cpu"
      os.environ["XLA_FLAGS"] = ""
      sys.path.insert(0, sys.argv[1])
      import jax, jax.numpy as jnp, optax
      from flax.training import train_state
      import autopar
      from autopar.jax_compat import backends_are_initialized
      from models import Transformer

      model = Transformer(vocab=64, d=64, heads=8, layers=2)
      tokens = jax.ShapeDtypeStruct((64, 17), jnp.int32)
      def make_state():
        params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 16), jnp.int32))
        return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                             tx=optax.adam(1e-3))
      state = jax.eval_shape(make_state)

      def step(state, batch):
        def loss_fn(p):
          logits = state.apply_fn(p, batch["tokens"][:, :-1])
          return optax.softmax_cross_entropy_with_integer_labels(
              logits, batch["tokens"][:, 1:]).mean()
        loss, grads = autopar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

      mesh = jax.sharding.AbstractMesh((8, 8), ("data", "model"))
      fn = autopar.parallelize(step, method=autopar.ShardParallel(mesh=mesh))
      plan = fn.plan(state, {"tokens": tokens})
      summary, text = plan.summary(full=True), plan.to_json()
      # Of the planning, only the problems the plan keeps for explain outlive
      # the function planned, and nothing outlives the plan: the first plan in
      # a process once kept its problem through a traceback.
      import gc
      from autopar.planner import ilp
      from autopar.frontend import split
      problems = {id(p.problem) for p in plan.replan.problems}
      del fn
      gc.collect()
      others = [o for o in gc.get_objects() if isinstance(o, ilp.ShardingProblem)
                and id(o) not in problems]
      del plan
      gc.collect()
      kept = [type(o).__name__ for o in gc.get_objects()
              if isinstance(o, (ilp.ShardingProblem, split.SplitStep))]
      print(json.dumps({"touched": backends_are_initialized(),
                        "kept": kept, "kept_by_the_plan": len(problems),
                        "others": len(others),
                        "summary": summary, "json": text,
                        "leaves": len(jax.tree.leaves(state)) + 1}))
  """)
  path = tmp_path / "plan64.py"
  path.write_text(script)
  env = {**os.environ, "AUTOPAR_CACHE_DIR": str(tmp_path / "cache")}
  out = subprocess.run([sys.executable, str(path), HERE], capture_output=True,
                       text=True, env=env, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  result = json.loads(out.stdout.strip().splitlines()[-1])
  assert result["touched"] is False          # no backend, no device
  assert result["kept"] == [] and result["others"] == 0
  assert result["kept_by_the_plan"] >= 1
  plan = autopar.Plan.from_json(result["json"])
  assert plan.mesh_shape == (8, 8) and plan.mesh_axis_names == ("data", "model")
  assert len(plan.inputs) == result["leaves"]
  for v in plan.inputs:
    assert v.name in result["summary"]
  assert plan.batch_axes and plan.solver.num_variables > 0
  assert "estimated memory per device" in result["summary"]
  assert autopar.Plan.from_json(plan.to_json()) == plan


def test_saved_abstract_plan_runs_on_a_real_mesh_without_solving(monkeypatch):
  make_state, step, batch = transformer_setup(batch=16, d=32, heads=4, tx=SGD)
  amesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
  saved = autopar.parallelize(step, method=autopar.ShardParallel(mesh=amesh)).plan(
      *abstract(make_state, batch)).to_json()

  no_solver(monkeypatch)
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  p = autopar.parallelize(step, method=autopar.ShardParallel(
      mesh=mesh, plan=autopar.Plan.from_json(saved)))
  ref_state, ref_loss = single_device(step)(make_state(), batch)
  state, loss = p(make_state(), batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_trees_close(state.params, ref_state.params)


def test_planned_function_runs_with_its_plan(monkeypatch):
  """.plan() with abstract arguments, then a call with arrays: the call runs
  the plan made (no second solve), on the step written out at the full
  micro-batch size only now, and matches single-device jax.jit."""
  make_state, step, batch = transformer_setup(batch=16, d=32, heads=4, tx=SGD)
  p = autopar.parallelize(step, method=autopar.ShardParallel(
      mesh=jax.make_mesh((2, 4), ("data", "model")), num_micro_batches=2,
      option=autopar.AutoShardingOption(plan_cache=False)))
  plan = p.plan(*abstract(make_state, batch))
  no_solver(monkeypatch)
  ref_state, ref_loss = single_device(step)(make_state(), batch)
  state, loss = p(make_state(), batch)
  assert p.get_executable(make_state(), batch).plan == plan     # (.plan() adds a replanner)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_trees_close(state.params, ref_state.params)


def test_plan_cache_hit_on_a_second_call(monkeypatch, tmp_path):
  monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
  make_state, step, batch = transformer_setup(batch=16, d=32, heads=4, tx=SGD)
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  args = abstract(make_state, batch)
  first = autopar.parallelize(step, method=autopar.ShardParallel(mesh=mesh)).plan(*args)
  assert len(list((tmp_path / "plans").glob("*.json"))) == 1

  no_solver(monkeypatch)
  again = autopar.parallelize(step, method=autopar.ShardParallel(mesh=mesh)).plan(*args)
  assert again.to_json() == first.to_json()
  # Another option is another key: it solves (and here fails loudly).
  other = autopar.ShardParallel(mesh=mesh, option=autopar.AutoShardingOption(
      seconds_per_flop=1e-13))
  with pytest.raises(AssertionError, match="solved again"):
    autopar.parallelize(step, method=other).plan(*args)


def test_plan_cache_key_tells_programs_apart():
  import hashlib
  from autopar.planner.cache import program_digest

  def digest(f, *shapes):
    h = hashlib.sha256()
    program_digest(jax.make_jaxpr(f)(*[jax.ShapeDtypeStruct(s, jnp.float32)
                                       for s in shapes]), h)
    return h.hexdigest()

  def scan(body):
    return lambda x: jax.lax.scan(lambda c, _: (body(c), None), x, None, length=3)[0]

  programs = {
      "sin": (jnp.sin, (4,)), "cos": (jnp.cos, (4,)), "sin 8": (jnp.sin, (8,)),
      "x*2": (lambda x: x * 2, (4,)), "x*3": (lambda x: x * 3, (4,)),
      "sum 0": (lambda x: x.sum(0), (4, 4)), "sum 1": (lambda x: x.sum(1), (4, 4)),
      "scan sin": (scan(jnp.sin), (4,)), "scan cos": (scan(jnp.cos), (4,)),
      "x+y": (lambda x, y: x + y, (4,), (4,)), "y+x": (lambda x, y: y - x, (4,), (4,)),
  }
  digests = {k: digest(f, *shapes) for k, (f, *shapes) in programs.items()}
  assert len(set(digests.values())) == len(programs)
  assert digest(jnp.sin, (4,)) == digests["sin"]      # the same program, traced again


def layer_specs(plan, layer):
  """{path inside the layer: spec} of the parameters of Block_<layer>."""
  tag = f"['Block_{layer}']"
  return {v.name.split(tag)[1]: v.spec for v in plan.inputs
          if v.name.startswith("state.params") and tag in v.name}


def plan_transformer(layers, share=True, d=128, batch=8):
  make_state, step, data = transformer_setup(batch=batch, seq=8, d=d, heads=4,
                                             layers=layers, tx=SGD)
  option = autopar.AutoShardingOption(share_layers=share, plan_cache=False)
  method = autopar.ShardParallel(mesh=jax.sharding.AbstractMesh((8,), ("model",)),
                                 option=option)
  return autopar.parallelize(step, method=method).plan(*abstract(make_state, data))


def test_24_layers_are_the_2_layer_plan_repeated():
  two, deep = plan_transformer(2), plan_transformer(24)
  # Tensor parallel at this width (hidden 128, batch 8): something is split.
  assert any(any(s) for s in layer_specs(two, 0).values())
  assert layer_specs(two, 1) == layer_specs(two, 0)
  for layer in range(24):
    assert layer_specs(deep, layer) == layer_specs(two, 0), layer
  # The problem does not grow with depth.
  assert deep.solver.num_classes <= two.solver.num_classes + 10
  assert deep.solver.num_variables <= 1.2 * two.solver.num_variables
  assert deep.solver.num_nodes > 8 * two.solver.num_nodes


@pytest.mark.parametrize("d,batch", [(128, 8), (32, 512)])
def test_sharing_layers_costs_nothing_on_a_small_model(d, batch):
  shared = plan_transformer(4, share=True, d=d, batch=batch)
  alone = plan_transformer(4, share=False, d=d, batch=batch)
  assert shared.solver.num_classes < alone.solver.num_classes
  # Equal up to the solver's optimality gap (both are solved to within it).
  assert shared.objective <= alone.objective * (1 + ilp.MIP_GAP)


@pytest.mark.parametrize("layers", [2, 3])
def test_sharing_layers_keeps_optimizer_state_of_unlike_layers_apart(layers):
  """Layers of equal shapes split differently (column then row, Megatron
  style) keep their Adam moments apart: the moments are leaves, far from
  what tells the layers apart, and once shared one class (forcing the row-
  split kernel's moments to the column-split one's spec, 11 % dearer on a
  wide MLP)."""
  def plan(share):
    make_state, step, data = mlp_setup(batch=64, din=2048, hidden=2048, dout=2048,
                                       tx=optax.adam(1e-3), layers=layers)
    option = autopar.AutoShardingOption(share_layers=share, plan_cache=False,
                                        device_kind="H100", devices_per_host=8)
    method = autopar.ShardParallel(mesh=jax.sharding.AbstractMesh((8,), ("x",)),
                                   option=option)
    return autopar.parallelize(step, method=method).plan(*abstract(make_state, data))
  shared, alone = plan(True), plan(False)
  assert shared.objective <= alone.objective * (1 + ilp.MIP_GAP)
  specs = {v.name: v.spec for v in shared.inputs}
  for name, spec in specs.items():
    if ".mu[" in name or ".nu[" in name:
      param = "state.params" + name.split(".mu" if ".mu[" in name else ".nu")[1]
      assert spec == specs[param], (name, spec, specs[param])


def test_symbolic_trace_gives_the_same_program_as_a_concrete_one():
  from autopar.frontend.split import instantiate_split, split_step
  from autopar.frontend.trace import (abstract_leaves, arg_names, classify_args,
                             instantiate, trace_step, trace_step_any_batch)
  make_state, step, batch = transformer_setup(batch=16, d=32, heads=4, tx=SGD)
  args = (make_state(), batch)
  flags = classify_args(args, static_argnums="auto", batch_argnums=(1,),
                        donate_argnums="auto", fn_name="step")
  leaves, tree, _ = abstract_leaves(args, flags, arg_names(step, 2))
  sym = trace_step_any_batch(step, [None, None], flags, leaves, tree)
  assert sym is not None
  for rows in (16, 2):
    concrete = trace_step(step, [None, None], flags, leaves, tree, micro_batch_size=rows)
    got = instantiate(sym, rows)
    fn = jax.extend.core.jaxpr_as_fun(got.jaxpr)
    ref = jax.extend.core.jaxpr_as_fun(concrete.jaxpr)
    flat = jax.tree.leaves(args)
    flat = [x[:rows] if l.is_batch else x for x, l in zip(flat, leaves)]
    assert_trees_close(fn(*flat), ref(*flat))
    assert [tuple(v.aval.shape) for v in got.jaxpr.jaxpr.outvars] == \
        [tuple(v.aval.shape) for v in concrete.jaxpr.jaxpr.outvars]
    # Split once symbolically, then written out: the same two stages.
    got_split = instantiate_split(split_step(sym), rows)
    other = trace_step(step, [None, None], flags, leaves, tree, micro_batch_size=rows + 2)
    ref_split = split_step(concrete, reference=other)
    # The loss, a mean over the rows: the sum it divides.
    assert got_split.reduced == ref_split.reduced == ("sum",)
    assert got_split.out_kinds == ref_split.out_kinds
    assert got_split.out_index == ref_split.out_index
    for part in ("compute", "apply"):
      g, r = getattr(got_split, part), getattr(ref_split, part)
      assert [v.aval for v in g.jaxpr.invars] == [v.aval for v in r.jaxpr.invars]
      assert [v.aval for v in g.jaxpr.outvars] == [v.aval for v in r.jaxpr.outvars]
    grads = [np.ones(a.shape, a.dtype)
             for a in (*ref_split.grad_avals, *ref_split.reduced_avals)]
    consts = list(ref_split.consts)
    assert_trees_close(jax.extend.core.jaxpr_as_fun(got_split.compute)(*consts, *flat),
                       jax.extend.core.jaxpr_as_fun(ref_split.compute)(*consts, *flat))
    assert_trees_close(
        jax.extend.core.jaxpr_as_fun(got_split.apply)(*consts, *flat, *grads),
        jax.extend.core.jaxpr_as_fun(ref_split.apply)(*consts, *flat, *grads))


def test_step_that_needs_a_concrete_batch_size_is_traced_per_size():
  make_state, step, batch = transformer_setup(batch=16, d=32, heads=4, tx=SGD)

  def picky(state, batch):
    if batch["tokens"].shape[0] > 4:            # Python branch on the batch size
      batch = jax.tree.map(lambda x: x, batch)
    return step(state, batch)

  p = autopar.parallelize(picky, method=autopar.ShardParallel(
      mesh=jax.make_mesh((2, 4), ("data", "model"))))
  ref_state, ref_loss = single_device(step)(make_state(), batch)
  state, loss = p(make_state(), batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_trees_close(state.params, ref_state.params)


def test_progress_is_printed_when_asked(capsys):
  make_state, step, batch = transformer_setup(batch=16, d=32, heads=4, tx=SGD)
  option = autopar.AutoShardingOption(verbose=True, plan_cache=False)
  plan = autopar.parallelize(step, method=autopar.ShardParallel(
      mesh=jax.make_mesh((2, 4), ("data", "model")), option=option)).plan(
          *abstract(make_state, batch))
  err = capsys.readouterr().err
  for stage in ("trace", "strategies", "classes", "build", "solve"):
    assert f"autopar: planning step: {stage}" in err
  assert set(plan.solver.timings) >= {"trace", "solve", "total"}
  assert "planning time:" in plan.summary()



# (A contrastive loss over a batch x batch matrix was a case here: it mixes
# rows, so its batch is never split now; test_losses.py.)
@pytest.mark.parametrize("setup", ["mlp", "transformer"])
def test_a_skipped_choice_of_batch_axes_could_not_have_won(monkeypatch, setup):
  """The planner skips a choice of batch axes when a lower bound on its cost
  (gradient sync + matmuls) is no less than a plan already solved. The bound
  must never exceed that choice's optimal cost; and skipping must not change
  the plan."""
  make_state, step, batch = {
      "mlp": lambda: mlp_setup(batch=256, din=64, hidden=256, dout=8, tx=SGD),
      "transformer": lambda: transformer_setup(batch=16, d=64, heads=8, tx=SGD)}[setup]()
  args = abstract(make_state, batch)
  mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
  option = autopar.AutoShardingOption(plan_cache=False, max_model_axes=2)

  def plan():
    return autopar.parallelize(step, method=autopar.ShardParallel(
        mesh=mesh, num_micro_batches=2, option=option)).plan(*args)

  skipping = plan()
  bounds, objectives = {}, {}
  real_bound, real_solve = planner._cost_lower_bound, ilp.ShardingProblem.solve

  def record_bound(split, flops, S, *rest):
    bounds[S] = real_bound(split, flops, S, *rest)
    return 0.0                                  # skip nothing

  def record_solve(self, *args, **kwargs):
    # (The first solve of each choice's problem: ZeRO's layouts are then
    # priced on the one over every axis, solved again with pins.)
    objective = real_solve(self, *args, **kwargs)
    objectives.setdefault(self.S, objective)
    return objective

  monkeypatch.setattr(planner, "_cost_lower_bound", record_bound)
  monkeypatch.setattr(ilp.ShardingProblem, "solve", record_solve)
  every = plan()
  assert len(objectives) >= 3 and set(objectives) == set(bounds)
  assert any(bounds[S] > 0 for S in bounds)
  for S, objective in objectives.items():
    assert bounds[S] <= objective * (1 + 1e-9), (S, bounds[S], objective)
  assert skipping.batch_axes == every.batch_axes
  assert skipping.objective == pytest.approx(every.objective, rel=1e-9)


def test_the_most_promising_choice_of_batch_axes_is_solved_first(monkeypatch):
  """Choices of batch axes are solved lowest bound first, so that a larger
  batch split (first in the order that breaks ties) whose gradient sync alone
  costs more than a plan already solved is never built; the plan is the one
  that order keeps (test above: the same as with nothing skipped)."""
  make_state, step, data = transformer_setup(batch=64, seq=16, d=512, heads=4,
                                             layers=2, tx=optax.adam(1e-3))
  solved, bounds = [], {}
  real_solve, real_bound = ilp.ShardingProblem.solve, planner._cost_lower_bound

  def record_solve(self, *args, **kwargs):
    solved.append(self.S)
    return real_solve(self, *args, **kwargs)

  def record_bound(split, flops, S, *rest):
    bounds.setdefault(S, real_bound(split, flops, S, *rest))
    return bounds[S]

  monkeypatch.setattr(ilp.ShardingProblem, "solve", record_solve)
  monkeypatch.setattr(planner, "_cost_lower_bound", record_bound)
  method = autopar.ShardParallel(
      mesh=jax.sharding.AbstractMesh((8, 8), ("data", "model")),
      option=autopar.AutoShardingOption(plan_cache=False))
  plan = autopar.parallelize(step, method=method).plan(*abstract(make_state, data))
  everything = ("data", "model")
  kept = [p.problem.S for p in plan.replan.problems]
  assert everything in bounds and everything not in kept, (bounds, kept)
  assert bounds[everything] > plan.objective
  assert solved[0] == plan.batch_axes == ("data",)     # (its bound the lower)
  assert bounds[("data",)] < bounds[everything]


def test_24_layer_summary_is_short_and_lists_every_parameter():
  """Identical layers get identical plans (equal choices made alike), so the
  compact summary collapses them: a 24-layer GPT on 8 x 8 fits in 60 lines,
  with every parameter (each LayerNorm's too) in the parameter table."""
  make_state, step, data = transformer_setup(batch=64, seq=16, d=128, heads=4,
                                             layers=24, tx=optax.adam(1e-3))
  method = autopar.ShardParallel(
      mesh=jax.sharding.AbstractMesh((8, 8), ("data", "model")),
      option=autopar.AutoShardingOption(plan_cache=False))
  plan = autopar.parallelize(step, method=method).plan(*abstract(make_state, data))
  text = plan.summary()
  assert len(text.splitlines()) <= 60, text
  params_table, rest = text.split("other input", 1)
  assert "LayerNorm" in params_table and "params" not in rest.split("collectives")[0], text
  assert "Block_{0..23}" in params_table
  for layer in range(1, 24):
    assert layer_specs(plan, layer) == layer_specs(plan, 0), layer


# -- axes of size 1 ---------------------------------------------------------------------

# MaxText's mesh names 12 axes; a run on few devices gives most of them size 1.
MAXTEXT_AXES = ("data", "stage", "fsdp", "fsdp_transpose", "sequence", "context",
                "context_autoregressive", "tensor", "tensor_transpose", "tensor_sequence",
                "expert", "autoregressive")


def make_mesh(kind, shape, names):
  if kind == "abstract":
    return jax.sharding.AbstractMesh(shape, names)
  return jax.make_mesh(shape, names)        # what users pass: Explicit axes


def plan_on(method, mesh, layers=2):
  make_state, step, data = transformer_setup(batch=16, seq=8, d=64, heads=8,
                                             layers=layers, tx=SGD)
  kwargs = dict(mesh=mesh, num_micro_batches=2)
  if method in (autopar.ShardParallel, autopar.PipeshardParallel):
    kwargs["option"] = autopar.AutoShardingOption(plan_cache=False)
  if method is autopar.PipeshardParallel:
    kwargs.update(num_stages=2, layers="auto")
  return autopar.parallelize(step, method=method(**kwargs)).plan(
      *abstract(make_state, data))


def specs(values):
  return {v.name: v.spec for v in values}


@pytest.mark.parametrize("kind", ["abstract", "make_mesh"])
@pytest.mark.parametrize("method", [autopar.ShardParallel, autopar.DataParallel,
                                    autopar.Zero2Parallel, autopar.Zero3Parallel,
                                    autopar.PipeshardParallel])
def test_axes_of_size_1_change_no_plan(method, kind):
  """An axis of size 1 splits nothing: the plan on (data=2, stage=1, fsdp=1,
  tensor=4) is the plan on (data=2, tensor=4), found by the same problems
  (each axis of size 1 once doubled the choices of batch axes, multiplied
  every value's choices, and counted against max_model_axes)."""
  plain = plan_on(method, make_mesh(kind, (2, 4), ("data", "tensor")))
  unit = plan_on(method, make_mesh(kind, (2, 1, 1, 4), ("data", "stage", "fsdp", "tensor")))
  assert unit.mesh_axis_names == ("data", "stage", "fsdp", "tensor")
  assert unit.batch_axes == plain.batch_axes
  for part in ("inputs", "grads", "outputs"):
    assert specs(getattr(unit, part)) == specs(getattr(plain, part)), part
  assert unit.objective == pytest.approx(plain.objective, rel=1e-9)
  assert unit.memory_per_device == plain.memory_per_device
  if method is autopar.ShardParallel:
    for size in ("num_nodes", "num_classes", "num_variables", "num_constraints"):
      assert getattr(unit.solver, size) == getattr(plain.solver, size), size
    # The same choices of batch axes were solved, no more.
    assert [p.batch_axes for p in unit.replan.problems] == \
        [p.batch_axes for p in plain.replan.problems]
  for a, b in zip(unit.stages, plain.stages, strict=True):
    assert a.batch_axes == b.batch_axes and specs(a.inputs) == specs(b.inputs)
    assert math.prod(a.submesh_shape) == math.prod(b.submesh_shape)


@pytest.mark.parametrize("sizes", [{"fsdp": 8}, {"data": 2, "tensor": 4}])
def test_maxtext_mesh_of_12_axes_is_planned_as_its_axes_of_size_over_1(sizes):
  """MaxText's 12 axes, one or two of them > 1, once never finished planning
  (2**12 choices of batch axes, and every value's choices over all 12):
  the same problems as on the mesh of its axes of size > 1 alone."""
  shape = tuple(sizes.get(a, 1) for a in MAXTEXT_AXES)
  maxtext = plan_on(autopar.ShardParallel, jax.make_mesh(shape, MAXTEXT_AXES))
  plain = plan_on(autopar.ShardParallel, jax.make_mesh(tuple(sizes.values()),
                                                        tuple(sizes)))
  assert maxtext.batch_axes == plain.batch_axes
  assert specs(maxtext.inputs) == specs(plain.inputs)
  assert maxtext.solver.num_variables == plain.solver.num_variables
  assert maxtext.objective == pytest.approx(plain.objective, rel=1e-9)
  assert len(maxtext.replan.problems) == len(plain.replan.problems)


def test_a_step_on_a_mesh_with_axes_of_size_1_matches_jax_jit():
  """Two steps on a (2, 1, 1, 4) mesh equal single-device jax.jit, with a
  hint, a pin and batch axes that name an axis of size 1: each is taken and
  kept as written (it splits nothing). Auto axes, on which the hint's bare
  spec constrains (on Explicit ones it asserts)."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 1, 1, 4),
                           ("data", "stage", "fsdp", "tensor"))
  rng = np.random.RandomState(0)
  w = {"a": jnp.asarray(rng.randn(8, 16), jnp.float32),
       "b": jnp.asarray(rng.randn(16, 4), jnp.float32)}
  x = jnp.asarray(rng.randn(32, 8), jnp.float32)
  hint = P(None, ("fsdp", "tensor"))

  def step(w, x, hinted=True):
    def loss_fn(w):
      h = x @ w["a"]
      if hinted:
        h = jax.lax.with_sharding_constraint(h, hint)
      return jnp.mean((jnp.tanh(h) @ w["b"]) ** 2)
    loss, g = autopar.value_and_grad(loss_fn)(w)
    return jax.tree.map(lambda a, b: a - 0.1 * b, w, g), loss

  ref, ref_w = [], w
  for _ in range(2):
    ref_w, loss = single_device(lambda w, x: step(w, x, hinted=False))(ref_w, x)
    ref.append((ref_w, loss))
  pin = P("fsdp", "tensor")
  for method in (
      autopar.ShardParallel(mesh=mesh, num_micro_batches=2, option=autopar.AutoShardingOption(
          plan_cache=False, pins={"w['a']": pin})),
      autopar.DataParallel(mesh=mesh, batch_axes=("fsdp", "data"), num_micro_batches=2),
      # Batch axes of size 1 alone (once an XLA error: manual axes of size 1).
      autopar.Zero3Parallel(mesh=mesh, batch_axes=("stage",))):
    p = autopar.parallelize(step, method=method, donate_argnums=())
    out = w
    with jax.set_mesh(mesh):       # the hint's bare spec needs a mesh in context
      for expected in ref:
        out, loss = p(out, x)
        assert_trees_close((out, loss), expected)
      plan = p.get_executable(out, x).plan
    # (Its transpose constrains the cotangent alike.)
    assert plan.hints and all(v.spec == hint for v in plan.hints)
    text = plan.summary()
    assert "fsdp=1" in text and "data: alpha" in text and "fsdp: alpha" not in text
    if isinstance(method, autopar.ShardParallel):
      assert specs(plan.inputs)["w['a']"] == pin
      # Its candidates, the pin first, once each (P(None, "tensor") is the pin).
      candidates = [c.spec for c in plan.explain("w['a']").candidates]
      assert candidates[0] == pin and len(candidates) > 1
      assert not any(autopar.text.same_spec(c, P(None, "tensor")) for c in candidates)
    else:
      assert plan.batch_axes == method.batch_axes
      assert specs(plan.inputs)["x"] == P(method.batch_axes[0] if len(method.batch_axes) == 1
                                         else method.batch_axes)
