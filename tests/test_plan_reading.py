"""Reading a plan: the summary, diff, the HTML report and the command line."""

import functools
import gc
import html.parser
import json
import os
import re
import subprocess
import sys
import textwrap
import types
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopar
from autopar.planner import ilp
from autopar.costs.strategies import enumerate_specs
from autopar.tools.groups import collapse, other_rows, param_rows, path_str
from autopar.text import axes_str, canonical_str, same_spec
from models import transformer_setup

ADAM = optax.adam(1e-3)
P = jax.sharding.PartitionSpec
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")


def abstract(make_state, batch):
  return jax.eval_shape(make_state), batch


@pytest.fixture(scope="module")
def gpt24_planned():
  """A 24-layer GPT with Adam, planned for an abstract 8 x 8 mesh (no plan
  cache: the plan is solved here), and a weak reference to its step, which
  is gone."""
  make_state, step, batch = transformer_setup(tx=ADAM, layers=24, batch=64, d=64)
  mesh = jax.sharding.AbstractMesh((8, 8), ("data", "model"))
  option = autopar.AutoShardingOption(plan_cache=False)
  pf = autopar.parallelize(step, method=autopar.ShardParallel(mesh=mesh, option=option))
  plan = pf.plan(*abstract(make_state, batch))
  ref = weakref.ref(pf)
  del pf
  gc.collect()
  return plan, ref


@pytest.fixture(scope="module")
def gpt24(gpt24_planned):
  return gpt24_planned[0]


@pytest.fixture(scope="module")
def dp_and_megatron():
  """The same GPT planned data-parallel, and by the ILP with the blocks' MLP
  kernels pinned Megatron-style (column then row split over "model")."""
  make_state, step, batch = transformer_setup(tx=ADAM, layers=2)
  mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
  args = abstract(make_state, batch)
  dp = autopar.parallelize(step, method=autopar.DataParallel(mesh=mesh)).plan(*args)
  pins = {}
  for k in range(2):
    path = f"state.params['params']['Block_{k}']['Dense_%d']['kernel']"
    pins[path % 0], pins[path % 1] = P(None, "model"), P("model", None)
  option = autopar.AutoShardingOption(force_batch_dim_to_mesh_dim="data", pins=pins)
  mt = autopar.parallelize(step, method=autopar.ShardParallel(
      mesh=mesh, option=option)).plan(*args)
  return dp, mt


def test_summary_of_a_24_layer_gpt_fits_one_screen(gpt24):
  text = gpt24.summary()
  lines = text.splitlines()
  assert len(lines) <= 60, text
  groups = collapse(param_rows(gpt24))
  for g in groups:                 # every parameter group, named once
    assert sum(line.split()[0] == g.name for line in lines if line.split()) == 1, g.name
  assert any("Block_{0..23}" in line for line in lines)
  # Every parameter is in a group, with Adam's two moments beside it.
  assert sum(len(g) for g in groups) == len(gpt24.grads)
  assert all([r for r, _ in g.first.state] == ["mu", "nu"] for g in groups)
  assert "collectives per step" in text and "memory per device: state" in text
  assert "costs assumed:" in text and "solver: HiGHS" in text
  # The every-leaf table is still there.
  assert len(gpt24.summary(full=True).splitlines()) > 1000


def test_plan_costs_round_trip(gpt24):
  loaded = autopar.Plan.from_json(gpt24.to_json())
  assert loaded.costs == gpt24.costs
  assert set(loaded.costs["beta"]) == {"data", "model"}
  assert loaded.summary() == gpt24.summary()


def test_diff_of_data_parallel_and_megatron_lists_the_kernels(dp_and_megatron):
  dp, mt = dp_and_megatron
  d = autopar.diff(dp, mt)
  rows = {name: (a, b) for name, a, b in d.specs}
  # Collapsed by layer: the two blocks' kernels share one row each.
  base = "state/params/params/Block_{0..1}/"
  assert rows[base + "Dense_0/kernel"] == ("P()", "P(None, 'model')"), str(d)
  assert rows[base + "Dense_1/kernel"] == ("P()", "P('model')"), str(d)
  assert str(d).startswith("a: DataParallel")
  assert not autopar.diff(mt, mt)


def test_parameters_are_what_the_gradients_are_of():
  """The state dict sorts its optimizer state ("opt") before "params": the
  parameters are still the leaves the gradients are of, and the momentum
  sits beside them."""
  from models import boundary_mlp_setup
  make_state, step, batch = boundary_mlp_setup()
  mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
  plan = autopar.parallelize(step, method=autopar.ShardParallel(mesh=mesh)).plan(
      *abstract(make_state, batch))
  rows = param_rows(plan)
  assert len(rows) == len(plan.grads) == 8
  assert all(r.value.name.startswith("state['params']") for r in rows), rows
  assert all([role for role, _ in r.state] == ["trace"] for r in rows)
  assert {g.name for g in collapse(rows)} == {"{0..3}/w", "{0..3}/b"}
  loaded = autopar.Plan.from_json(plan.to_json())
  assert loaded.grad_inputs == plan.grad_inputs and param_rows(loaded) == rows
  assert "parameter (under state/params)" in plan.summary()


def test_collapsed_names_name_exactly_their_members():
  from autopar.plan import ValuePlan
  from autopar.tools.groups import Row
  leaf = lambda name: Row(name=name, value=ValuePlan(name, (4,), "float32", P()))
  groups = collapse([leaf("layer_0/head_1"), leaf("layer_1/head_0")])
  assert sorted(g.name for g in groups) == ["layer_0/head_1", "layer_1/head_0"]
  full = collapse([leaf(f"layer_{i}/head_{j}") for i in range(3) for j in range(2)])
  assert [g.name for g in full] == ["layer_{0..2}/head_{0..1}"]


@pytest.fixture(scope="module")
def megatron_by_ilp():
  """A GPT with wide MLPs, which the ILP splits Megatron-style on its own."""
  make_state, step, batch = transformer_setup(tx=optax.sgd(0.1), layers=2, d=512,
                                              heads=4, batch=16)
  mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
  option = autopar.AutoShardingOption(force_batch_dim_to_mesh_dim="data",
                                      seconds_per_flop=1e-10)
  pf = autopar.parallelize(step, method=autopar.ShardParallel(mesh=mesh, option=option))
  yield pf.plan(*abstract(make_state, batch))   # (explain needs the step kept alive)
  del pf


def test_explain_a_megatron_kernel(megatron_by_ilp):
  plan = megatron_by_ilp
  e = plan.explain("*Block_0/Dense_0/kernel")
  assert e.leaf == "state.params['params']['Block_0']['Dense_0']['kernel']"
  assert same_spec(e.chosen, P(None, "model"))           # the column split
  by_spec = {canonical_str(c.spec): c for c in e.candidates}
  chosen, replicated = by_spec["P(None, 'model')"], by_spec["P()"]
  assert chosen.objective == plan.objective
  assert replicated.objective > chosen.objective           # data parallel: dearer
  for c in e.candidates:
    if c.objective is not None:
      assert c.communication + c.other == pytest.approx(c.objective)
      assert c.memory > 0
  assert "decided by:" in str(e) and "*  P(None, 'model')" in str(e)


def test_cost_if_data_parallel_kernels_costs_more(megatron_by_ilp):
  plan = megatron_by_ilp
  r = plan.cost_if({"*Block_*/Dense_*/kernel": P()})
  assert set(r.pins) == {f"state.params['params']['Block_{k}']['Dense_{j}']['kernel']"
                         for k in range(2) for j in range(2)}
  assert r.after > r.before and r.change > 0
  assert any("Dense_{0..1}/kernel" in name or "Dense_0/kernel" in name
             for name, _, _ in r.diff.specs), str(r)


def test_explain_and_cost_if_after_the_step_is_gone(gpt24_planned):
  """The plan keeps its solved ILP (not the step): explain solves it again
  per spec on a 24-layer GPT for 8 x 8 devices (its time: benchmark/explain.py)."""
  plan, step_ref = gpt24_planned
  assert step_ref() is None                       # the step was collected
  leaf = "state.params['params']['Block_5']['Dense_0']['kernel']"
  e = plan.explain(leaf)
  chosen = next(v.spec for v in plan.inputs if v.name == leaf)
  assert e.leaf == leaf and same_spec(e.chosen, chosen)
  solved = [c for c in e.candidates if c.objective is not None]
  assert len(solved) >= 3, str(e)
  for c in solved:
    assert c.communication + c.other == pytest.approx(c.objective)
    assert c.objective >= plan.objective * (1 - ilp.MIP_GAP), str(e)
  # The leaf shares its choice with the same kernel of the layers alike:
  # each row pins them together, and says so.
  assert len(e.held) >= 10 and all("['Dense_0']['kernel']" in n for n in e.held)
  assert "share its choice" in str(e) and "decided by:" in str(e)
  # Pinning the chosen spec solves to the plan's objective.
  same = plan.cost_if({leaf: chosen})
  assert same.after == pytest.approx(plan.objective, rel=ilp.MIP_GAP)
  assert not same.diff.specs, str(same)
  other = next(c for c in solved if not same_spec(c.spec, chosen))
  r = plan.cost_if({leaf: other.spec})
  assert r.after == pytest.approx(other.objective) and r.before == plan.objective
  assert set(r.held) == set(e.held) and r.diff.specs


def test_cost_if_outside_the_problems_solved_needs_the_step():
  """A spec that no problem solved while planning can give (one that needs
  the batch split over axes not tried) plans the step again while it is
  there, and says what to do once it is gone. A plan read from the plan
  cache reads the ILPs its JSON saved on its first explain: no step needed."""
  make_state, step, batch = transformer_setup(tx=optax.sgd(0.1), layers=1, batch=64)
  mesh = jax.sharding.AbstractMesh((2, 2), ("data", "model"))
  args = abstract(make_state, batch)
  pf = autopar.parallelize(step, method=autopar.ShardParallel(mesh=mesh))
  plan = pf.plan(*args)
  cached = autopar.parallelize(step, method=autopar.ShardParallel(mesh=mesh))
  again = cached.plan(*args)
  # (from the plan cache: its ILPs as saved, not read yet)
  assert again.replan.problems == () and again.replan.saved is not None
  leaf = "state.params['params']['Block_0']['Dense_0']['kernel']"
  spec_of = lambda p: next(v.spec for v in p.inputs if v.name == leaf)
  assert same_spec(again.explain(leaf).chosen, spec_of(plan))
  shape = next(v.shape for v in plan.inputs if v.name == leaf)
  outside = [s for s in enumerate_specs(shape, plan.mesh_axis_names, plan.axis_sizes)
             if not plan.replan.holding({leaf: s})]
  assert outside                                 # (e.g. P('model', 'data'))
  outside = outside[0]
  e = plan.explain(leaf)
  row = next(c for c in e.candidates if same_spec(c.spec, outside))
  assert row.objective is None and row.note == "not in the ILP", str(e)
  assert "not in the ILP" in str(e) and "cost_if" in str(e)
  r = plan.cost_if({leaf: outside})              # planned again, the leaf alone
  assert same_spec(spec_of(r.plan), outside) and r.held == ()
  del pf, cached
  gc.collect()
  assert plan.explain(leaf).candidates           # (its own ILPs: no step needed)
  with pytest.raises(autopar.PlanError, match="is gone"):
    plan.cost_if({leaf: outside})
  cached = autopar.parallelize(step, method=autopar.ShardParallel(mesh=mesh)).plan(*args)
  gc.collect()
  assert str(cached.explain(leaf)) == str(plan.explain(leaf))


def test_explain_the_plan_of_an_executable_after_its_step_is_gone():
  make_state, step, batch = transformer_setup(tx=optax.sgd(0.1), layers=1, batch=16)
  option = autopar.AutoShardingOption(plan_cache=False)
  pf = autopar.parallelize(step, method=autopar.ShardParallel(
      mesh=jax.make_mesh((2, 4), ("data", "model")), option=option))
  plan = pf.get_executable(make_state(), batch).plan
  ref = weakref.ref(pf)
  del pf
  gc.collect()
  assert ref() is None
  e = plan.explain("*Block_0/Dense_0/kernel")
  assert sum(c.objective is not None for c in e.candidates) >= 3, str(e)


def test_a_plan_keeps_no_arrays_for_explain():
  """What the plan keeps to be solved again holds no array: neither the
  step's arguments nor a constant the step closes over."""
  scale = jnp.arange(16.0) + 1.0

  def step(w, batch):
    def loss_fn(w):
      return (((batch["x"] * scale) @ w - batch["y"]) ** 2).mean()
    loss, g = autopar.value_and_grad(loss_fn)(w)
    return w - 0.1 * g, loss
  w = jnp.ones((16, 4))
  batch = {"x": jnp.ones((32, 16)), "y": jnp.ones((32, 4))}
  mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
  option = autopar.AutoShardingOption(plan_cache=False)
  plan = autopar.parallelize(step, method=autopar.ShardParallel(
      mesh=mesh, option=option)).plan(w, batch)
  # Everything it reaches (not through functions: JAX's primitives hold
  # their rules, which reach the whole program's modules).
  seen, todo, arrays = {}, [plan.replan], []
  while todo:
    o = todo.pop()
    if id(o) in seen:
      continue
    seen[id(o)] = o
    if isinstance(o, (jax.Array, np.ndarray)) and np.size(o) > 1:
      arrays.append(o)
    if not isinstance(o, (type, types.ModuleType, types.FunctionType,
                          types.BuiltinFunctionType, types.MethodType, types.CodeType,
                          functools.partial)):
      todo.extend(gc.get_referents(o))
  assert not arrays, arrays
  assert id(scale) not in seen and id(step) not in seen
  assert plan.explain("w").candidates


class _Html(html.parser.HTMLParser):
  def __init__(self):
    super().__init__()
    self.text, self.ids, self.urls, self.tags = [], [], [], []

  def handle_starttag(self, tag, attrs):
    self.tags.append(tag)
    for k, v in attrs:
      if k == "id":
        self.ids.append(v)
      # A link within the page (to a picture, "#sharding-3") is no reference out.
      if (k in ("src", "href") and not (v or "").startswith("#")) or (
          v and re.search(r"https?://|//\w", v)):
        self.urls.append((k, v))

  def handle_data(self, data):
    self.text.append(data)


def test_html_report_is_self_contained(dp_and_megatron, tmp_path):
  _, plan = dp_and_megatron
  path = tmp_path / "plan.html"
  text = plan.to_html(str(path))
  assert path.read_text() == text
  p = _Html()
  p.feed(text)
  body = "".join(p.text)
  for g in collapse(param_rows(plan)):
    assert g.name in body, g.name
  values = [v for r in param_rows(plan) for v in (r.value, r.grad, *(s for _, s in r.state))]
  values += [v for v in plan.inputs]
  distinct = {(autopar.plan.spec_str(v.spec), len(v.shape)) for v in values}
  pictures = [i for i in p.ids if i.startswith("sharding-")]
  assert len(pictures) == len(set(pictures)) == len(distinct)
  assert not p.urls and "http" not in text and "<script" not in text
  assert p.tags.count("details") >= len(collapse(param_rows(plan)))


def test_html_report_of_a_pipeline_shows_stages_and_schedule():
  from models import boundary_mlp_setup
  make_state, step, batch = boundary_mlp_setup()
  mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
  plan = autopar.parallelize(step, method=autopar.PipeshardParallel(
      mesh=mesh, num_micro_batches=4, num_stages=2, layers="manual")).plan(
          *abstract(make_state, batch))
  text = plan.to_html()
  assert "Pipeline stages" in text and "Schedule (1f1b)" in text
  summary = plan.summary()
  each = plan.stages[0].batch_axes
  assert all(st.batch_axes == each for st in plan.stages)
  assert f"batch split over {axes_str(each)} in every stage" in summary, summary
  assert "memory per device: stage 0 " in summary and ", stage 1 " in summary
  assert "on a 1x4 submesh" in text      # stage inputs are pictured on their submesh
  assert text.count("<rect") > 8 * 2       # the stages' devices and the tasks
  with pytest.raises(autopar.PlanError, match="stage search.*Fix: plan the step with "
                     "ShardParallel"):
    plan.explain("*w")


STEP = textwrap.dedent('''
    import jax, jax.numpy as jnp, autopar

    def step(params, batch):
      def loss(p):
        return jnp.mean((batch["x"] @ p["w"] - batch["y"]) ** 2)
      value, grads = autopar.value_and_grad(loss)(params)
      return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

    def make_args():
      f = jnp.float32
      return ({"w": jax.ShapeDtypeStruct((16, 4), f)},
              {"x": jax.ShapeDtypeStruct((32, 16), f), "y": jax.ShapeDtypeStruct((32, 4), f)})
''')


def _env(cache=None) -> dict:
  """The environment of a second process: this checkout's autopar (not an
  installed one) and the tests' models importable, a plan cache of its own."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([ROOT, TESTS, os.environ.get("PYTHONPATH", "")]))
  if cache is not None:
    env["AUTOPAR_CACHE_DIR"] = str(cache)
  return env


def _cli(*args, cwd, cache=None):
  return subprocess.run([sys.executable, "-m", "autopar", *args], cwd=cwd,
                        env=_env(cache), capture_output=True, text=True, timeout=300)


def _cli_here(*args, cwd, monkeypatch, capsys):
  """``_cli`` in this process (``tools.cli.main``, as ``python -m autopar``
  calls it): a second process for each verb would cost its imports again."""
  from autopar.tools.cli import main
  monkeypatch.chdir(cwd)
  monkeypatch.setattr(sys, "path", list(sys.path))   # (--step imports from cwd)
  capsys.readouterr()
  try:
    code = main(list(args))
  except SystemExit as e:                             # (argparse's --help)
    code = e.code
  out = capsys.readouterr()
  return subprocess.CompletedProcess(args, code, out.out, out.err)


def test_every_cli_verb_runs(dp_and_megatron, tmp_path, monkeypatch, capsys, request):
  """The command itself (a process of its own: a plan solved, and a reader
  that goes away), and every verb and error through its entry point."""
  dp, mt = dp_and_megatron
  request.addfinalizer(lambda: sys.modules.pop("mystep", None))  # (--step imports it)
  here = functools.partial(_cli_here, monkeypatch=monkeypatch, capsys=capsys)
  (tmp_path / "a.json").write_text(dp.to_json())
  (tmp_path / "b.json").write_text(mt.to_json())
  (tmp_path / "mystep.py").write_text(STEP)
  r = _cli("plan", "mystep:step", "--mesh", "4x2", "--args", "mystep:make_args",
           "-o", "p.json", cwd=tmp_path, cache=tmp_path / "cache")   # (solved here)
  assert r.returncode == 0, r.stderr
  assert "Running HiGHS" not in r.stdout + r.stderr  # its banner is off
  assert autopar.Plan.from_json((tmp_path / "p.json").read_text()).mesh_shape == (4, 2)
  for args in (["show", "a.json"], ["show", "p.json", "--full"], ["diff", "a.json", "b.json"],
               ["report", "b.json", "-o", "b.html"], ["explain", "b.json", "*kernel"],
               ["--help"], ["plan", "--help"]):
    r = here(*args, cwd=tmp_path)
    assert r.returncode == 0, (args, r.stderr)
  assert "autopar plan: DataParallel" in here("show", "a.json", cwd=tmp_path).stdout
  assert (tmp_path / "b.html").read_text().startswith("<!DOCTYPE html>")
  r = here("explain", "p.json", "params/w", "--step", "mystep:step", "--args",
           "mystep:make_args", cwd=tmp_path)
  assert r.returncode == 0, r.stderr
  assert "decided by:" in r.stdout and "params['w']" in r.stdout

  (tmp_path / "bad.json").write_text('{"format": 2, "method"')
  for args, name in ((["show", "missing.json"], "missing.json"),
                     (["diff", "a.json", "bad.json"], "bad.json"),
                     (["report", "bad.json"], "bad.json"),
                     (["plan", "nomodule:step", "--mesh", "8", "--args", "x:y"], "nomodule")):
    r = here(*args, cwd=tmp_path)
    assert r.returncode == 2, (args, r.stdout, r.stderr)
    assert name in r.stderr and "Traceback" not in r.stderr, r.stderr
  # autopar's own errors whole, with their fix; the traceback on request.
  args = ["plan", "mystep:step", "--mesh", "4", "--args", "mystep:make_args",
          "--method", "DataParallel", "--num-micro-batches", "3"]    # 32 rows
  r = here(*args, cwd=tmp_path)
  assert r.returncode == 2 and "Fix:" in r.stderr and "Traceback" not in r.stderr, r.stderr
  r = here(*args, "--traceback", cwd=tmp_path)
  assert r.returncode == 2 and "Traceback" in r.stderr and "Fix:" in r.stderr, r.stderr
  # A reader that goes away (`| head`) ends the output quietly.
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  r = subprocess.run(f"{sys.executable} -m autopar show --full b.json | true", shell=True,
                     cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  assert r.stderr == "", r.stderr


@pytest.mark.parametrize("tx", ["sgd", "adamw", "chain"])
def test_an_nnx_steps_summary_names_its_parameters_and_their_state(tx):
  """An NNX module's leaves (``model.l1.kernel.value``) and its gradients'
  (an nnx.State: ``['l1']['kernel'].value``) spell their keys differently:
  the kernels are parameters, AdamW's mu and nu their state, the memory
  line's state not empty."""
  from flax import nnx

  class Mlp(nnx.Module):
    def __init__(self, rngs):
      self.l1, self.l2 = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
      return self.l2(jax.nn.relu(self.l1(x)))

  model = Mlp(nnx.Rngs(0))
  opt = nnx.Optimizer(model, {
      "sgd": optax.sgd(0.1), "adamw": optax.adamw(1e-3),
      "chain": optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))}[tx],
                      wrt=nnx.Param)

  def step(model, opt, x, y):
    loss, grads = autopar.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    opt.update(model, grads)
    return loss

  pf = autopar.parallelize(step, method=autopar.DataParallel(
      mesh=jax.sharding.AbstractMesh((8,), ("data",))), batch_argnums=(2, 3))
  plan = pf.plan(model, opt, jnp.ones((16, 8)), jnp.ones((16, 4)))
  rows = param_rows(plan)
  assert sorted(r.name for r in rows) == [f"l{i}/{w}/value" for i in (1, 2)
                                          for w in ("bias", "kernel")]
  assert all([role for role, _ in r.state] == ([] if tx == "sgd" else ["mu", "nu"])
             for r in rows)
  summary = plan.summary()
  assert "parameter (under model)" in summary and "state 0 B" not in summary, summary


def test_an_equinox_steps_summary_names_its_parameters_and_their_state():
  """An Equinox model as an argument of its own (``model.blocks[0].weight``)
  beside optax's state (``opt_state[0].mu.blocks[0].weight``): the arrays
  are parameters, mu and nu their state; the batch and the count are other
  inputs."""
  eqx = pytest.importorskip("equinox")

  class Mlp(eqx.Module):
    layers: list

    def __init__(self, key):
      k1, k2 = jax.random.split(key)
      self.layers = [eqx.nn.Linear(8, 16, key=k1), eqx.nn.Linear(16, 4, key=k2)]

    def __call__(self, x):
      return self.layers[1](jax.nn.relu(self.layers[0](x)))

  tx = optax.adamw(1e-3)

  def step(model, opt_state, x, y):
    loss, grads = autopar.filter_value_and_grad(
        lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(model)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss

  model = Mlp(jax.random.key(0))
  pf = autopar.parallelize(step, method=autopar.DataParallel(
      mesh=jax.sharding.AbstractMesh((8,), ("data",))))
  plan = pf.plan(model, tx.init(eqx.filter(model, eqx.is_array)), jnp.ones((16, 8)),
                 jnp.ones((16, 4)))
  rows = param_rows(plan)
  assert sorted(path_str(r.value.name) for r in rows) == [
      f"model/layers/{i}/{w}" for i in (0, 1) for w in ("bias", "weight")]
  assert all([role for role, _ in r.state] == ["mu", "nu"] for r in rows)
  assert sorted(r.name for r in other_rows(plan, rows)) == ["opt_state/0/count", "x", "y"]


# -- plans explain themselves: read from JSON, from the plan cache, the step gone ----

SMALL_LEAF = "state.params['params']['Block_1']['Dense_0']['kernel']"


def _small_gpt():
  """A 2-layer GPT with Adam, for an abstract 2 x 4 mesh (the step and its
  arguments)."""
  make_state, step, batch = transformer_setup(tx=ADAM, layers=2)
  mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
  return step, mesh, abstract(make_state, batch)


@pytest.fixture(scope="module")
def small_planned():
  """The 2-layer GPT planned here (no plan cache), its step gone; and its
  explanation of ``SMALL_LEAF`` and ``cost_if`` of another spec for it,
  made from the planner's own problems."""
  step, mesh, args = _small_gpt()
  option = autopar.AutoShardingOption(plan_cache=False)
  pf = autopar.parallelize(step, method=autopar.ShardParallel(mesh=mesh, option=option))
  plan = pf.plan(*args)
  ref = weakref.ref(pf)
  del pf
  gc.collect()
  assert ref() is None
  e = plan.explain(SMALL_LEAF)
  other = next(c.spec for c in e.candidates
               if c.objective is not None and not same_spec(c.spec, e.chosen))
  return plan, e, other, plan.cost_if({SMALL_LEAF: other})


def _explanation(e) -> dict:
  """An explanation as data: what two equal ones share (the numbers to
  compare up to the solver's gap)."""
  return {"leaf": e.leaf, "chosen": canonical_str(e.chosen), "decided_by": e.decided_by,
          "held": list(e.held), "candidates": [
              [canonical_str(c.spec), c.note, c.error, c.objective,
               c.communication, c.other, c.memory] for c in e.candidates]}


def _cost_if(r) -> dict:
  p = r.plan
  return {"pins": {k: canonical_str(v) for k, v in r.pins.items()}, "before": r.before,
          "after": r.after, "held": list(r.held), "diff": str(r.diff),
          "batch_axes": list(p.batch_axes), "memory": p.memory_per_device,
          "specs": [[v.name, canonical_str(v.spec)]
                    for v in (*p.inputs, *p.grads, *p.outputs, *p.intermediates)],
          "collectives": [[c.stage, c.kind, list(c.axes), c.bytes, c.per_step]
                          for c in p.collectives]}


def _assert_same(a: dict, b: dict) -> None:
  """Two explanations (or cost_if results) as data are the same: every
  field equal, the objectives up to the solver's gap."""
  assert a.keys() == b.keys()
  for k in a:
    if k == "candidates":
      assert len(a[k]) == len(b[k]), (a[k], b[k])
      for x, y in zip(a[k], b[k]):
        assert x[:3] == y[:3] and x[6] == y[6], (x, y)
        if x[3] is None:
          assert y[3] is None, (x, y)
        else:
          assert y[3:6] == pytest.approx(x[3:6], rel=ilp.MIP_GAP, abs=1e-12), (x, y)
    elif k in ("before", "after"):
      assert b[k] == pytest.approx(a[k], rel=ilp.MIP_GAP), k
    else:
      assert a[k] == b[k], (k, a[k], b[k])


def test_explain_and_cost_if_of_a_plan_read_from_json(small_planned):
  """A plan read from its JSON, with no step in sight, explains itself as
  the plan the planner made does: its JSON keeps the ILPs it was solved
  with, and what turns their solutions into plans."""
  plan, fresh, other, fresh_if = small_planned
  text = plan.to_json()
  loaded = autopar.Plan.from_json(text)
  assert loaded.replan is not None and loaded == plan
  _assert_same(_explanation(fresh), _explanation(loaded.explain(SMALL_LEAF)))
  r = loaded.cost_if({SMALL_LEAF: other})
  _assert_same(_cost_if(fresh_if), _cost_if(r))
  assert r.after > r.before and r.diff.specs
  # Saved again, a plan read back keeps its ILPs as they were.
  assert json.loads(loaded.to_json())["ilp"] == json.loads(text)["ilp"]
  # What-if plans are plans: their JSON reads back and explains too.
  again = autopar.Plan.from_json(r.plan.to_json())
  assert again == r.plan and again.explain(SMALL_LEAF).candidates


SECOND_PROCESS = textwrap.dedent('''
    """Plans the 2-layer GPT of test_plan_reading.py (the plan cache on: it is
    warm), drops the step, and prints the explanation and cost_if as JSON."""
    import gc, json, sys
    import jax, autopar, test_plan_reading as t

    step, mesh, args = t._small_gpt()
    pf = autopar.parallelize(step, method=autopar.ShardParallel(mesh=mesh))
    plan = pf.plan(*args)
    from_cache = plan.replan.problems == ()   # (not the planner's: the cache's)
    del pf
    gc.collect()
    leaf, other = sys.argv[1], autopar.plan.spec_from_json(json.loads(sys.argv[2]))
    print(json.dumps({"from_cache": from_cache,
                      "explain": t._explanation(plan.explain(leaf)),
                      "cost_if": t._cost_if(plan.cost_if({leaf: other}))}))
''')


def test_explain_and_cost_if_of_a_plan_a_second_process_reads_from_the_cache(
    small_planned, tmp_path, monkeypatch):
  """The second run of a script with a warm plan cache reads the plan, and
  its ILPs, from the cache: explain and cost_if answer there, the step gone,
  as they do on the plan the first run solved."""
  _, fresh, other, _ = small_planned
  monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))
  step, mesh, args = _small_gpt()
  pf = autopar.parallelize(step, method=autopar.ShardParallel(mesh=mesh))
  plan = pf.plan(*args)                        # (solved here, and stored)
  assert len(list((tmp_path / "cache" / "plans").glob("*.json"))) == 1
  solved_here = _explanation(plan.explain(SMALL_LEAF))
  _assert_same(_explanation(fresh), solved_here)
  fresh_if = _cost_if(plan.cost_if({SMALL_LEAF: other}))
  (tmp_path / "second.py").write_text(SECOND_PROCESS)
  r = subprocess.run([sys.executable, "second.py", SMALL_LEAF,
                      json.dumps(autopar.plan.spec_to_json(other))], cwd=tmp_path,
                     env=_env(tmp_path / "cache"), capture_output=True, text=True,
                     timeout=600)
  assert r.returncode == 0, r.stderr
  out = json.loads(r.stdout.splitlines()[-1])
  assert out["from_cache"]
  _assert_same(solved_here, out["explain"])
  _assert_same(fresh_if, out["cost_if"])


def test_cli_explains_a_saved_plan_without_the_step(small_planned, tmp_path):
  plan, fresh, _, _ = small_planned
  (tmp_path / "p.json").write_text(plan.to_json())
  r = _cli("explain", "p.json", path_str(SMALL_LEAF), cwd=tmp_path)
  assert r.returncode == 0, r.stderr
  assert str(fresh) in r.stdout, r.stdout
  # A plan saved without its ILPs lists the leaf, and says why and what to do.
  old = json.loads(plan.to_json())
  del old["ilp"]
  (tmp_path / "old.json").write_text(json.dumps(old))
  r = _cli("explain", "old.json", SMALL_LEAF, cwd=tmp_path)
  assert r.returncode == 0, r.stderr
  assert SMALL_LEAF in r.stdout and "saved without them" in r.stdout, r.stdout
  assert "--step module:function" in r.stdout, r.stdout


def test_a_plan_without_ilps_says_why_and_what_to_do(small_planned, dp_and_megatron):
  """Whatever a plan cannot explain is an autopar error naming why and the
  fix, never numbers from elsewhere."""
  plan, _, _, _ = small_planned
  dp, _ = dp_and_megatron
  for p in (dp, autopar.Plan.from_json(dp.to_json())):
    for call in (lambda: p.explain("*Dense_0/kernel"), lambda: p.cost_if({"*kernel": P()})):
      with pytest.raises(autopar.PlanError, match="this DataParallel plan has none: "
                         "the method's rule.*Fix: plan the step with ShardParallel"):
        call()
  d = json.loads(plan.to_json())
  text = d.pop("ilp")
  with pytest.raises(autopar.PlanError, match="saved without them.*Fix: make the plan "
                     "again"):
    autopar.Plan.from_json(json.dumps(d)).explain(SMALL_LEAF)
  for bad, why in ((text[:-40], "corrupt"), ("zip:" + text[3:], "corrupt"),
                   (_rewritten(text, autopar="0.0.1"), "written by autopar 0.0.1"),
                   (_rewritten(text, format=0), "in format 0")):
    with pytest.raises(autopar.PlanError, match=why + ".*Fix: make the plan again"):
      autopar.Plan.from_json(json.dumps(d | {"ilp": bad})).cost_if({SMALL_LEAF: P()})


def _rewritten(text: str, **changes) -> str:
  """Saved ILPs with some of their header's entries changed."""
  import base64
  import lzma
  data = json.loads(lzma.decompress(base64.b64decode(text[len("xz:"):])))
  data.update(changes)
  return "xz:" + base64.b64encode(lzma.compress(json.dumps(data).encode())).decode()


def test_a_plan_made_within_a_memory_budget_says_its_json_keeps_no_ilp():
  """A budget's constraints count the copies a plan makes of the traced
  step's values, which the JSON does not keep: explaining the plan read
  back says so and what to do, rather than explaining another problem."""
  make_state, step, batch = transformer_setup(tx=optax.sgd(0.1), layers=1, batch=16)
  mesh = jax.sharding.AbstractMesh((2, 2), ("data", "model"))
  option = autopar.AutoShardingOption(memory_budget_per_device=2**30, plan_cache=False)
  pf = autopar.parallelize(step, method=autopar.ShardParallel(mesh=mesh, option=option))
  plan = pf.plan(*abstract(make_state, batch))
  leaf = "state.params['params']['Block_0']['Dense_0']['kernel']"
  assert plan.explain(leaf).candidates              # (with the step: it plans again)
  text = plan.to_json()
  assert "ilp" not in json.loads(text)
  del pf
  gc.collect()
  with pytest.raises(autopar.PlanError, match="memory_budget_per_device"):
    autopar.Plan.from_json(text).explain(leaf)
