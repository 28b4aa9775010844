"""Pipeline stages (PipeshardParallel): bubble, activation memory, bytes
between stages, and the stage search's choice against one-mesh plans.

    python benchmark/pipeline.py            # about two minutes on 2 CPU cores

1. Bubble. An 8-layer MLP (d = 1024, batch 1024; layers marked by hand)
   pipelined over S = 4 submeshes of 2 of the 8 simulated devices with
   n = 8, 16 micro-batches, under 1F1B, GPipe, ZB-H1 (4 stages of 2
   layers), interleaved 1F1B and ZB-V (8 stages of 1 layer, 2 per
   submesh: k and k + 4 interleaved, k and 7 - k in ZB-V's V). Each
   task (one micro-batch's forward, backward, or under ZB-H1 its B and W,
   on one stage) is timed alone, and the
   schedule is replayed on those times (``schedule.simulate``): the bubble
   is the share of the stages' time spent waiting, printed beside its
   theory (``schedule.bubble``), ZB-H1's against 1F1B's (as shares, and as
   seconds waited). On this machine the 8 "devices" share 2 cores, so the
   stages cannot really run at once: the replay says what the schedule does
   with the measured task times.
2. Activation memory. The most bytes of activations (residuals kept for the
   backward pass; under ZB-H1 also what each B keeps for its W) one device
   of each stage held during a step, measured from the arrays the runtime
   kept.
3. Bytes between stages: activations sent forward and cotangents sent
   back, per step.
4. The search. A GPT on an abstract 4-host x 8-device mesh whose host axis
   is told 25 GB/s and its device axis 300 GB/s: the modelled step time of
   the plan num_stages="auto" picks, of ShardParallel on the whole mesh
   (the search's model with one stage, and ShardParallel's own objective),
   and of each hand-picked stage count.
5. Planning time of a 96-layer GPT on an abstract 8 x 8 mesh.
6. Host time per task: a step of 4 stages x 16 micro-batches (a small MLP,
   so that dispatch is what is timed), the time ``PipelineStep.run`` takes
   to return divided by its tasks (forwards and backwards; the syncs and
   the update's segments run too), median of 10 steps; and of it, what is
   neither JAX's dispatch of the compiled functions (the tasks' and the
   sums of cotangents) nor its transfers between submeshes (each timed
   around its call): autopar's own Python.

7. The first pass. A mixture-of-experts block (``models.moe_setup``,
   d=128, 32 tokens, 64 rows, 8 experts) on 2 stages x 4 micro-batches of
   the 8 devices, trained on a token mean (no first pass) and on a token
   mean plus a Switch load-balancing loss times a parameter factor (the
   cotangents read sums that depend on the parameters: a first pass through
   the stages): per loss, the plan's modelled schedule time and first
   pass, and the measured step time (median of 5 steps, both run side by
   side in this process).

8. ZeRO inside stages. A 24-layer GPT (d=256, Adam) on an abstract
   4 hosts x 8 devices mesh, 4 stages x 8 micro-batches: per stage, its
   modelled memory per device with its state replicated over its batch
   axes (no budget) and under budgets of 90 % down to 60 % of that plan's
   largest stage, where the search may split the optimizer state (ZeRO-2)
   and the parameters too (ZeRO-3), with the modelled step time of each
   plan and which stages split what.

    python benchmark/pipeline.py --bubble  # sections 1-3 alone (schedules)
    python benchmark/pipeline.py --host    # section 6 alone
    python benchmark/pipeline.py --first   # section 7 alone
    python benchmark/pipeline.py --zero    # section 8 alone (ZeRO-2/3 in stages)
    python benchmark/pipeline.py --joint [L] [--search-only]  # section 9 (not by default)

9. The joint search (issue 47). A GPT of L = 24 (or 48) layers (d = 512)
   on the abstract 4 x 8 mesh of section 4: the modelled step time of the
   plan with num_stages, schedule and num_micro_batches all "auto" (remat
   is not searched), and its planning time, against every hand combination
   of stages in {1, 2, 4, 8} (under interleaved 1F1B and ZB-V, that many
   submeshes of 2 stages each), schedule, micro-batches in {4, 8, 16} and
   remat in {none, layers}; the figures are the stage search's model
   throughout (one stage: the search's own figure for it). About an hour
   on 2 CPU cores for 24 layers.
"""

import os
import sys
import time
import warnings

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import jax                                        # noqa: E402
import numpy as np                                # noqa: E402
import optax                                      # noqa: E402

import autopar                                    # noqa: E402
from autopar.runtime import pipeline as pipeline_runtime  # noqa: E402
from autopar.costs import schedule as sched    # noqa: E402
from models import boundary_mlp_setup, moe_setup, transformer_setup   # noqa: E402

SGD = optax.sgd(0.1, momentum=0.9)


def measured(S, n, schedule, make_state, step, batch, virtual_stages=1):
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  method = autopar.PipeshardParallel(mesh=mesh, num_micro_batches=n, num_stages=S,
                                     schedule=schedule, layers="manual",
                                     virtual_stages=virtual_stages)
  pf = autopar.parallelize(step, method=method)
  exe = pf.get_executable(make_state(), batch)
  pf(make_state(), batch)                         # compile
  exe.step.timing = True
  pf(make_state(), batch)
  stats = exe.step.stats
  exe.step.timing = False
  return exe, stats


SCHEDULES = (("1f1b", 1), ("gpipe", 1), ("zb-h1", 1), ("interleaved-1f1b", 2), ("zb-v", 2))


def bubble_table():
  S = 4
  make_state, step, batch = boundary_mlp_setup(layers=8, batch=1024, d=1024, tx=SGD)
  print("1. bubble: measured task times replayed on the schedule, and in theory on")
  print("   the same times with every stage alike (1F1B, GPipe: (S-1)/(n+S-1);")
  print("   ZB-H1: stages wait (S-1)(F+B-W) against 1F1B's (S-1)(F+B+W);")
  print("   interleaved, v = 2 stages per submesh: (S-1)/(v n+S-1); ZB-V, 2 stages")
  print("   per submesh in a V: its order replayed on the mean F, B and W)")
  print(f"   {'S':>2} {'n':>3} {'1F1B':>7} {'theory':>7} {'GPipe':>7} {'ZB-H1':>7} "
        f"{'theory':>7} {'inter.':>7} {'theory':>7} {'ZB-V':>7} {'theory':>7} "
        f"{'ZB/1F1B':>8} {'inter./1F1B':>12} {'ZB-V/1F1B':>10}")
  memory = {}
  for n in (8, 16):
    row = {}
    for schedule, v in SCHEDULES:
      exe, stats = measured(S, n, schedule, make_state, step, batch, v)
      d = stats["durations"]
      # Per stage and kind, the median task time (dispatch noise aside).
      med = {}
      for t, sec in d.items():
        med.setdefault((t.stage, t.kind), []).append(sec)
      med = {k: float(np.median(v_)) for k, v_ in med.items()}
      tl = sched.simulate(sched.stage_tasks(schedule, S, n, v),
                          lambda t: med[(t.stage, t.kind)])
      row[schedule] = tl.bubble
      mean = lambda kind: float(np.mean([x for (s, k), x in med.items() if k == kind]))
      if sched.splits_backward(schedule):
        f, b, w = mean("F"), mean("B"), mean("W")
        row[schedule + " theory"] = sched.bubble(schedule, S, n, forward=f, backward=b + w,
                                                 weight_share=w / (b + w))
      memory[(n, schedule)] = (stats["held_bytes_peak"], stats["sent_bytes"],
                               exe.plan.virtual_stages)
    print(f"   {S:>2} {n:>3} {row['1f1b']:>7.3f} {(S - 1) / (n + S - 1):>7.3f} "
          f"{row['gpipe']:>7.3f} {row['zb-h1']:>7.3f} {row['zb-h1 theory']:>7.3f} "
          f"{row['interleaved-1f1b']:>7.3f} {(S - 1) / (2 * n + S - 1):>7.3f} "
          f"{row['zb-v']:>7.3f} {row['zb-v theory']:>7.3f} "
          f"{row['zb-h1'] / row['1f1b']:>8.2f} {row['interleaved-1f1b'] / row['1f1b']:>12.2f} "
          f"{row['zb-v'] / row['1f1b']:>10.2f}")
  print()
  print("2. activation bytes held per device at the peak, per submesh (ZB-H1: until")
  print("   each W, with what its B keeps for it; interleaved and ZB-V: its 2 stages'")
  print("   peaks summed, a bound on the submesh's)")
  for n in (8, 16):
    for schedule, v in SCHEDULES:
      peak, _, v = memory[(n, schedule)]
      per = [sum(on) for on in sched.stages_on(schedule, S, peak)]
      print(f"   S={S} n={n:>2} {schedule:>16}: " +
            ", ".join(f"{b / 2**20:.2f} MiB" for b in per) +
            f"  (most {max(per) / 2**20:.2f} MiB)")
  print()
  print("3. bytes sent between stages per step (activations + cotangents), n = 8")
  for schedule, _ in SCHEDULES:
    sent, = [memory[(8, schedule)][1]]
    print(f"   {schedule:>16}: {sum(sent) / 2**20:.2f} MiB in all (" +
          ", ".join(f"stage {s}: {b / 2**20:.2f}" for s, b in enumerate(sent)) + ")")
  print()


def gpt_on_4x8(layers):
  """A GPT of ``layers`` layers (d = 512, batch 64 x 64 tokens) and the
  abstract 4 hosts x 8 devices mesh of sections 4 and 9 with its costs:
  (step, abstract arguments, mesh, option)."""
  make_state, step, batch = transformer_setup(tx=SGD, layers=layers, d=512, heads=8,
                                              batch=64, seq=64, vocab=512)
  abstract = jax.eval_shape(lambda: (make_state(), batch))
  mesh = jax.sharding.AbstractMesh((4, 8), ("host", "device"))
  # (plan_cache off: the stage search's result and its time are printed)
  option = autopar.AutoShardingOption(mesh_beta={"host": 1 / 25e9, "device": 1 / 300e9},
                                      mesh_alpha={"host": 1e-5, "device": 1e-6},
                                      plan_cache=False)
  return step, abstract, mesh, option


def search_table():
  step, abstract, mesh, option = gpt_on_4x8(8)
  n = 8
  print("4. modelled step time, GPT (8 layers, d=512) on abstract 4 hosts x 8 devices,")
  print("   host axis 25 GB/s, device axis 300 GB/s, 8 micro-batches")

  def piped(num_stages):
    pf = autopar.parallelize(step, method=autopar.PipeshardParallel(
        mesh=mesh, num_micro_batches=n, num_stages=num_stages, option=option))
    t = time.perf_counter()
    plan = pf.plan(*abstract)
    seconds = time.perf_counter() - t
    pipelines = [s.planned_pipeline for s in pf.signatures if s.planned_pipeline]
    result = pipelines[0][2][2] if pipelines else None
    return plan, result, seconds

  auto, result, seconds = piped("auto")
  shard = autopar.parallelize(step, method=autopar.ShardParallel(
      mesh=mesh, num_micro_batches=n, option=option)).plan(*abstract)
  rows = []
  if result is not None:
    for S, (T, _) in sorted(result.by_num_stages.items()):
      rows.append((f"search's best with {S} stage(s)", T))
  for S in (2, 4, 8):
    plan, _, _ = piped(S)
    rows.append((f"num_stages={S} (hand-picked)", plan.objective))
  width = max(len(r[0]) for r in rows) + 2
  chosen = auto.objective if auto.stages else (result.step_time if result else
                                              auto.objective)
  print(f"   {'num_stages=auto: ' + str(max(1, len(auto.stages))) + ' stage(s)':<{width}}"
        f"{chosen * 1e3:9.3f} ms   (planned in {seconds:.1f} s)")
  for name, T in rows:
    print(f"   {name:<{width}}{T * 1e3:9.3f} ms")
  print(f"   {'ShardParallel (its own objective)':<{width}}{shard.objective * 1e3:9.3f} ms")
  if auto.stages:
    print("   chosen: " + "; ".join(
        f"stage {st.index}: layers {st.layers[0]}-{st.layers[1] - 1} on "
        f"{'x'.join(map(str, st.submesh_shape))}" for st in auto.stages))
  print()


def planning_time():
  make_state, step, batch = transformer_setup(tx=SGD, layers=96, d=256, heads=8,
                                              batch=64, seq=32, vocab=256)
  abstract = jax.eval_shape(lambda: (make_state(), batch))
  mesh = jax.sharding.AbstractMesh((8, 8), ("host", "device"))
  option = autopar.AutoShardingOption(mesh_beta={"host": 1 / 25e9, "device": 1 / 300e9},
                                      plan_cache=False)
  pf = autopar.parallelize(step, method=autopar.PipeshardParallel(
      mesh=mesh, num_micro_batches=16, option=option))
  t = time.perf_counter()
  plan = pf.plan(*abstract)
  seconds = time.perf_counter() - t
  print("5. planning a 96-layer GPT for an abstract 8 x 8 mesh with the stage search: "
        f"{seconds:.1f} s -> {max(1, len(plan.stages))} stage(s)")


def host_time_per_task(S=4, n=16, steps=10):
  make_state, step, batch = boundary_mlp_setup(batch=64, d=32, tx=SGD)
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  pf = autopar.parallelize(step, method=autopar.PipeshardParallel(
      mesh=mesh, num_micro_batches=n, num_stages=S, layers="manual"))
  exe = pf.get_executable(make_state(), batch)
  step_obj = exe.step
  spent = {"jax": 0.0}
  call, move, add = step_obj._call, pipeline_runtime.move, pipeline_runtime.add_arrays

  def timed(f):
    def wrapper(*args, **kwargs):
      t = time.perf_counter()
      try:
        return f(*args, **kwargs)
      finally:
        spent["jax"] += time.perf_counter() - t
    return wrapper
  times, ours = [], []
  step_obj._call = timed(call)
  pipeline_runtime.move = timed(move)
  pipeline_runtime.add_arrays = timed(add)
  try:
    for k in range(steps + 2):
      leaves = exe.place(pf._prepare((make_state(), batch)).values)
      spent["jax"] = 0.0
      t = time.perf_counter()
      outs = exe.run(leaves)
      dt = time.perf_counter() - t
      jax.block_until_ready(outs)
      if k >= 2:
        times.append(dt)
        ours.append(dt - spent["jax"])
  finally:
    del step_obj._call
    pipeline_runtime.move = move
    pipeline_runtime.add_arrays = add
  tasks = len(step_obj.order)
  print(f"6. host time per task, {S} stages x {n} micro-batches ({tasks} tasks, plus "
        f"{S} syncs and {len(step_obj.segments)} update segments): "
        f"{np.median(times) / tasks * 1e6:.0f} us, of which autopar's own Python "
        f"{np.median(ours) / tasks * 1e6:.0f} us (run returns in "
        f"{np.median(times) * 1e3:.1f} ms)")


def first_pass_table(steps=5):
  print("\n7. The first pass (2 stages x 4 micro-batches, 8 CPU devices)")
  print(f"{'loss':<40} {'schedule (model)':>17} {'first pass (model)':>19} "
        f"{'step (measured)':>16}")
  warnings.simplefilter("ignore")      # (the first pass's own warning)
  measured_s = {}
  for label, aux, factor in (("token mean", 0.0, False),
                             ("+ load balancing, x parameter factor", 0.01, True)):
    step, params, opt, batch = moe_setup(E=8, V=256, D=128, T=32, B=64, aux=aux,
                                         factor=factor)
    pf = autopar.parallelize(step, method=autopar.PipeshardParallel(
        mesh=jax.make_mesh((2, 4), ("data", "model")), num_micro_batches=4,
        num_stages=2), batch_argnums=(2,), donate_argnums=())
    jax.block_until_ready(pf(params, opt, batch))
    times = []
    for _ in range(steps):
      t0 = time.perf_counter()
      jax.block_until_ready(pf(params, opt, batch))
      times.append(time.perf_counter() - t0)
    plan = pf.get_executable(params, opt, batch).plan
    f = [st.first_pass_seconds for st in plan.stages if st.first_pass_seconds]
    first = sum(f) + (plan.num_micro_batches - 1) * max(f) if f else 0.0
    measured_s[label] = float(np.median(times))
    print(f"{label:<40} {(plan.objective - first) * 1e3:>14.3f} ms "
          f"{first * 1e3:>16.3f} ms {measured_s[label] * 1e3:>13.1f} ms")
  a, b = measured_s.values()
  print(f"measured: the step with the first pass takes {b / a:.2f}x the other's")


def zero_in_stage_table():
  print("\n8. ZeRO inside stages: GPT (24 layers, d=256, Adam) on abstract 4 x 8, "
        "4 stages, 8 micro-batches")
  make_state, step, batch = transformer_setup(tx=optax.adam(1e-3), layers=24, d=256,
                                              heads=8, batch=64, seq=32, vocab=256)
  abstract = jax.eval_shape(lambda: (make_state(), batch))
  mesh = jax.sharding.AbstractMesh((4, 8), ("host", "device"))

  def plan(budget):
    option = autopar.AutoShardingOption(
        mesh_beta={"host": 1 / 25e9, "device": 1 / 300e9}, memory_budget_per_device=budget,
        plan_cache=False)
    pf = autopar.parallelize(step, method=autopar.PipeshardParallel(
        mesh=mesh, num_micro_batches=8, num_stages=4, option=option))
    t = time.perf_counter()
    try:
      p = pf.plan(*abstract)
    except autopar.PlanError as e:
      return None, time.perf_counter() - t, str(e).split(". Fix")[0]
    return p, time.perf_counter() - t, ""

  free, seconds, _ = plan(None)
  top = max(st.memory_per_device for st in free.stages)
  print(f"   {'budget':<22}{'memory per device by stage (MiB)':<40}{'ZeRO-2 / ZeRO-3':<18}"
        f"{'step (model)':>12}")
  for label, budget in (("none (replicated)", None), ("90 % of the largest", 0.9),
                        ("80 % of the largest", 0.8), ("70 % of the largest", 0.7),
                        ("60 % of the largest", 0.6)):
    p, secs, why = (free, seconds, "") if budget is None else plan(int(budget * top))
    if p is None:
      print(f"   {label:<22}no plan: {why[:90]}")
      continue
    mem = ", ".join(f"{st.memory_per_device / 2**20:.2f}" for st in p.stages)
    zero = lambda flag: ",".join(str(st.index) for st in p.stages if flag(st)) or "-"
    which = f"{zero(lambda st: st.zero_state)} / {zero(lambda st: st.zero_params)}"
    print(f"   {label:<22}{mem:<40}{which:<18}{p.objective * 1e3:>9.3f} ms"
          f"   (planned in {secs:.1f} s)")


def joint_table(layers=24, hand=True):
  """Section 9: the joint search against every hand combination."""
  print(f"\n9. The joint search: GPT ({layers} layers, d=512) on abstract 4 hosts x 8 "
        f"devices (host axis 25 GB/s, device axis 300 GB/s), modelled step time")
  step, abstract, mesh, option = gpt_on_4x8(layers)

  def plan(**kw):
    t = time.perf_counter()
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      try:
        pf = autopar.parallelize(step, method=autopar.PipeshardParallel(
            mesh=mesh, option=option, **kw))
        p = pf.plan(*abstract)
      except (autopar.PlanError, autopar.InputError) as e:
        return None, str(e).split(". Fix")[0], time.perf_counter() - t
    found = [s.planned_pipeline for s in pf.signatures if s.planned_pipeline]
    return p, found[0] if found else None, time.perf_counter() - t

  auto, pipeline, seconds = plan(num_stages="auto", schedule="auto",
                                 num_micro_batches="auto")
  chosen = next(t for _, t, why in auto.micro_batch_search if why == "chosen")
  print(f"   search (num_stages, schedule, num_micro_batches 'auto', remat none): "
        f"{chosen * 1e3:.3f} ms in {seconds:.0f} s: {max(1, len(auto.stages))} "
        f"stage(s), {auto.schedule or '-'}, {auto.num_micro_batches} micro-batch(es)")
  for k, t, why in auto.micro_batch_search:
    print(f"     {k} micro-batch(es): " + (why if t is None else f"{t * 1e3:.3f} ms ({why})"))
  if not hand:
    return
  rows = []
  print(f"   {'stages':>6}  {'schedule':<17}{'n':>3}  {'remat':<7}{'step (model)':>13}")

  def row(*r):
    S, schedule, n, remat, t, why = r
    rows.append(r)
    took = f"{t * 1e3:10.3f} ms" if t is not None else f"refused: {why[:70]}"
    print(f"   {S:>6}  {schedule:<17}{n:>3}  {remat:<7}{took}", flush=True)
  for n in (4, 8, 16):
    for remat in ("none", "layers"):
      # One stage: the search's own figure for it (one stage runs as
      # ShardParallel, planned without the stage search).
      p, found, _ = plan(num_stages="auto", num_micro_batches=n, remat=remat)
      searched = found[2][2] if p is not None and found else None
      one = searched.by_num_stages.get(1) if searched else None
      row(1, "-", n, remat, None if one is None else one[0],
          found if p is None else "no one-stage figure" if one is None else "")
      for S in (2, 4, 8):
        for schedule, v in SCHEDULES:
          p, why, _ = plan(num_stages=S, num_micro_batches=n, remat=remat,
                           schedule=schedule, virtual_stages=v)
          row(S, schedule, n, remat, None if p is None else p.objective,
              why if p is None else "")
  best = min((r for r in rows if r[4] is not None), key=lambda r: r[4])
  print(f"   best hand combination: {best[0]} stage(s), {best[1]}, {best[2]} micro-batches, "
        f"remat {best[3]}: {best[4] * 1e3:.3f} ms; the search's / best: "
        f"{chosen / best[4]:.3f} (goal <= 1.02)")


if __name__ == "__main__":
  if "--joint" in sys.argv:
    rest = [a for a in sys.argv[sys.argv.index("--joint") + 1:] if a.isdigit()]
    joint_table(int(rest[0]) if rest else 24, hand="--search-only" not in sys.argv)
    sys.exit()
  if "--bubble" in sys.argv:
    bubble_table()
    sys.exit()
  if "--host" in sys.argv:
    host_time_per_task()
    sys.exit()
  if "--first" in sys.argv:
    first_pass_table()
    sys.exit()
  if "--zero" in sys.argv:
    zero_in_stage_table()
    sys.exit()
  bubble_table()
  search_table()
  planning_time()
  host_time_per_task()
  first_pass_table()
  zero_in_stage_table()
