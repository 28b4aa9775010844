"""Running a pipelined step: in one process, or on every host worker of a
Ray cluster alike (JAX's multi-controller model: a stage's functions
execute on the hosts that hold its submesh, and are no-ops elsewhere).

One call of :meth:`PipelineStep.run`:

1. places each argument leaf on the submesh of every stage that reads it
   (a parameter on its stage; a batch leaf, as ``[n, M, ...]``, on every
   stage that reads the batch);
2. dispatches the schedule's tasks (``schedule.dispatch_order``): a
   forward sends the activations it makes to the stages that read them with
   ``transfer.move`` to their sharding there, a backward sends the
   cotangents back the same way. Where the schedule splits a backward, its
   ``B`` sends the cotangents and keeps what its ``W`` reads (the
   activations among it) until that ``W`` adds the gradient. Dispatch is asynchronous, so the stages'
   submeshes work at the same time;
3. syncs each stage's gradients once (``sync``) and adds the partial
   gradients of parameters that several stages read (tied embeddings) on
   the parameter's own stage;
4. runs the update's segments (``frontend/apply_segments.py``) in order, each on its stage's
   submesh, moving the few values that cross stages (a global norm);
5. combines the outputs over micro-batches (the loss, per-example outputs).

``record`` keeps what ran, in order, with the micro-batches each stage held
(for the schedule's invariants), when ``recording`` is set; ``stats`` has,
with ``recording`` or ``timing`` set, per stage the most activation bytes
per device it held and the bytes it sent, and with ``timing`` each task's
time (each task then runs alone: for measuring, not for training). Unset
(training), a task's host work is its dispatch: shardings, routes between
stages and constant zeros are made on the first call and kept.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Var
from jax.sharding import NamedSharding, PartitionSpec

from jax.sharding import AbstractMesh

from autopar.gc_pause import gc_paused
from autopar import jax_compat as jc
from autopar.backend.gradients import combine_groups
from autopar.backend.lowering_errors import explained
from autopar.backend.pipeline_build import (ApplySegment, SumsPass, apply_segments,
                                            build_stages, inputs_pass, sums_pass_of)
from autopar.backend.stage_executables import StageExecutables
from autopar.costs.submesh import tile
from autopar.disk import use_compilation_cache
from autopar.errors import PlanError
from autopar.frontend.cut import home_specs
from autopar.frontend.loss import SHARE
from autopar.frontend.pipeline import Prepared
from autopar.frontend.program import Program
from autopar.frontend.split import OutputKind, SplitStep
from autopar.frontend.stages import StageProgram
from autopar.method import PipeshardParallel, axis_sizes_of
from autopar.plan import submesh
from autopar.costs.schedule import Task, dispatch_order, splits_backward, stage_tasks
from autopar.runtime.transfer import check_movable, move

__all__ = ["PipelineStep", "LossSeeds", "PipelineExecutable", "compile_pipeline"]


# Sums of cotangents and of partial gradients (a value several stages read):
# one compiled add, not an eager operation per call.
add_arrays = jax.jit(jnp.add)


def _per_device_bytes(tree) -> int:
  """Bytes one device holds of the arrays in ``tree`` (the most any holds)."""
  total = 0
  for x in jax.tree.leaves(tree):
    if isinstance(x, jax.Array) and x.addressable_shards:   # (none: another host's)
      total += x.addressable_shards[0].data.nbytes
  return total


@dataclasses.dataclass(eq=False)
class LossSeeds:
  """The cotangents of the loss's entries (``P``'s seeded outputs), the
  whole batch's (``loss.py``): ``scale(sums, seeds)`` at the whole batch's
  size, over ``groups`` (micro-batches x devices of the stage that makes
  it) for the entries every group shares. ``owner``: per entry, that
  stage; ``first``: the first pass on one stage, where ``scale`` reads sums
  the parameters do not change (a token count); ``inputs``: the pass for
  the step's arguments it reads. ``through``: where it reads values the
  stages compute (sums that depend on the parameters, a factor that does),
  the outputs of ``P`` that are its sums (combined by ``sum_ops``) then its
  inputs, which a first pass through the stages computes
  (:meth:`PipelineStep.first_pass`)."""
  scale: Any
  kinds: tuple[str, ...]
  seeds: tuple
  owner: tuple[int, ...]
  groups: tuple[int, ...]
  first: SumsPass | None = None
  inputs: SumsPass | None = None
  through: tuple[int, ...] = ()
  sum_ops: tuple[str, ...] = ()
  _constant: dict | None = None
  _fn: Any = None

  @property
  def constant(self) -> bool:
    return self.first is None and self.inputs is None and not self.through

  def values(self, step: "PipelineStep", leaves: Sequence[Any],
             per_stage) -> dict[int, Any]:
    """Per entry, its cotangent on its stage's submesh (``per_stage``: the
    stages' roots and leaves, ``PipelineStep.place``)."""
    if self.constant and self._constant is not None:
      return self._constant
    if self.through:
      sums, inputs = self._through(step, per_stage)
    else:
      sums = self._run(self.first, step, leaves)
      inputs = self._run(self.inputs, step, leaves)
    if self._fn is None:
      scale = self.scale
      self._fn = jax.jit(lambda s, h, t: jc.eval_jaxpr(
          scale.jaxpr, scale.consts, *s, *h, *t))
    c = self._fn(list(sums), list(inputs), list(self.seeds))
    out = {}
    for j, (x, kind, s, g) in enumerate(zip(c, self.kinds, self.owner, self.groups,
                                            strict=True)):
      out[j] = step._on(s, x / g if kind == SHARE else x, PartitionSpec())
    if self.constant:
      self._constant = out
    return out

  def _through(self, step: "PipelineStep", per_stage) -> tuple[list, list]:
    """The sums and inputs ``scale`` reads, from a first pass through the
    stages, on the stage of the last entry: each sum combined over the
    micro-batches and the devices of the stage that makes it; each input
    (the same in every group) as the first group has it."""
    got = step.first_pass(per_stage, self.through)
    where = self.owner[-1] if self.owner else step.num_stages - 1
    ns = len(self.sum_ops)
    out = []
    for k, j in enumerate(self.through):
      xs = got[j]
      x = combine_groups(xs, self.sum_ops[k], None, 1) if k < ns else xs[0][0]
      out.append(step._on(where, x, PartitionSpec()))
    return out[:ns], out[ns:]

  @staticmethod
  def _run(f: SumsPass | None, step: "PipelineStep", leaves: Sequence[Any]) -> list:
    if f is None:
      return []
    args = []
    for k, b, spec in zip(f.leaves, f.batch, f.specs, strict=True):
      x = leaves[k]
      if b:
        x = jnp.reshape(x, (step.n, step.micro, *x.shape[1:]))
      args.append(step._on(f.stage, x, spec))
    return list(f.fn(*args))


@dataclasses.dataclass(eq=False)
class PipelineStep:
  """A pipelined step compiled for one input signature (see the module
  docstring)."""
  split: SplitStep
  program: Program
  stages: list[StageProgram]
  exes: list[StageExecutables]
  segments: list[ApplySegment]
  order: list[Task]
  n: int
  micro: int
  root_home: dict
  final_stage: dict
  finals: dict                      # P output index -> FinalInfo
  apply_consts: tuple
  leaf_home: dict                   # argument leaf -> stage of its update
  home_specs: dict                  # argument leaf -> spec on its home stage
  seeds: LossSeeds | None = None    # the loss's cotangents (per step)
  record: list = dataclasses.field(default_factory=list)
  recording: bool = False
  timing: bool = False
  stats: dict = dataclasses.field(default_factory=dict)
  # Whether JAX's persistent compilation cache is autopar's: then each stage
  # function compiled is kept there however quickly it compiled, so that a
  # second process reads every one (disk.use_compilation_cache).
  keep_compiles: bool = False
  _calls: dict = dataclasses.field(default_factory=dict)
  # Made on the first call and kept (see the module docstring): shardings per
  # (stage, spec), the routes of activations between stages, constant zeros.
  _shardings: dict = dataclasses.field(default_factory=dict, repr=False)
  _routes: Any = dataclasses.field(default=None, repr=False)
  _zeros: dict = dataclasses.field(default_factory=dict, repr=False)

  @property
  def num_stages(self) -> int:
    return len(self.stages)

  # -- placing -------------------------------------------------------------------

  def _on(self, s: int, x, spec):
    sharding = self._shardings.get((s, spec))
    if sharding is None:
      sharding = self._shardings[(s, spec)] = NamedSharding(self.exes[s].layout.mesh, spec)
    return move(x, sharding)

  def _zeros_on(self, key, s: int, shape, dtype, spec):
    """Zeros of ``shape`` on stage ``s``, made once per ``key`` (no task
    donates them)."""
    x = self._zeros.get(key)
    if x is None:
      x = self._zeros[key] = self._on(s, np.zeros(shape, dtype), spec)
    return x

  def routes(self):
    """Per stage's forward output, the stages that read it with the spec
    they read it in; per stage's backward cotangent, the stage that made
    the activation with its spec (computed once)."""
    if self._routes is None:
      consumers: dict[Var, list[int]] = {}
      for s, st in enumerate(self.stages):
        for v in st.acts_in:
          consumers.setdefault(v, []).append(s)
      to = {}
      for s, st in enumerate(self.stages):
        to[s] = [[(c, self.exes[c].act_in_specs[self.stages[c].acts_in.index(v)])
                  for c in consumers.get(v, ())] for v in st.acts_out]
      producer = {v: s for s, st in enumerate(self.stages) for v in st.acts_out}
      back = {}
      for s, st in enumerate(self.stages):
        tangent = [v for v, tg in zip(st.acts_in, st.tangent_in) if tg]
        back[s] = [(v, producer[v],
                    self.exes[producer[v]].act_out_specs[
                        self.stages[producer[v]].acts_out.index(v)]) for v in tangent]
      self._routes = (to, back)
    return self._routes

  def place(self, leaves: Sequence[Any]):
    """Per stage, its roots and leaves on its submesh; per leaf, its array on
    its home stage."""
    program = self.program
    per_stage = []
    home: dict[int, Any] = {}
    for s, (st, ex) in enumerate(zip(self.stages, self.exes, strict=True)):
      L = ex.layout
      roots = []
      for k, spec in zip(st.roots, L.root_specs, strict=True):
        leaf = program.roots[k].leaf
        if leaf is None:
          aval = program.roots[k].var.aval
          roots.append(self._zeros_on(("root", s, k), s, aval.shape, aval.dtype, spec))
        else:
          x = self._on(s, leaves[leaf], spec)
          roots.append(x)
          if self.leaf_home.get(leaf) == s:
            home.setdefault(leaf, x)
      ls = []
      for leaf, spec, b in zip(st.leaves, L.leaf_specs, L.batch_leaf, strict=True):
        x = leaves[leaf]
        if b:
          x = jnp.reshape(x, (self.n, self.micro, *x.shape[1:]))
          ls.append(self._on(s, x, L.batch_leaf_spec()))
        else:
          x = self._on(s, x, spec)
          ls.append(x)
          if self.leaf_home.get(leaf) == s:
            home.setdefault(leaf, x)
      per_stage.append((roots, ls))
    return per_stage, home

  # -- running -------------------------------------------------------------------

  def _call(self, stage: int, what: str, fn, *args):
    """``fn(*args)``, a function of stage ``stage`` named ``stage{s}/{what}``
    (``compiled``); the first call compiles it, and says an op JAX cannot
    lower there with its fix (``lowering_errors.py``)."""
    name = f"stage{stage}/{what}"
    if name in self._calls:
      return fn(*args)
    self._calls[name] = (fn, jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        if isinstance(x, jax.Array) else x, args))
    layout = self.exes[stage].layout
    with explained(self.split.traced.jaxpr.jaxpr, where=f"PipeshardParallel {name}",
                   batch_axes=layout.batch_axes, mesh_axes=layout.mesh.axis_names,
                   pipeline=True):
      return fn(*args)

  def compiled(self) -> dict[str, jax.stages.Compiled]:
    """Every function the last call ran, compiled (``exe.stages``); each
    compiled once."""
    out = {}
    for name, entry in self._calls.items():
      if len(entry) == 2:
        fn, args = entry
        entry = self._calls[name] = (fn, args, fn.lower(*args).compile())
      out[name] = entry[2]
    return out

  def _send_forward(self, s: int, i: int, outs, acts: dict,
                    below: int | None = None) -> tuple[list, int]:
    """Stage ``s``'s forward outputs ``outs`` for micro-batch ``i``: its
    activations moved into ``acts`` for the stages that read them (those
    before ``below`` only, if given). Returns the values of its finals, in
    ``StageProgram.finals`` order, and the bytes it sent."""
    st, ex = self.stages[s], self.exes[s]
    to, _ = self.routes()
    g_out = [None] * len(ex.out_rows)
    for pos, k in enumerate(ex.fns_out_order):
      g_out[k] = outs[pos]
    sent = 0
    for k, v in enumerate(st.acts_out):
      for c, spec in to[s][k]:
        if below is None or c < below:
          acts[(c, i, v)] = self._on(c, g_out[k], spec)
          sent += g_out[k].nbytes
    return g_out[len(st.acts_out):], sent

  def first_stages(self) -> int:
    """How many stages (the first ones) the first pass runs: up to the
    last that makes a value the loss's cotangents read; 0 without one."""
    through = self.seeds.through if self.seeds is not None else ()
    return 1 + max(self.final_stage[j] for j in through) if through else 0

  def first_pass(self, per_stage, outputs: Sequence[int]) -> dict[int, list]:
    """The forward passes alone of every micro-batch through the stages
    that lead to ``outputs`` (of ``P``), dispatched micro-batch by
    micro-batch (the stages work at the same time, as in GPipe's forward
    half): per output, its value for each micro-batch (per device, stacked
    ``[D, ...]``). Nothing is kept for a backward pass."""
    last = self.first_stages()
    wanted = set(outputs)
    acts: dict = {}
    out: dict[int, list] = {j: [] for j in outputs}
    for i in range(self.n):
      for s in range(last):
        st, ex = self.stages[s], self.exes[s]
        roots, ls = per_stage[s]
        a_in = [acts.pop((s, i, v)) for v in st.acts_in]
        outs = self._call(s, "first", ex.first, ex.index[i], roots, a_in, ls)
        made, _ = self._send_forward(s, i, outs, acts, below=last)
        for j, x in zip(st.finals, made, strict=True):
          if j in wanted:
            out[j].append(x)
    return out

  def run(self, leaves: Sequence[Any]) -> list[Any]:
    """Runs one step; returns the flat outputs (as ``Executable.run``). The
    first call compiles the stage functions as it reaches them, each kept
    in JAX's persistent cache where that is autopar's (``keep_compiles``),
    with the garbage collector paused as while planning (``gc_paused``)."""
    if self._calls:
      return self._run_step(leaves)
    with gc_paused():
      if not self.keep_compiles:
        return self._run_step(leaves)
      with jc.persistent_cache_keeps_all():
        return self._run_step(leaves)

  def _run_step(self, leaves: Sequence[Any]) -> list[Any]:
    program, S, n = self.program, self.num_stages, self.n
    per_stage, home = self.place(leaves)
    seeds = self.seeds.values(self, leaves, per_stage)
    _, back = self.routes()
    measuring = self.recording or self.timing
    acts: dict = {}          # (stage, micro-batch, var) -> array on that stage
    cts: dict = {}           # (stage, micro-batch, var) -> cotangent on that stage
    saved: dict = {}         # (stage, micro-batch) -> (outputs, stored)
    after_b: dict = {}       # (stage, micro-batch) -> what its W reads besides
    finals: dict[int, list] = {}
    acc = [ex.init() for ex in self.exes]
    held = [0] * S
    held_bytes, peak_bytes = [0] * S, [0] * S
    sent = [0] * S                 # activation and cotangent bytes each stage sends
    durations: dict = {}
    self.record = []
    for t in self.order:
      if self.timing:
        jax.block_until_ready((acc, acts, cts))
        started = time.perf_counter()
      s, i = t.stage, t.micro_batch
      st, ex = self.stages[s], self.exes[s]
      roots, ls = per_stage[s]
      a_in = [acts[(s, i, v)] for v in st.acts_in]
      if t.kind == "F":
        outs, stored = self._call(s, "forward", ex.forward, ex.index[i], roots,
                                  a_in, ls)
        saved[(s, i)] = (outs, stored)
        if measuring:
          held_bytes[s] += _per_device_bytes((outs, stored))
          peak_bytes[s] = max(peak_bytes[s], held_bytes[s])
        made, nbytes = self._send_forward(s, i, outs, acts)
        sent[s] += nbytes
        for j, x in zip(st.finals, made, strict=True):
          finals.setdefault(j, []).append(x)
        held[s] += 1
      elif t.kind == "W":
        # The weights' half of a split backward: what its B kept.
        outs, stored = saved.pop((s, i))
        ct, seeds_in, carried = after_b.pop((s, i))
        if measuring:
          held_bytes[s] -= _per_device_bytes((outs, stored, ct, carried))
        acc[s] = self._call(s, "backward_weight", ex.backward_weight, ex.index[i],
                            acc[s], roots, a_in, ls, outs, stored, ct, seeds_in,
                            carried)
        for v in st.acts_in:
          acts.pop((s, i, v), None)
        del outs, stored, ct, carried, a_in     # (freed now, not at the next task)
        held[s] -= 1
      else:
        split = ex.backward_weight is not None
        outs, stored = saved[(s, i)] if split else saved.pop((s, i))
        if measuring and not split:
          held_bytes[s] -= _per_device_bytes((outs, stored))
        ct = []
        for k in ex.ct_from_next:
          v = st.acts_out[k]
          x = cts.pop((s, i, v), None)
          if x is None:        # no later stage differentiates it
            like = outs[ex.fns_out_order.index(k)]
            x = self._zeros.get(("ct", s, k))
            if x is None:
              x = self._zeros[("ct", s, k)] = jnp.zeros_like(like)
          ct.append(x)
        seeds_in = [seeds[j] for j in st.seeded_finals]
        if split:
          # Its input cotangents now; its gradient at its W, from what this
          # keeps (the activations stay held until then).
          ct_in, carried = self._call(s, "backward_input", ex.backward_input,
                                      ex.index[i], roots, a_in, ls, outs, stored, ct,
                                      seeds_in)
          after_b[(s, i)] = (ct, seeds_in, carried)
          if measuring:
            held_bytes[s] += _per_device_bytes((ct, carried))
            peak_bytes[s] = max(peak_bytes[s], held_bytes[s])
        else:
          acc[s], ct_in = self._call(s, "backward", ex.backward, ex.index[i],
                                     acc[s], roots, a_in, ls, outs, stored, ct, seeds_in)
        for (v, p, spec), x in zip(back[s], ct_in, strict=True):
          x = self._on(p, x, spec)
          if measuring:
            sent[s] += x.nbytes
          key = (p, i, v)
          cts[key] = x if key not in cts else add_arrays(cts[key], x)
        if not split:
          for v in st.acts_in:
            acts.pop((s, i, v), None)
          held[s] -= 1
      if self.timing:
        jax.block_until_ready((acc, acts, cts, saved, after_b))
        durations[t] = time.perf_counter() - started
      if self.recording:
        self.record.append((t, tuple(held)))
    self.stats = ({"held_bytes_peak": peak_bytes, "sent_bytes": sent,
                   "durations": durations} if measuring else {})
    # Gradients: synced once per stage, partial sums added on the root's home.
    root_grads: dict[int, Any] = {}
    for s, (st, ex) in enumerate(zip(self.stages, self.exes, strict=True)):
      grads = self._call(s, "sync", ex.sync, acc[s])
      for k, g in zip(st.roots, grads, strict=True):
        h = self.root_home[k]
        if h != s:
          g = self._on(h, g, self.exes[h].grad_specs[self.stages[h].roots.index(k)])
        root_grads[k] = g if k not in root_grads else add_arrays(root_grads[k], g)
    del acc
    # Outputs of P, combined over micro-batches.
    combined = {}
    for j, xs in finals.items():
      info = self.finals[j]
      if info.op is None and info.row_dim is None:
        continue
      s = self.final_stage[j]
      groups = n * self.exes[s].layout.devices
      combined[j] = combine_groups(xs, info.op, info.row_dim, groups)
    # The update, segment by segment.
    aj = self.split.apply.jaxpr
    nc, nl = len(self.apply_consts), len(program.leaves)
    env: dict = {}
    for v, x in zip(aj.invars[:nc], self.apply_consts, strict=True):
      env[v] = (None, x)
    for k in range(nl):
      v = aj.invars[nc + k]
      if k in home:
        env[v] = (self.leaf_home[k], home[k])
      elif k in self.home_specs and k in self.leaf_home:
        h = self.leaf_home[k]
        env[v] = (h, self._on(h, leaves[k], self.home_specs[k]))
      elif not program.leaves[k].is_batch:
        env[v] = (None, leaves[k])
    ng = len(program.grad_roots)
    for g, k in enumerate(program.grad_roots):
      v = aj.invars[nc + nl + g]
      if k not in root_grads:     # a parameter no stage reads: its gradient is zero
        # (made each step: the step may return it, and a caller may donate it)
        root_grads[k] = self._on(self.root_home[k], np.zeros(v.aval.shape, v.aval.dtype),
                                 PartitionSpec())
      env[v] = (self.root_home[k], root_grads[k])
    base = program.num_seeded
    for r, v in enumerate(aj.invars[nc + nl + ng:]):
      j = base + r
      env[v] = (self.final_stage[j], combined[j])
    for k, a in enumerate(self.segments):
      seg = a.segment
      s = seg.stage
      args = []
      for v in seg.inputs:
        where, x = env[v]
        if where is not None and where != s or where is None and isinstance(x, jax.Array):
          x = self._on(s, x, PartitionSpec())
        elif where is None:
          x = self._on(s, np.asarray(x), PartitionSpec())
        args.append(x)
      outs = self._call(s, f"apply{k}", a.fn, *args)
      for v, x in zip(seg.outputs, outs, strict=True):
        env[v] = (s, x)
    apply_outs = []
    for v in aj.outvars:
      if isinstance(v, Var):
        apply_outs.append(env[v][1])
      else:
        apply_outs.append(np.asarray(v.val))
    micro_base = base + len(self.split.reduced)
    outs = []
    for kind, idx in zip(self.split.out_kinds, self.split.out_index, strict=True):
      outs.append(apply_outs[idx] if kind is OutputKind.APPLY
                  else combined[micro_base + idx])
    return outs


# -- building the step -------------------------------------------------------------

def compile_pipeline(pre: Prepared, method: PipeshardParallel, mesh, cut_,
                     choices, schedule: str, virtual_stages: int = 1) -> PipelineStep:
  """The runnable pipeline for the stages ``choices`` of ``cut_``, run under
  ``schedule`` (the plan's: the method's may be ``"auto"``) with
  ``virtual_stages`` stages on each submesh."""
  ctx = pre.ctx
  program = ctx.program
  split = pre.split
  if isinstance(mesh, AbstractMesh):
    raise PlanError("PipeshardParallel: the mesh is an AbstractMesh, which can be "
                    "planned for but not run on. Fix: use .plan(*args) to plan, and "
                    "run with a concrete mesh.")
  num_submeshes = len(choices) // virtual_stages
  tile(tuple(axis_sizes_of(mesh).values()), [c.shape for c in choices[:num_submeshes]])
  # Across hosts: stages that may exchange values (any two: activations,
  # shared parameters, their gradients) must be movable between.
  meshes = [submesh(mesh, c.offset, c.shape) for c in choices]
  for s, a in enumerate(meshes):
    for t, b in enumerate(meshes[s + 1:], s + 1):
      check_movable(a.devices.flat, b.devices.flat,
                    what=f"a value of stage {s} (to or from stage {t})")
  keep_compiles = use_compilation_cache()
  exes = build_stages(pre, mesh, cut_, choices, split_backward=splits_backward(schedule))
  homes = home_specs(ctx, cut_, choices)
  segments = apply_segments(pre, cut_, exes, homes)
  order = dispatch_order(stage_tasks(schedule, num_submeshes, ctx.n, virtual_stages))
  return PipelineStep(
      seeds=_loss_seeds(pre, cut_, exes),
      split=dataclasses.replace(split, apply=ctx.apply), program=program,
      stages=list(cut_.stages), exes=exes, segments=segments, order=order, n=ctx.n,
      micro=ctx.micro, root_home=dict(cut_.root_home),
      final_stage=dict(cut_.final_stage), finals=pre.finals,
      apply_consts=tuple(ctx.consts), leaf_home=dict(cut_.leaf_home),
      home_specs=homes, keep_compiles=keep_compiles)


def _loss_seeds(pre: Prepared, cut_, exes) -> LossSeeds:
  """How a pipelined step seeds the loss's entries (``loss.py``): with the
  whole batch's cotangents, over the micro-batches and devices of the stage
  that makes an entry where every group shares it. What they read comes
  from a first pass: through the stages where it depends on the parameters
  (``Program.num_first``); else sums the parameters do not change (a token
  count) from a pass on the last entry's stage, and the step's arguments."""
  ctx, split = pre.ctx, pre.split
  loss = split.loss
  program = ctx.program
  owner = tuple(cut_.final_stage[j] for j in range(program.num_seeded))
  groups = tuple(ctx.n * exes[s].layout.devices for s in owner)
  seeds = tuple(np.asarray(v.val) for v in loss.values.seeds)
  common = dict(scale=pre.scale, kinds=tuple(loss.kinds), seeds=seeds,
                owner=owner, groups=groups)
  if ctx.through:
    return LossSeeds(**common, through=program.first_outputs,
                     sum_ops=tuple(loss.sum_ops))
  s = owner[-1] if owner else len(exes) - 1
  first = sums_pass_of(pre, exes[s].layout, s) if loss.num_sums else None
  inputs = inputs_pass(pre, exes[s].layout, s) if loss.values.inputs else None
  return LossSeeds(**common, first=first, inputs=inputs)


@dataclasses.dataclass(eq=False)
class PipelineExecutable:
  """A pipelined step, with the interface of ``executor.Executable``.

  Attributes:
    plan: the pipeline's :class:`autopar.Plan` (``plan.stages``).
    step: the runnable :class:`PipelineStep`.
  """
  plan: Any
  step: PipelineStep
  static_argnums: tuple[int, ...] = ()

  @property
  def split(self) -> SplitStep:
    return self.step.split

  @property
  def stages(self) -> dict[str, jax.stages.Compiled]:
    """``"stage<s>/forward"``, ``"stage<s>/backward"`` (or, where the
    schedule splits it, ``"stage<s>/backward_input"`` and
    ``"stage<s>/backward_weight"``), ``"stage<s>/sync"``,
    ``"stage<s>/apply<k>"``: compiled as the last call ran them."""
    return self.step.compiled()

  @property
  def schedule(self) -> list[str]:
    """The tasks one call dispatches, in order (``F3@1``: micro-batch 3's
    forward on stage 1, ``B3@1`` its backward, ``W3@1`` its weights'
    gradient where the schedule splits the backward; ``first3@1``: its
    forward alone in the first pass,
    before the schedule), then each stage's sync and update."""
    step = self.step
    S = step.num_stages
    first = [f"first{i}@{s}" for i in range(step.n) for s in range(step.first_stages())]
    return (first + [str(t) for t in step.order] + [f"sync@{s}" for s in range(S)] +
            [f"apply{k}@{a.segment.stage}" for k, a in enumerate(self.step.segments)])

  def memory_analysis(self) -> dict[str, Any]:
    return {name: c.memory_analysis() for name, c in self.stages.items()}

  def as_text(self) -> dict[str, str]:
    return {name: c.as_text() for name, c in self.stages.items()}

  def place(self, leaves: Sequence[Any]) -> list[Any]:
    return list(leaves)

  def run(self, leaves: Sequence[Any]) -> list[Any]:
    return self.step.run(leaves)

  def run_placing(self, values: Sequence[Any]) -> list[Any]:
    return self.run(self.place(values))
