"""PipeshardParallel: pipeline stages on submeshes, equal to single-device jit."""

import dataclasses
import math
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopar
from autopar.backend import hlo
from autopar.text import axes_str
from autopar.costs import schedule as sched
from autopar.planner import stage_search as sched_search
from models import (assert_trees_close, boundary_mlp_setup, mlp_setup, moe_setup,
                    partitioned, single_device, transformer_setup)

SGD = optax.sgd(0.1, momentum=0.9)


def mesh24():
  return jax.make_mesh((2, 4), ("data", "model"))


def run_steps(step, make_state, batch, method, steps=1):
  """(parallel result, single-device result) after ``steps`` steps."""
  pf = autopar.parallelize(step, method=method, donate_argnums=(0,))
  ref_fn = single_device(step)
  state, ref = make_state(), make_state()
  for _ in range(steps):
    state, loss = pf(state, batch)
    ref, ref_loss = ref_fn(ref, batch)
  return pf, (state, loss), (ref, ref_loss)


@pytest.mark.parametrize("stages,n,schedule", [(2, 1, "1f1b"), (2, 4, "gpipe"),
                                               (4, 8, "1f1b"), (4, 2, "gpipe"),
                                               (4, 8, "zb-h1")])
def test_mlp_equals_jit(stages, n, schedule):
  make_state, step, batch = mlp_setup(tx=SGD)
  method = autopar.PipeshardParallel(mesh=mesh24(), num_micro_batches=n,
                                     num_stages=stages, schedule=schedule)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")        # n < stages: the bubble warning
    pf, got, want = run_steps(step, make_state, batch, method, steps=2)
  assert_trees_close(got, want)
  plan = pf.get_executable(make_state(), batch).plan
  assert len(plan.stages) == stages and plan.schedule == schedule


@pytest.mark.parametrize("stages,n,schedule", [(2, 2, "1f1b"), (4, 4, "gpipe"),
                                               (2, 4, "zb-h1")])
def test_gpt_equals_jit(stages, n, schedule):
  make_state, step, batch = transformer_setup(tx=SGD, layers=4)
  method = autopar.PipeshardParallel(mesh=mesh24(), num_micro_batches=n,
                                     num_stages=stages, schedule=schedule)
  pf, got, want = run_steps(step, make_state, batch, method, steps=2)
  assert_trees_close(got, want)
  plan = pf.get_executable(make_state(), batch).plan
  # Every stage holds its own blocks' parameters, and the stages cover them all.
  params = [p for st in plan.stages for p in st.params]
  assert len(params) == len(set(params)) == len(jax.tree.leaves(make_state().params))
  assert "pipeline: %d stage(s)" % stages in plan.summary().splitlines()[0]
  if stages == 2:
    # The plan saved, under another method's settings (remat): the stages'
    # passes differ, so the plan's own layout of them (pins) is not
    # followed, its stages are.
    saved = autopar.Plan.from_json(plan.to_json())
    other = autopar.PipeshardParallel(mesh=mesh24(), num_micro_batches=n, num_stages=stages,
                                      schedule=schedule, remat="layers", plan=saved)
    _, got, want = run_steps(step, make_state, batch, other)
    assert_trees_close(got, want)


def test_gpt_model_parallel_stages_equal_jit():
  """Stages whose plans split the weights over the model axis (Megatron)."""
  make_state, step, batch = transformer_setup(tx=SGD, layers=4)
  option = autopar.AutoShardingOption(force_batch_dim_to_mesh_dim="data",
                                      seconds_per_flop=1e-8)
  method = autopar.PipeshardParallel(mesh=mesh24(), num_micro_batches=2, num_stages=2,
                                     stage_mesh_shapes=[(1, 4), (1, 4)], option=option)
  pf, got, want = run_steps(step, make_state, batch, method)
  assert_trees_close(got, want)
  exe = pf.get_executable(make_state(), batch)
  plan = exe.plan
  split = [v for st in plan.stages for v in st.inputs if "model" in str(v.spec)]
  assert split, plan.summary()
  _check_collectives(exe)
  assert "stage 1 pass (each micro-batch)" in plan.summary()


def _check_collectives(exe):
  """The plan names each stage's collectives as its compiled stages run
  them: the gradient sync and the update's by kind and axes, the pass's
  bytes per step within 10 % (the kinds are the stage ILP's: where XLA
  moves the same bytes by another collective, the kinds differ)."""
  planned, compiled = _planned_collectives(exe.plan), _compiled_collectives(exe)
  for key in set(planned) | set(compiled):
    if key[1] != "pass":
      assert planned.get(key) == compiled.get(key), (key, planned, compiled)

  def passes(table):
    out = {}
    for (s, phase, _, _), b in table.items():
      if phase == "pass":
        out[s] = out.get(s, 0) + b
    return out
  assert passes(planned) == pytest.approx(passes(compiled), rel=0.1), (planned, compiled)


def _planned_collectives(plan) -> dict:
  """(stage, phase, kind, axes) -> operand bytes per step, as the plan says."""
  out = {}
  for c in plan.collectives:
    s, phase = re.fullmatch(r"stage (\d+) (pass|gradient sync|update).*", c.stage).groups()
    key = (int(s), phase, c.kind, tuple(c.axes))
    out[key] = out.get(key, 0) + c.bytes * c.per_step
  return out


def _compiled_collectives(exe) -> dict:
  """The same, read from the compiled stages (run once): a forward and a
  backward every micro-batch, a sync and the update once."""
  phases = {"forward": "pass", "backward": "pass", "sync": "gradient sync"}
  out = {}
  for name, compiled in exe.stages.items():
    stage, kind = name.split("/")
    s = int(stage[len("stage"):])
    phase = phases.get(kind, "update")
    runs = exe.plan.num_micro_batches if phase == "pass" else 1
    for c in hlo.collectives(compiled):
      if c.group_size > 1:
        axes = c.mesh_axes(exe.plan.mesh_axis_names, exe.plan.stages[s].submesh_shape)
        key = (s, phase, c.kind, axes)
        out[key] = out.get(key, 0) + c.operand_bytes * c.count * runs
  return out


@pytest.mark.parametrize("stages,n,schedule", [(2, 4, "1f1b"), (4, 8, "gpipe")])
def test_manual_boundaries(stages, n, schedule):
  make_state, step, batch = boundary_mlp_setup()
  method = autopar.PipeshardParallel(mesh=mesh24(), num_micro_batches=n,
                                     num_stages=stages, schedule=schedule,
                                     layers="manual")
  pf, got, want = run_steps(step, make_state, batch, method, steps=2)
  assert_trees_close(got, want)
  plan = pf.get_executable(make_state(), batch).plan
  # Stage s runs layers [a, b) and holds exactly their parameters.
  assert plan.stages[0].layers[0] == 0 and plan.stages[-1].layers[1] == 4
  for st in plan.stages:
    a, b = st.layers
    assert a < b
    want = {f"state['params'][{k}]['{w}']" for k in range(a, b) for w in "wb"}
    assert set(st.params) == want, (st.layers, st.params)


def test_schedule_order_and_activations_held():
  """From a record of what ran: each micro-batch's forward on stage i before
  its forward on stage i + 1 and its backward on stage i, its backward on
  stage i + 1 before that on stage i, and under ZB-H1 its W after its B on
  the same stage; under 1F1B stage i holds at most S - i micro-batches,
  under GPipe all n, under ZB-H1 S on every stage (until their W)."""
  make_state, step, batch = boundary_mlp_setup()
  S, n = 4, 8
  for schedule in sched.SCHEDULES:
    v = 2 if schedule in sched.VIRTUAL_SCHEDULES else 1  # (2 submeshes, 2 stages each)
    method = autopar.PipeshardParallel(mesh=mesh24(), num_micro_batches=n,
                                       num_stages=S // v, virtual_stages=v,
                                       schedule=schedule, layers="manual")
    pf = autopar.parallelize(step, method=method)
    exe = pf.get_executable(make_state(), batch)
    exe.step.recording = True
    pf(make_state(), batch)
    record = exe.step.record
    when = {t: k for k, (t, _) in enumerate(record)}
    split = sched.splits_backward(schedule)
    assert len(record) == (3 if split else 2) * S * n
    for i in range(n):
      for s in range(S):
        assert when[sched.Task("F", s, i)] < when[sched.Task("B", s, i)]
        if split:
          assert when[sched.Task("B", s, i)] < when[sched.Task("W", s, i)]
        if s + 1 < S:
          assert when[sched.Task("F", s, i)] < when[sched.Task("F", s + 1, i)]
          assert when[sched.Task("B", s + 1, i)] < when[sched.Task("B", s, i)]
    peak = [max(h[s] for _, h in record) for s in range(S)]
    assert peak == sched.held_at_most(schedule, S // v, n, v) == \
        [st.in_flight for st in exe.plan.stages]
    # Each submesh ran its tasks in the schedule's order.
    for d, tasks in enumerate(sched.stage_tasks(schedule, S // v, n, v)):
      mine = {st.index for st in exe.plan.stages
              if st.submesh_offset == exe.plan.stages[d].submesh_offset}
      assert [t for t, _ in record if t.stage in mine] == tasks


def test_backward_split_into_input_and_weight_parts_computes_nothing_twice():
  """A stage's backward (two layers) split for zero-bubble schedules: the
  first part gives the input's cotangent, the second the weights'
  gradients from what the first computed on the way (the cotangent between
  the layers), so the matmuls are split between them, none run twice, and
  the two give the whole backward's values."""
  from autopar import jax_compat as jc
  from autopar.frontend.stages import split_input_weight
  rng = np.random.RandomState(0)
  x, w1, w2, ct = (jnp.asarray(rng.randn(*s).astype(np.float32))
                   for s in ((8, 4), (4, 6), (6, 3), (8, 3)))

  _, vjp = jax.vjp(lambda w1, w2, x: jnp.tanh(jnp.tanh(x @ w1) @ w2), w1, w2, x)
  whole = jax.make_jaxpr(vjp)(ct)   # (the forward's values its consts; outputs: the
  parts = split_input_weight(whole, num_roots=2)   # roots' cotangents, the input's)
  dots = lambda j: sum(e.primitive.name == "dot_general" for e in j.jaxpr.eqns)
  assert dots(whole) == 4 and dots(parts.inputs) == 2 and dots(parts.weights) == 2
  assert parts.num_carried > 0
  run = lambda cj, args: jc.eval_jaxpr(cj.jaxpr, cj.consts, *args)
  want = run(whole, [ct])
  b = run(parts.inputs, [ct])
  w = run(parts.weights, [[ct][k] for k in parts.reads] + b[1:])
  for got, ref in zip([*w, b[0]], want, strict=True):
    np.testing.assert_array_equal(got, ref)
  # The plan's pins follow their equations into either part.
  path = next(str(k) for k, e in enumerate(whole.jaxpr.eqns)
              if e.primitive.name == "dot_general")
  b_pins, w_pins = parts.pins({path: "spec"})
  assert len(b_pins) + len(w_pins) == 1


@pytest.mark.parametrize("S,n", [(2, 1), (2, 4), (3, 5), (4, 8), (4, 16)])
def test_schedules_hold_what_they_say(S, n):
  for name in sched.SCHEDULES:
    if name in sched.VIRTUAL_SCHEDULES:
      continue                  # (below: several stages a submesh)
    order = sched.dispatch_order(sched.stage_tasks(name, S, n))
    split = sched.splits_backward(name)
    assert len(order) == (3 if split else 2) * S * n
    assert sched.in_flight(order, S) == sched.held_at_most(name, S, n)
    assert sched.awaiting_weights(order, S) == sched.awaiting_weights_at_most(name, S, n)
    # Every stage alike: a forward 1, a backward 2 (B and W 1 each): the
    # bubble is (S - 1) / (n + S - 1) under 1F1B and GPipe; ZB-H1's
    # stages wait a third as long, (S - 1) (F + B - W), where n >= S.
    t = sched.simulate(sched.stage_tasks(name, S, n),
                       lambda task: 2.0 if task.kind == "B" and not split else 1.0)
    if name == "interleaved-1f1b":
      continue
    if not split:
      assert t.bubble == pytest.approx((S - 1) / (n + S - 1)) == \
          pytest.approx(sched.bubble(name, S, n))
    elif n >= S:
      assert t.bubble == pytest.approx(sched.bubble(name, S, n))
      assert t.makespan == pytest.approx(3 * n + (S - 1))


@pytest.mark.parametrize("S,n,v", [(2, 2, 2), (2, 4, 2), (4, 8, 2), (4, 16, 2), (2, 6, 3)])
def test_interleaved_schedule_divides_the_bubble(S, n, v):
  """Interleaved 1F1B, S submeshes of v stages each: every task once,
  micro-batch by micro-batch through the stages in order, and with every
  stage alike (v times shorter than 1F1B's) the bubble
  (S - 1) / (v n + S - 1); what each stage holds is what the order holds."""
  per = sched.stage_tasks("interleaved-1f1b", S, n, v)
  order = sched.dispatch_order(per)
  assert len(order) == len(set(order)) == 2 * S * v * n
  assert all(sched.submesh_of("interleaved-1f1b", S, t.stage) == d
             for d, tasks in enumerate(per) for t in tasks)
  t = sched.simulate(per, lambda task: 1.0 if task.kind == "F" else 2.0)
  assert t.bubble == pytest.approx((S - 1) / (v * n + S - 1)) == \
      pytest.approx(sched.bubble("interleaved-1f1b", S, n, virtual_stages=v))
  one = sched.simulate(sched.stage_tasks("1f1b", S, n),
                       lambda task: v * (1.0 if task.kind == "F" else 2.0))
  assert t.makespan < one.makespan
  assert sched.in_flight(order, S * v) == sched.held_at_most("interleaved-1f1b", S, n, v)


@pytest.mark.parametrize("S,n", [(2, 1), (2, 3), (3, 5), (4, 8), (4, 16), (5, 10), (6, 7),
                                 (8, 8), (8, 9), (8, 16)])
def test_zb_v_schedule_holds_and_waits_what_it_says(S, n):
  """ZB-V on S submeshes: 2 S stages in a V (submesh d runs stages d and
  2 S - 1 - d), every task once, no submesh ever holding more than 2 S
  stage-micro-batches (1F1B's most: stage 0's S micro-batches of twice the
  layers), and, with every task of one time unit and n >= S, a wait of
  S - 1 units for S <= 4 (only while the first micro-batch goes down: half
  ZB-H1's on the same work), at most S - 4 more beyond, always less than
  ZB-H1's."""
  per = sched.stage_tasks("zb-v", S, n, 2)
  order = sched.dispatch_order(per)
  assert len(order) == len(set(order)) == 3 * 2 * S * n
  for d, tasks in enumerate(per):
    assert {t.stage for t in tasks} == {d, 2 * S - 1 - d}
    assert all(sched.submesh_of("zb-v", S, t.stage) == d for t in tasks)
    held = most = 0
    for t in tasks:
      held += {"F": 1, "B": 0, "W": -1}[t.kind]
      most = max(most, held)
    assert most <= 2 * S
  t = sched.simulate(per, lambda task: 1.0)
  assert t.bubble == pytest.approx(sched.bubble("zb-v", S, n, 2.0, 4.0))
  h1 = sched.simulate(sched.stage_tasks("zb-h1", S, n), lambda task: 2.0)
  if n >= S:
    wait, h1_wait = t.makespan - 6 * n, h1.makespan - 6 * n
    assert S - 1 <= wait <= S - 1 + max(S - 4, 0) and wait < h1_wait
    if S <= 4:
      assert t.bubble == pytest.approx((S - 1) / (6 * n + S - 1))
      assert 2 * wait == pytest.approx(h1_wait)
  assert sched.in_flight(order, 2 * S) == sched.held_at_most("zb-v", S, n, 2)


def test_zb_v_stages_equal_jit():
  """schedule="zb-v": 2 submeshes with 2 stages each in a V (stages 0 and 3
  on the first), equal to jit with a micro-batch count that is not a
  multiple of the submeshes; memory per device is each submesh's stages'
  together, within a budget; the summary says where each stage runs."""
  make_state, step, batch = mlp_setup(batch=24, tx=optax.adam(1e-2), layers=6)
  method = autopar.PipeshardParallel(mesh=mesh24(), num_micro_batches=3, num_stages=2,
                                     schedule="zb-v")
  assert method.virtual_stages == 2
  pf, got, want = run_steps(step, make_state, batch, method)
  assert_trees_close(got, want)
  plan = pf.get_executable(make_state(), batch).plan
  assert [st.submesh_offset for st in plan.stages] == [0, 4, 4, 0]
  assert plan.memory_per_device == max(
      plan.stages[d].memory_per_device + plan.stages[3 - d].memory_per_device
      for d in range(2))
  assert plan.stages[1].send_seconds == 0.0         # the turn: the same submesh
  assert "a V: stages k and 3 - k on submesh k" in plan.summary()
  # Under a budget each submesh's stages together fit it (each held to half).
  budget = int(0.8 * plan.memory_per_device)
  tight = dataclasses.replace(method, option=autopar.AutoShardingOption(
      memory_budget_per_device=budget))
  planned = autopar.parallelize(step, method=tight).plan(jax.eval_shape(make_state), batch)
  assert planned.memory_per_device <= budget
  assert all(st.memory_per_device <= budget / 2 for st in planned.stages)
  for bad, match in [(dict(virtual_stages=3), "it runs 2 stages on each submesh"),
                     (dict(num_stages=1), "on 1 submesh")]:
    with pytest.raises(autopar.InputError, match=match):
      autopar.PipeshardParallel(mesh=mesh24(), schedule="zb-v",
                                **{"num_stages": 2, "num_micro_batches": 4, **bad})


def test_auto_schedule_weighs_interleaved_and_zb_v():
  """With the number of submeshes given, schedule="auto" also plans
  interleaved 1F1B (2 stages a submesh) and ZB-V, keeps the fastest in the
  model (here ZB-V: the least bubble), runs it equal to jit, and runs
  again from its saved plan."""
  make_state, step, batch = mlp_setup(batch=32, tx=optax.adam(1e-2), layers=6)
  method = autopar.PipeshardParallel(mesh=mesh24(), num_micro_batches=4, num_stages=2,
                                     schedule="auto")
  pf, got, want = run_steps(step, make_state, batch, method)
  assert_trees_close(got, want)
  plan = pf.get_executable(make_state(), batch).plan
  weighed = {s: t for s, t, _ in plan.schedule_search}
  assert list(weighed) == ["1f1b", "zb-h1", "interleaved-1f1b", "zb-v"]
  assert plan.schedule == min(weighed, key=weighed.get) == "zb-v"
  assert plan.virtual_stages == 2 and len(plan.stages) == 4
  saved = dataclasses.replace(method, plan=autopar.Plan.from_json(plan.to_json()))
  _, got, want = run_steps(step, make_state, batch, saved)
  assert_trees_close(got, want)
  # With num_stages="auto", ZB-V on each power of two of submeshes up to half
  # the layers (here 2: 4 stages of the 6 layers) is weighed too.
  free = autopar.parallelize(step, method=dataclasses.replace(
      method, num_stages="auto")).plan(make_state(), batch)
  weighed = {s: t for s, t, _ in free.schedule_search}
  assert list(weighed) == ["1f1b", "zb-h1", "zb-v on 2 submeshes"]
  assert weighed["zb-v on 2 submeshes"] == plan.objective
  assert free.objective == min(weighed.values())


def test_auto_micro_batches_weighs_the_divisors_of_the_batch():
  """num_micro_batches="auto" plans the stages for 1, 2, 4, ... micro-batches
  (divisors of the batch) and keeps the fastest plan in the model that fits
  the budget: here the activations of 4 micro-batches or fewer do not. It
  stops once the step time rose twice in a row (here after 32). Each
  figure it records is that number's own plan's; the summary says what
  each took; the plan runs equal to jit, and again from its saved plan."""
  make_state, step, batch = mlp_setup(batch=64, din=64, hidden=512, tx=SGD, layers=4)
  budget = 1.4e6

  def method(n, plan=None, plan_cache=True):
    return autopar.PipeshardParallel(
        mesh=mesh24(), num_micro_batches=n, num_stages=2, plan=plan,
        option=autopar.AutoShardingOption(memory_budget_per_device=budget,
                                          plan_cache=plan_cache))
  with warnings.catch_warnings():
    warnings.simplefilter("error", sched_search.BubbleWarning)
    pf, got, want = run_steps(step, make_state, batch, method("auto"))
  assert_trees_close(got, want)
  plan = pf.get_executable(make_state(), batch).plan
  weighed = {k: t for k, t, _ in plan.micro_batch_search}
  assert list(weighed) == [1, 2, 4, 8, 16, 32, 64]
  fits = {k: t for k, t in weighed.items() if t is not None}
  assert plan.num_micro_batches == min(fits, key=fits.get) and 1 not in fits
  last = max(fits)
  assert fits[last] > fits[last // 2] > fits[last // 4] and last < 64
  assert all(why.startswith("not planned") for k, _, why in plan.micro_batch_search
             if k > last)
  assert plan.memory_per_device <= budget and plan.objective == fits[plan.num_micro_batches]
  other = last
  # (planned anew: the search's plans are in the plan cache)
  alone = autopar.parallelize(step, method=method(other, plan_cache=False)).plan(
      make_state(), batch)
  assert alone.objective == weighed[other]
  why = dict((k, w) for k, _, w in plan.micro_batch_search)
  assert "memory_budget_per_device" in why[1] and why[other].startswith("slower")
  text = plan.summary()
  assert "num_micro_batches='auto'" in text and f"  {plan.num_micro_batches}: " in text
  assert "What the stage search weighed" in plan.to_html() and \
      f"<td>{plan.num_micro_batches} micro-batches</td>" in plan.to_html()
  saved = autopar.Plan.from_json(plan.to_json())
  assert saved.micro_batch_search == plan.micro_batch_search
  _, got, want = run_steps(step, make_state, batch, method("auto", saved))
  assert_trees_close(got, want)
  with pytest.raises(autopar.InputError, match="positive int"):
    autopar.ShardParallel(mesh=mesh24(), num_micro_batches="auto")
  with pytest.raises(autopar.InputError, match="num_stages=1"):
    autopar.PipeshardParallel(mesh=mesh24(), num_micro_batches="auto", num_stages=1)


def test_interleaved_stages_equal_jit():
  """schedule="interleaved-1f1b": 2 submeshes with 2 stages each (stage k on
  submesh k % 2), equal to jit, twice, and again from the saved plan; the
  plan's memory per device is its submeshes' (each the sum of its stages');
  what it cannot do is refused with a fix."""
  make_state, step, batch = transformer_setup(tx=SGD, layers=4)
  method = autopar.PipeshardParallel(mesh=mesh24(), num_micro_batches=4, num_stages=2,
                                     schedule="interleaved-1f1b",
                                     virtual_stages=np.int64(2))   # (saved as an int)
  pf, got, want = run_steps(step, make_state, batch, method, steps=2)
  assert_trees_close(got, want)
  plan = pf.get_executable(make_state(), batch).plan
  assert plan.virtual_stages == 2 and len(plan.stages) == 4
  assert [st.submesh_offset for st in plan.stages] == [0, 4, 0, 4]
  assert plan.memory_per_device == max(
      plan.stages[d].memory_per_device + plan.stages[d + 2].memory_per_device
      for d in range(2))
  assert "2 stages on each of 2 submeshes" in plan.summary()
  html = plan.to_html()
  assert "predicted step time" in html and ">s0,s2<" in html
  saved = autopar.Plan.from_json(plan.to_json())
  assert saved.virtual_stages == 2
  again = dataclasses.replace(method, plan=saved)
  _, got, want = run_steps(step, make_state, batch, again)
  assert_trees_close(got, want)
  for bad, match in [
      (dict(schedule="interleaved-1f1b"), "virtual_stages=2 \\(or more\\)"),
      (dict(schedule="interleaved-1f1b", virtual_stages=2, num_micro_batches=3),
       "not a multiple of it"),
      (dict(schedule="interleaved-1f1b", virtual_stages=2, num_stages=1), "on 1 submesh"),
      (dict(schedule="1f1b", virtual_stages=2), "only 'interleaved-1f1b'"),
      (dict(schedule="interleaved-1f1b", virtual_stages=2, num_stages="auto"),
       "needs the number of submeshes")]:
    with pytest.raises(autopar.InputError, match=match):
      autopar.PipeshardParallel(mesh=mesh24(),
                                **{"num_stages": 2, "num_micro_batches": 4, **bad})


def test_no_gradient_bytes_before_last_micro_batch():
  """A stage's backward pass (every micro-batch) moves no gradient between
  devices; the sync after the last micro-batch reduces them."""
  make_state, step, batch = mlp_setup(tx=SGD)
  method = autopar.PipeshardParallel(mesh=mesh24(), num_micro_batches=4, num_stages=2,
                                     option=autopar.AutoShardingOption(
                                         force_data_parallel=True))
  pf = autopar.parallelize(step, method=method)
  pf(make_state(), batch)
  exe = pf.get_executable(make_state(), batch)
  assert all(st.batch_axes for st in exe.plan.stages)
  text = exe.as_text()
  for s in range(2):
    for kind in ("all-reduce", "reduce-scatter", "all-gather", "all-to-all"):
      assert kind not in text[f"stage{s}/backward"], (s, kind)
    assert "all-reduce" in text[f"stage{s}/sync"] or \
        "reduce-scatter" in text[f"stage{s}/sync"]
  _check_collectives(exe)
  summary = exe.plan.summary()
  axes = axes_str(exe.plan.stages[0].batch_axes)
  assert f"stage 1 gradient sync  all-reduce  {axes}" in summary, summary
  assert f"batch split over {axes} in every stage" in summary


def test_plan_round_trip_and_saved_plan_runs_without_solving(monkeypatch):
  make_state, step, batch = boundary_mlp_setup()
  method = autopar.PipeshardParallel(mesh=mesh24(), num_micro_batches=2, num_stages=2,
                                     layers="manual")
  plan = autopar.parallelize(step, method=method).plan(make_state(), batch)
  loaded = autopar.Plan.from_json(plan.to_json())
  assert loaded.stages == plan.stages and loaded.schedule == "1f1b"
  assert loaded.summary().startswith("pipeline: 2 stage(s)")

  def no_search(*a, **k):
    raise AssertionError("a saved plan was solved again")
  monkeypatch.setattr(autopar.planner.pipeline, "search", no_search)
  saved = autopar.PipeshardParallel(mesh=mesh24(), num_micro_batches=2, layers="manual",
                                    plan=loaded)
  pf, got, want = run_steps(step, make_state, batch, saved)
  assert_trees_close(got, want)
  assert pf.get_executable(make_state(), batch).plan.stages == plan.stages


def test_checkpoint_restores_onto_the_stages(tmp_path):
  """A pipeline's state is saved from its stages (no array copied over the
  whole mesh: the test reads the shardings written); plan.input_shardings
  put each array back on its stage's submesh, and it trains on as if never
  saved."""
  import orbax.checkpoint as ocp
  make_state, step, batch = mlp_setup(tx=SGD)
  method = autopar.PipeshardParallel(mesh=mesh24(), num_micro_batches=2, num_stages=2)
  pf = autopar.parallelize(step, method=method, donate_argnums=(0,))
  state, _ = pf(make_state(), batch)
  path = str(tmp_path / "ckpt")
  autopar.save_checkpoint(path, state)
  written = jax.tree.leaves(ocp.StandardCheckpointer().metadata(path).item_metadata.tree)
  devices = {len(np.asarray(m.sharding.device_mesh.mesh).reshape(-1)) for m in written}
  assert devices == {4}                      # each on its stage's 2 x 2 submesh
  plan = pf.get_executable(state, batch).plan
  shardings = plan.input_shardings[0]
  restored = autopar.restore_checkpoint(path, jax.eval_shape(make_state), shardings)
  for x, s in zip(jax.tree.leaves(restored), jax.tree.leaves(shardings)):
    assert x.sharding == s and len(s.device_set) < 8        # on a stage's submesh
  got = pf(restored, batch)
  ref_fn, ref = single_device(step), make_state()
  for _ in range(2):
    ref, ref_loss = ref_fn(ref, batch)
  assert_trees_close(got, (ref, ref_loss))


def test_which_submeshes_values_can_cross_hosts_between():
  """Across hosts values move between submeshes of the same size, onto a
  part of the source, or between submeshes within one host each; anything
  else is a PlanError before any value moves (checked alike on every host)."""
  import collections
  from autopar.runtime.transfer import check_movable
  Dev = collections.namedtuple("Dev", "id process_index")
  hosts = [[Dev(4 * h + k, h) for k in range(2)] for h in range(4)]   # 4 hosts x 2
  two_hosts = hosts[0] + hosts[1]
  check_movable(two_hosts, hosts[2] + hosts[3])          # 4 -> 4 devices
  check_movable(two_hosts, hosts[0])                     # onto a part
  check_movable(hosts[0], hosts[1][:1])                  # 2 -> 1, one host each
  with pytest.raises(autopar.PlanError, match="spans several hosts"):
    check_movable(two_hosts, hosts[2])                   # 4 (2 hosts) -> 2


def test_one_stage_is_shard_parallel():
  make_state, step, batch = mlp_setup(tx=SGD)
  method = autopar.PipeshardParallel(mesh=mesh24(), num_micro_batches=2, num_stages=1)
  pf, got, want = run_steps(step, make_state, batch, method)
  assert_trees_close(got, want)
  assert pf.get_executable(make_state(), batch).plan.method == "ShardParallel"


def test_auto_stages_on_a_slow_host_axis():
  """Told the outer axis is 12x slower than the inner one, the search
  pipelines over it (one stage per host) rather than all-reduce the
  gradients across it."""
  make_state, step, batch = transformer_setup(tx=SGD, layers=4, d=256, batch=32)
  abstract = jax.eval_shape(lambda: (make_state(), batch))
  mesh = jax.sharding.AbstractMesh((2, 4), ("host", "device"))
  option = autopar.AutoShardingOption(mesh_beta={"host": 1 / 25e9, "device": 1 / 300e9},
                                      mesh_alpha={"host": 1e-5, "device": 1e-6})
  method = autopar.PipeshardParallel(mesh=mesh, num_micro_batches=8, option=option)
  plan = autopar.parallelize(step, method=method).plan(*abstract)
  assert plan.stages, plan.summary()
  # The stages tile the mesh, in order.
  offset = 0
  for st in plan.stages:
    assert st.submesh_offset == offset
    offset += int(np.prod(st.submesh_shape))
  assert offset == 8
  # No stage spans the slow axis: its gradients never cross it. (How many
  # stages per host depends on the compute costs; the roofline's favours
  # more, smaller stages here.)
  assert all(st.submesh_shape[0] == 1 for st in plan.stages)
  assert len(plan.stages) in (2, 4, 8)


def test_errors():
  make_state, step, batch = boundary_mlp_setup(layers=2)
  with pytest.raises(autopar.InputError, match="only 2 layer"):
    autopar.parallelize(step, method=autopar.PipeshardParallel(
        mesh=mesh24(), num_micro_batches=4, num_stages=4,
        layers="manual")).plan(make_state(), batch)
  with pytest.raises(autopar.InputError, match="do not tile"):
    autopar.PipeshardParallel(mesh=mesh24(), num_stages=2,
                              stage_mesh_shapes=[(1, 2), (2, 4)])
  with pytest.raises(autopar.InputError, match="cover 6"):
    autopar.PipeshardParallel(mesh=mesh24(), stage_mesh_shapes=[(1, 4), (1, 2)])
  with pytest.raises(autopar.InputError, match="schedule"):
    autopar.PipeshardParallel(mesh=mesh24(), schedule="interleaved")
  with pytest.raises(autopar.InputError, match="mark_pipeline_boundary"):
    auto_make, auto_step, auto_batch = mlp_setup(tx=SGD)
    autopar.parallelize(auto_step, method=autopar.PipeshardParallel(
        mesh=mesh24(), num_micro_batches=2, num_stages=2,
        layers="manual")).plan(auto_make(), auto_batch)
  with pytest.warns(UserWarning, match="bubble"):
    autopar.parallelize(step, method=autopar.PipeshardParallel(
        mesh=mesh24(), num_micro_batches=1, num_stages=2, schedule="gpipe",
        layers="manual")).plan(make_state(), batch)


def test_boundary_inside_a_loop_is_an_error():
  d = 4
  w = jnp.ones((3, d, d)) * 0.1
  x = np.ones((8, d), np.float32)

  def step(w, x):
    def loss_fn(w):
      def body(h, wk):
        autopar.mark_pipeline_boundary()
        return jnp.tanh(h @ wk), None
      h, _ = jax.lax.scan(body, x, w)
      return jnp.mean(h ** 2)
    loss, g = autopar.value_and_grad(loss_fn)(w)
    return w - 0.1 * g, loss

  with pytest.raises(autopar.MarkerError, match="inside a loop"):
    autopar.parallelize(step, batch_argnums=(1,), method=autopar.PipeshardParallel(
        mesh=mesh24(), num_micro_batches=2, num_stages=2, layers="manual")).plan(w, x)


def test_a_stage_that_reads_fewer_constants_than_the_step():
  """A custom_jvp function closing over an array constant, in the last layer
  only: inlined for the pipeline, the constant is the step's; the first
  stage reads none of it (its ILP read the update's constants misaligned).
  The same happened to Keras's Dropout under PipeshardParallel."""
  c = np.linspace(0.5, 1.5, 64).reshape(8, 8).astype(np.float32)

  @jax.custom_jvp
  def mix(x):
    return jnp.tanh(x @ c)
  mix.defjvp(lambda p, t: (mix(p[0]), (1 - mix(p[0]) ** 2) * (t[0] @ c)))

  def step(ws, x):
    def loss_fn(ws):
      h = x
      for w in ws[:-1]:
        h = jnp.tanh(h @ w)
      return jnp.mean(mix(h @ ws[-1]) ** 2)
    loss, g = autopar.value_and_grad(loss_fn)(ws)
    return [w - 0.1 * gi for w, gi in zip(ws, g)], loss

  ws = [jnp.eye(8) * 0.5 + 0.01 * i for i in range(4)]
  x = jnp.asarray(np.random.RandomState(0).randn(16, 8), jnp.float32)
  method = autopar.PipeshardParallel(mesh=mesh24(), num_micro_batches=2, num_stages=2)
  got = autopar.parallelize(step, method=method, donate_argnums=(), batch_argnums=(1,))(ws, x)
  assert_trees_close(got, single_device(step)(ws, x))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_sharding_hints_are_kept_in_stages(schedule):
  """with_sharding_constraint in the loss function (on the activations, and
  on the mask on its way to the first pass that sums it) and in the update
  is applied by the stage that holds the equation, on its submesh: the
  stage's ILP pins it (constraints.py), its programs apply it
  (``Rules.hint``), no stage splits its batch over an axis a hint puts
  elsewhere. Before, a hint in a pipelined loss was refused, and one in the
  update failed in XLA's verifier (a sharding of 8 devices on a stage's
  4)."""
  P = jax.sharding.PartitionSpec
  wsc = jax.lax.with_sharding_constraint

  def make(act, rows, update):
    def step(w, batch):
      def loss_fn(w):
        h = batch["x"]
        for k in range(4):
          h = act(jnp.tanh(h @ w[k]))
        m = rows(batch["mask"])
        return jnp.sum(jnp.sum(h ** 2, axis=1) * m) / jnp.sum(m)
      loss, g = autopar.value_and_grad(loss_fn)(w)
      return [update(a - 0.1 * b) for a, b in zip(w, g)], loss
    return step

  rng = np.random.RandomState(0)
  w = [jnp.asarray(rng.randn(16, 16) / 4, jnp.float32) for _ in range(4)]
  batch = {"x": rng.randn(32, 16).astype(np.float32),
           "mask": (rng.rand(32) > 0.3).astype(np.float32)}
  same = lambda x: x
  ref_w, ref_loss = single_device(make(same, same, same))(w, batch)
  step = make(lambda h: wsc(h, P(None, "model")), lambda m: wsc(m, P("model")),
              lambda a: wsc(a, P(None, "model")))
  pf = autopar.parallelize(step, method=autopar.PipeshardParallel(
      mesh=mesh24(), num_micro_batches=2, num_stages=2, schedule=schedule),
      donate_argnums=())
  got_w, loss = pf(w, batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_trees_close(got_w, ref_w)
  assert {a.sharding.spec for a in got_w} == {P(None, "model")}
  exe = pf.get_executable(w, batch)
  assert all("model" not in st.batch_axes for st in exe.plan.stages)
  text = exe.as_text()
  for s in range(2):   # the micro-batch's 16 rows, the hidden 16 split four ways
    rows = 16 // math.prod(dict(zip(("data", "model"), exe.plan.stages[s].submesh_shape))[a]
                           for a in exe.plan.stages[s].batch_axes)
    assert re.search(rf"f32\[{rows},4\]\S* tanh\(", text[f"stage{s}/forward"]), s


def test_random_draws_in_the_first_pass():
  """A loss whose weights are drawn (a random keep mask over the rows, as
  token dropping does) and divided by their sum: the first pass draws each
  device's and micro-batch's rows of the whole batch's draw, as the stages'
  forward passes do, so the loss and the update are jit's. Before, such a
  loss was refused under PipeshardParallel. A draw that cannot be cut into
  rows (an rbg key) is still refused: each device would draw its own, and
  the first pass and the stage that draws it for the loss could differ."""
  def step(w, batch, impl="threefry2x32"):
    def loss_fn(w):
      h = batch["x"]
      for k in range(4):
        h = jnp.tanh(h @ w[k])
      keep = jax.random.bernoulli(jax.random.key(3, impl=impl), 0.6, (h.shape[0],))
      weight = batch["mask"] * keep
      return jnp.sum(jnp.sum(h ** 2, axis=1) * weight) / jnp.sum(weight)
    loss, g = autopar.value_and_grad(loss_fn)(w)
    return [a - 0.1 * b for a, b in zip(w, g)], loss

  rng = np.random.RandomState(1)
  w = [jnp.asarray(rng.randn(16, 16) / 4, jnp.float32) for _ in range(4)]
  batch = {"x": rng.randn(32, 16).astype(np.float32),
           "mask": (rng.rand(32) > 0.2).astype(np.float32)}
  ref_w, ref_loss = single_device(step)(w, batch)
  for n, stages in ((2, 2), (4, 4)):
    pf = autopar.parallelize(step, method=autopar.PipeshardParallel(
        mesh=mesh24(), num_micro_batches=n, num_stages=stages), donate_argnums=())
    got_w, loss = pf(w, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_trees_close(got_w, ref_w)
  pf = autopar.parallelize(lambda w, batch: step(w, batch, "rbg"),
                           method=autopar.PipeshardParallel(
                               mesh=mesh24(), num_micro_batches=2, num_stages=2),
                           donate_argnums=())
  with pytest.raises(autopar.InputError, match="PRNG implementation is 'rbg'"):
    pf(w, batch)


def test_draws_in_the_sums_with_a_key_from_the_inputs():
  """Dropout before a MoE router, its key folded with the step's counter (an
  argument): the load-balancing sums read the draw, which the first pass
  and the schedule's forward passes draw alike at each row; two steps
  (two counts) are jit's."""
  step, params, opt, batch = moe_setup(counted=True)
  pf = autopar.parallelize(step, method=autopar.PipeshardParallel(
      mesh=mesh24(), num_micro_batches=2, num_stages=2), batch_argnums=(2,))
  ref = (params, opt)
  got = jax.tree.map(jnp.copy, ref)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")        # (the first pass)
    for count in range(2):
      *got, loss = pf(*got, batch, jnp.int32(count))
      *ref, ref_loss = single_device(step)(*ref, batch, jnp.int32(count))
      np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_trees_close(got[0], ref[0])


@pytest.mark.parametrize("stages,n,schedule", [(2, 2, "1f1b"), (4, 4, "gpipe"),
                                               (2, 4, "zb-h1"), (2, 4, "zb-v")])
def test_parameter_dependent_sums_take_a_first_pass_through_the_stages(stages, n, schedule):
  """The load-balancing loss's cotangents read sums over the batch that
  depend on the parameters (``f_e``, ``P_e``), and the loss's factor too:
  a first pass runs the stages' forward passes alone before the schedule,
  drawing the dropout as the schedule's forward passes do; parameters and
  loss are jit's (under ZB-V too: 4 stages in a V on 2 submeshes, the
  first pass going down and back). Before, PipeshardParallel refused such
  a loss."""
  step, params, opt, batch = moe_setup()
  ref = single_device(step)(params, opt, batch)
  pf = autopar.parallelize(step, method=autopar.PipeshardParallel(
      mesh=mesh24(), num_micro_batches=n, num_stages=stages, schedule=schedule),
      batch_argnums=(2,), donate_argnums=())
  with pytest.warns(UserWarning, match="a first pass runs the stages' forward passes"):
    got = pf(params, opt, batch)
  np.testing.assert_allclose(got[2], ref[2], rtol=1e-5)
  assert_trees_close(got[0], ref[0])
  exe = pf.get_executable(params, opt, batch)
  first = [t for t in exe.schedule if t.startswith("first")]
  ran = sorted({int(t.split("@")[1]) for t in first})
  assert exe.schedule[:len(first)] == first and len(first) == n * len(ran)
  assert [st.first_pass_seconds > 0 for st in exe.plan.stages] == \
      [s in ran for s in range(len(exe.plan.stages))]
  assert "first pass" in exe.plan.summary()
  assert autopar.Plan.from_json(exe.plan.to_json()) == exe.plan


def test_host_callbacks_in_stages(capsys):
  """jax.debug.print and jax.pure_callback inside a stage: JAX lowers a
  host callback only in a computation manual over every mesh axis or none,
  so each stage splits its batch over all of its submesh's axes or none
  (here all: both 2 x 2 submeshes), and the print runs once per
  micro-batch, on the first device. Forcing the batch over some axes is a
  clear error. Before, the stages failed to lower."""
  def step(w, batch):
    def loss_fn(w):
      h = batch["x"]
      for k in range(4):
        h = jnp.tanh(h @ w[k])
        if k == 1:
          jax.debug.print("rows {}", h.shape[0])
          h = h + jax.pure_callback(
              lambda a: np.float32(0.25) * np.ones_like(a),
              jax.ShapeDtypeStruct(h.shape, h.dtype), jax.lax.stop_gradient(h),
              vmap_method="broadcast_all")
      return jnp.mean(h ** 2)
    loss, g = autopar.value_and_grad(loss_fn)(w)
    return [a - 0.1 * b for a, b in zip(w, g)], loss

  rng = np.random.RandomState(1)
  w = [jnp.asarray(rng.randn(16, 16) / 4, jnp.float32) for _ in range(4)]
  batch = {"x": rng.randn(32, 16).astype(np.float32)}
  ref_w, ref_loss = single_device(step)(w, batch)
  jax.effects_barrier()
  capsys.readouterr()
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  method = autopar.PipeshardParallel(mesh=mesh, num_micro_batches=2,
                                     stage_mesh_shapes=[(2, 2), (2, 2)])
  pf = autopar.parallelize(step, method=method, donate_argnums=())
  got_w, loss = pf(w, batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_trees_close(got_w, ref_w)
  jax.effects_barrier()
  assert capsys.readouterr().out.split("\n")[:-1] == ["rows 4"] * 2   # 16 rows / 4 devices
  assert [st.batch_axes for st in pf.get_executable(w, batch).plan.stages] == \
      [("data", "model")] * 2
  forced = autopar.PipeshardParallel(
      mesh=mesh, num_micro_batches=2, stage_mesh_shapes=[(2, 2), (2, 2)],
      option=autopar.AutoShardingOption(force_batch_dim_to_mesh_dim=("data",)))
  with pytest.raises(autopar.InputError, match=r"force_batch_dim_to_mesh_dim=\('data',\)\) "
                     r"splits a pipeline stage's batch over some"):
    autopar.parallelize(step, method=forced, donate_argnums=())(w, batch)


def test_custom_vjp_rules_in_the_loss_are_kept():
  """A jax.custom_vjp in the loss function keeps its rule in a pipeline, as
  jax.jit does: a custom_partitioning op under one (as cuDNN attention is
  built; custom_partitioning has no derivative of its own), and a
  straight-through estimator (round forward, identity backward), whose
  primal derivative is zero. The step is traced at concrete sizes to keep
  them. Before, the first failed with JAX's NotImplementedError and the
  second gave zero gradients through the rounding."""
  scaled_tanh = partitioned(lambda x: jnp.tanh(x) * 1.5)

  @jax.custom_vjp
  def act(x):
    return scaled_tanh(x)
  act.defvjp(lambda x: (scaled_tanh(x), x),
             lambda x, g: (g * 1.5 * (1 - jnp.tanh(x) ** 2),))

  @jax.custom_vjp
  def ste(x):
    return jnp.round(x * 4) / 4
  ste.defvjp(lambda x: (ste(x), None), lambda _, g: (g,))

  def step(w, x):
    def loss_fn(w):
      h = act(x @ w[0])
      h = ste(h @ w[1])
      return jnp.mean(act(h @ w[2]) ** 2)
    loss, g = autopar.value_and_grad(loss_fn)(w)
    return [a - 0.1 * b for a, b in zip(w, g)], loss

  x = np.random.RandomState(0).randn(16, 8).astype(np.float32)
  _three_layers_equal_jit(step, x, autopar.PipeshardParallel(
      mesh=mesh24(), num_micro_batches=2, num_stages=2))


def _three_layers_equal_jit(step, x, method):
  """``step(w, x)`` of three 8 x 8 layers ``w`` under ``method`` gives jit's
  loss and parameters, and changes the first layer (through a
  straight-through estimator in the tests)."""
  rng = np.random.RandomState(0)
  w = [jnp.asarray(rng.randn(8, 8) / 2, jnp.float32) for _ in range(3)]
  ref_w, ref_loss = single_device(step)(w, x)
  pf = autopar.parallelize(step, method=method, donate_argnums=())
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")       # (custom_partitioning: no sharding rule)
    got_w, loss = pf(w, x)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_trees_close(got_w, ref_w)
  assert float(jnp.max(jnp.abs(got_w[0] - w[0]))) > 0     # through the estimator


@pytest.mark.parametrize("schedule,sized", [("1f1b", False), ("gpipe", True)])
def test_custom_jvp_rules_in_the_loss_are_kept(schedule, sized):
  """A pipeline traced at a symbolic batch size keeps the loss function's
  jax.custom_jvp rules (each is written out at a stage's rows when the
  stage is differentiated), as jax.jit does: jax.nn.relu's at exactly 0
  (zero-padded rows), relu6's at its edges, a straight-through estimator
  whose primal derivative is zero, and a custom_partitioning op whose rule
  gives its derivative. Before, each stage differentiated the primal
  equations: relu' (0) = 0.5, zero gradients through the rounding, and
  JAX's NotImplementedError for the op. A rule whose Python compares the
  batch size (``sized``) sends the step to be traced at concrete sizes."""
  scaled_tanh = partitioned(lambda x: jnp.tanh(x) * 1.5)

  @jax.custom_jvp
  def act(x):
    return scaled_tanh(x)

  @act.defjvp
  def _(p, t):
    c = (1.5 if p[0].shape[0] < 1000 else 0.0) if sized else 1.5
    return act(p[0]), t[0] * c * (1 - jnp.tanh(p[0]) ** 2)

  @jax.custom_jvp
  def ste(x):
    return jnp.round(x * 4) / 4
  ste.defjvp(lambda p, t: (ste(p[0]), t[0]))

  def step(w, x):
    def loss_fn(w):
      h = jax.nn.relu(x @ w[0])                 # exactly 0 on the zero rows
      h = act(ste(h @ w[1]))
      p = jax.nn.relu6(6 * jax.nn.sigmoid(h @ w[2]) + 1)
      return jnp.mean(p ** 2 + jnp.abs(h))
    loss, g = autopar.value_and_grad(loss_fn)(w)
    return [a - 0.1 * b for a, b in zip(w, g)], loss

  x = np.random.RandomState(1).randn(16, 8).astype(np.float32)
  x[::3] = 0
  _three_layers_equal_jit(step, x, autopar.PipeshardParallel(
      mesh=mesh24(), num_micro_batches=4, num_stages=2, schedule=schedule))


@pytest.mark.parametrize("rule", ["jvp", "vjp"])
def test_a_draw_inside_a_custom_derivative(rule):
  """Noise drawn inside a custom_jvp's primal: each device gets its rows of
  the whole batch's draw, as jit draws it (the pipeline inlines the loss's
  custom_jvp calls where their bodies draw, as the draw pass does not look
  into them); keeping the call gave each device its own draw. Inside a
  custom_vjp, whose rule only a trace at concrete sizes keeps as a call,
  the draw is refused (it too gave other numbers than jit's)."""
  def noise(x):
    return x + 0.1 * jax.random.normal(jax.random.key(1), x.shape)
  if rule == "jvp":
    noisy = jax.custom_jvp(noise)
    noisy.defjvp(lambda p, t: (noisy(p[0]), t[0]))
  else:
    noisy = jax.custom_vjp(noise)
    noisy.defvjp(lambda x: (noisy(x), None), lambda _, g: (g,))

  def step(w, x):
    def loss_fn(w):
      h = noisy(jnp.tanh(x @ w[0]))
      h = jnp.tanh(h @ w[1])
      return jnp.mean(jnp.tanh(h @ w[2]) ** 2)
    loss, g = autopar.value_and_grad(loss_fn)(w)
    return [a - 0.1 * b for a, b in zip(w, g)], loss

  x = np.random.RandomState(3).randn(16, 8).astype(np.float32)
  method = autopar.PipeshardParallel(mesh=mesh24(), num_micro_batches=2, num_stages=2)
  if rule == "jvp":
    _three_layers_equal_jit(step, x, method)
  else:
    w = [jnp.ones((8, 8), jnp.float32)] * 3
    with pytest.raises(autopar.InputError, match="draws random numbers inside"):
      autopar.parallelize(step, method=method, donate_argnums=())(w, x)


def test_stages_whose_rules_differ_are_planned_apart():
  """Four layers alike but for their custom_jvp rules (each scales its
  gradient by its own constant, which JAX's printed jaxpr does not show):
  the middle stages of a 4-stage pipeline are not taken to compute alike,
  and each layer's gradient is its own rule's, as under jit."""
  def scaled(c):
    @jax.custom_jvp
    def f(x):
      return x

    f.defjvp(lambda p, t: (p[0], t[0] * c))
    return f
  scales = [scaled(c) for c in (1.0, 0.5, 2.0, 3.0)]

  def step(w, x):
    def loss_fn(w):
      h = x
      for k in range(4):
        if k:
          autopar.mark_pipeline_boundary()
        h = scales[k](jnp.tanh(h @ w[k]))
      return jnp.mean(h ** 2)
    loss, g = autopar.value_and_grad(loss_fn)(w)
    return [a - 0.1 * b for a, b in zip(w, g)], loss

  rng = np.random.RandomState(2)
  w = [jnp.asarray(rng.randn(8, 8) / 2, jnp.float32) for _ in range(4)]
  x = rng.randn(16, 8).astype(np.float32)
  ref_w, ref_loss = single_device(step)(w, x)
  pf = autopar.parallelize(step, method=autopar.PipeshardParallel(
      mesh=mesh24(), num_micro_batches=4, num_stages=4, layers="manual"),
      donate_argnums=())
  got_w, loss = pf(w, x)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_trees_close(got_w, ref_w)


def test_a_step_that_needs_its_batch_size_is_traced_at_each_size():
  """A step whose Python compares its batch size (``rows < 1000``) cannot
  be traced at a symbolic size: the pipeline traces it at a micro-batch's
  rows and at each stage's rows per device (here 4: the batch split over
  'model'), checks that the programs are the same equations, and gives
  jit's numbers. A branch taken otherwise at a stage's rows than at the
  micro-batch's is an error that names both sizes. Before, any such step
  was refused."""
  def make(threshold):
    def layer(w, h):           # (the branch inside a jax.checkpoint's body)
      c = 2.0 if h.shape[0] > threshold else 1.5
      return jnp.tanh(h @ w) * c

    def step(w, batch):
      def loss_fn(w):
        h = batch["x"]
        for k in range(4):
          h = jax.checkpoint(layer)(w[k], h)
        return jnp.sum(jnp.sum(h ** 2, axis=1) * batch["mask"]) / jnp.sum(batch["mask"])
      loss, g = autopar.value_and_grad(loss_fn)(w)
      return [a - 0.1 * b for a, b in zip(w, g)], loss
    return step

  rng = np.random.RandomState(1)
  w = [jnp.asarray(rng.randn(16, 16) / 4, jnp.float32) for _ in range(4)]
  batch = {"x": rng.randn(32, 16).astype(np.float32),
           "mask": (rng.rand(32) > 0.2).astype(np.float32)}
  method = autopar.PipeshardParallel(
      mesh=mesh24(), num_micro_batches=2, num_stages=2,
      option=autopar.AutoShardingOption(force_batch_dim_to_mesh_dim=("model",)))
  step = make(threshold=1)
  ref_w, ref_loss = single_device(step)(w, batch)
  pf = autopar.parallelize(step, method=method, donate_argnums=())
  got_w, loss = pf(w, batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_trees_close(got_w, ref_w)
  exe = pf.get_executable(w, batch)
  assert [st.batch_axes for st in exe.plan.stages] == [("model",)] * 2
  # (The mask's sum comes from P at a stage's rows, not a pass through the stages.)
  assert not any(t.startswith("first") for t in exe.schedule)
  pf = autopar.parallelize(make(threshold=6), method=method, donate_argnums=())
  with pytest.raises(autopar.InputError, match="its program at 4 rows is not its "
                     "program at 16 rows"):
    pf(w, batch)


@pytest.mark.parametrize("fraction,zero,schedule", [(0.9, "ZeRO-2", "1f1b"),
                                                    (0.75, "ZeRO-3", "1f1b"),
                                                    (0.8, "ZeRO-3", "zb-h1")])
def test_state_split_in_a_stage_under_a_budget(fraction, zero, schedule):
  """ZeRO inside a stage: under a memory budget that the replicated plan
  exceeds, the stage search counts what splitting a stage's optimizer state
  (ZeRO-2), and then its parameters (ZeRO-3), over its batch axes saves,
  and the stage's ILP splits them; they live split on the stage's submesh
  (ZeRO-3's parameters gathered by each pass, their gradients scattered),
  the plan's memory meets the budget, the summary says so, and two steps
  are jit's (under ZB-H1 too, whose W gathers the parameters again).
  Before, each stage replicated its state over its batch axes and the
  budget was refused."""
  make_state, step, batch = transformer_setup(batch=16, d=64, layers=4, tx=SGD)
  mesh = mesh24()

  def method(budget):
    return autopar.PipeshardParallel(
        mesh=mesh, num_micro_batches=2, num_stages=2, schedule=schedule,
        option=autopar.AutoShardingOption(memory_budget_per_device=budget,
                                          force_batch_dim_to_mesh_dim=("model",)))

  free = autopar.parallelize(step, method=method(None), donate_argnums=())
  replicated = free.get_executable(make_state(), batch).plan
  assert not any(st.zero_state or st.zero_params for st in replicated.stages)
  budget = int(fraction * replicated.memory_per_device)
  pf = autopar.parallelize(step, method=method(budget))   # (state donated: kept in its specs)
  state, ref = make_state(), make_state()
  for _ in range(2):
    state, loss = pf(state, batch)
    ref, ref_loss = single_device(step)(ref, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_trees_close(state.params, ref.params)
  plan = pf.get_executable(make_state(), batch).plan
  assert plan.memory_per_device <= budget
  assert zero in plan.summary()
  split = lambda tree: any("model" in str(x.sharding.spec) and x.ndim == 2
                           for x in jax.tree.leaves(tree))
  assert split(state.opt_state)
  assert any(st.zero_params for st in plan.stages) == (zero == "ZeRO-3")
  assert split(state.params) == (zero == "ZeRO-3")


def test_auto_schedule_keeps_the_faster_plan_that_fits():
  """schedule="auto" plans the stages under 1F1B and under ZB-H1 and keeps
  the one faster in the model: ZB-H1, whose weights' gradients fill most
  of the bubble, unless what it holds more than 1F1B (every stage up to S
  micro-batches, and what each B keeps for its W) does not fit the budget;
  the summary says what each would take, the plan runs as jit, and a saved
  plan names its schedule."""
  make_state, step, batch = transformer_setup(tx=SGD, layers=4, batch=32)

  def plan_of(schedule, budget=None):
    method = autopar.PipeshardParallel(
        mesh=mesh24(), num_micro_batches=8, stage_mesh_shapes=[(1, 2)] * 4,
        schedule=schedule, option=autopar.AutoShardingOption(
            memory_budget_per_device=budget, force_batch_dim_to_mesh_dim=("model",)))
    pf = autopar.parallelize(step, method=method)
    return pf, pf.get_executable(make_state(), batch).plan
  _, one = plan_of("1f1b")
  _, zb = plan_of("zb-h1")
  pf, auto = plan_of("auto")
  assert zb.objective < one.objective
  assert auto.schedule == "zb-h1" and auto.objective == zb.objective
  # (With 4 submeshes, interleaved and ZB-V would need 8 stages: refused.)
  assert [(s, t) for s, t, _ in auto.schedule_search] == [
      ("1f1b", one.objective), ("zb-h1", zb.objective), ("interleaved-1f1b", None),
      ("zb-v", None)]
  assert "only" in auto.schedule_search[3][2] and "layer" in auto.schedule_search[3][2]
  text = auto.summary()
  assert "schedule='auto'" in text and "zb-h1: " in text and "(chosen)" in text
  assert autopar.Plan.from_json(auto.to_json()).schedule_search == auto.schedule_search
  ref_fn, ref = single_device(step), make_state()
  got = pf(make_state(), batch)
  assert_trees_close(got, ref_fn(ref, batch))
  assert any(t.startswith("W") for t in pf.get_executable(make_state(), batch).schedule)
  # A budget 1F1B's plan fits and ZB-H1's does not: 1F1B, and why.
  assert zb.memory_per_device > one.memory_per_device
  budget = (zb.memory_per_device + one.memory_per_device) // 2
  _, tight = plan_of("auto", budget)
  assert tight.schedule == "1f1b" and tight.memory_per_device <= budget
  assert tight.schedule_search[1][0] == "zb-h1" and tight.schedule_search[1][1] is None
  # A saved plan runs under its own schedule; another named one is refused.
  with pytest.raises(autopar.PlanError, match="the saved plan is for schedule 'zb-h1'"):
    other = autopar.PipeshardParallel(mesh=mesh24(), num_micro_batches=8, num_stages=4,
                                      schedule="gpipe", plan=auto)
    autopar.parallelize(step, method=other).get_executable(make_state(), batch)
