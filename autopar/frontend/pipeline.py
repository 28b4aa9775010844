"""A step traced for a pipeline, and what planning its stages reads of it.

:func:`trace_pipelined` traces the step with the loss function captured
(``capture.py``), splits it at the grad marker (``split.py``) and builds
``P``, one micro-batch's forward program (``program.py``), with what the
stage construction reads of it. The planner (``planner/pipeline.py``) adds
the layers and the method's settings: :class:`Context`, and
:class:`Prepared`, the step with its context, which the stages are cut from
(``cut.py``) and compiled from (``backend/pipeline_build.py``).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from jax.extend.core import ClosedJaxpr, Literal

from autopar import jax_compat as jc

from autopar.errors import InputError, MarkerError
from autopar.frontend.capture import capture_mode
from autopar.frontend.hints import HINT_PRIMITIVES, check_hints, find_hints
from autopar.frontend.loss import check_loss
from autopar.frontend.program import Analysis, Program, build_program, same_value, unlike
from autopar.frontend.remat import remat_mode
from autopar.frontend.retype import lowers_with_devices
from autopar.frontend.rows import RowOracle
from autopar.frontend.split import (BY_DEVICE, OutputKind, SplitStep, apply_at, disagreement,
                                    scale_at, split_step)
from autopar.frontend.trace import (TracedStep, check_batch_leaves, eqns_by_path,
                                    loss_has_vjp_rules, loss_jvp_rules_trace, loss_rules_draw,
                                    trace_step, trace_step_any_batch)

__all__ = ["FinalInfo", "Context", "Prepared", "PipelineTrace", "trace_pipelined"]


@dataclasses.dataclass(frozen=True)
class FinalInfo:
  """How one output of ``P`` is combined over micro-batches: ``op`` over
  per-device values, or concatenated along ``row_dim``; ``None`` op and
  row_dim: not a step output (a seeded loss that is not returned)."""
  op: str | None
  row_dim: int | None


@dataclasses.dataclass
class Context:
  """What planning the stages reads of one step.

  Attributes:
    program, analysis: ``P`` and what ``frontend/program.py`` read of it.
    layers: positions of ``P`` where layers start (the first is 0).
    apply: the update (at the whole batch's shapes), its invars the step's
      consts, the argument leaves, the gradients, the reductions.
    num_consts: the step's consts (leading invars of ``P`` and the update).
    consts: their values.
    micro: rows of one micro-batch (all devices); n: micro-batches; batch:
      rows of the whole batch.
    donation: update output index -> the argument leaf it replaces.
    grad_names: per gradient, its name.
    leaf_names: per argument leaf, its path.
    option: the method's AutoShardingOption; accumulate: its
      grad_accumulation_dtype; remat: its remat.
    hint_axes: the mesh axes the step's sharding hints put on dimensions
      that do not hold rows (``hints.model_axes``): no stage splits its
      batch over them.
    through: the loss's cotangents read values that depend on the
      parameters (``Program.num_first`` of ``P``'s outputs), which a first
      pass through the stages computes before the schedule.
    first_until: with a first pass through the stages, the position of ``P`` after the last
      equation that makes what it computes: the stages that start before
      it run in it; 0 without one.
    whole_batch: the step holds an op JAX lowers with the devices in hand
      (``retype.lowers_with_devices``): a stage's batch is split over
      every axis of its submesh or none (``stage_batch_axes``).
    program_at: where the step could not be traced at a symbolic batch
      size, ``P`` is traced at ``micro`` rows and ``program_at(rows)``
      gives it traced at ``rows`` (a stage's rows per device; the same
      equations, checked); None where ``P`` is symbolic.
  """
  program: Program
  analysis: Analysis
  layers: tuple[int, ...]
  apply: ClosedJaxpr
  num_consts: int
  consts: tuple
  micro: int
  n: int
  batch: int
  donation: dict
  grad_names: tuple[str, ...]
  leaf_names: tuple[str, ...]
  option: Any
  accumulate: str | None
  remat: Any = "none"
  hint_axes: frozenset = frozenset()
  through: bool = False
  first_until: int = 0
  whole_batch: bool = False
  program_at: Any = None
  cache: dict = dataclasses.field(default_factory=dict)

  @property
  def num_layers(self) -> int:
    return len(self.layers)

  def layer_range(self, first: int, last: int) -> tuple[int, int]:
    """Positions of ``P`` that layers ``[first, last)`` cover."""
    n = len(self.program.eqns)
    hi = self.layers[last] if last < len(self.layers) else n
    return self.layers[first], hi


@dataclasses.dataclass
class Prepared:
  """A step traced for pipelining, and its context for planning.
  ``scale``: the loss's cotangents from what they read, at the whole
  batch's size (``loss.LossGradient.scale``)."""
  split: SplitStep
  ctx: Context
  batch: int
  finals: dict
  scale: ClosedJaxpr | None = None


@dataclasses.dataclass(frozen=True)
class PipelineTrace:
  """A step traced for pipelining (:func:`trace_pipelined`).

  Attributes:
    split: the step split at its grad marker, the loss function inlined.
    traced: the step as traced (its leaves, outputs and donations).
    program, analysis: ``P`` and what ``program.py`` reads of it.
    hints: the user's sharding hints in ``P``, by path.
    batch, micro: rows of the whole batch and of one micro-batch.
    apply: the update at the whole batch's shapes; scale: as
      :class:`Prepared`'s.
    finals: per output of ``P``, how it is combined over micro-batches.
    through, first_until, whole_batch, program_at: as :class:`Context`'s.
  """
  split: SplitStep
  traced: TracedStep
  program: Program
  analysis: Analysis
  hints: dict
  batch: int
  micro: int
  apply: ClosedJaxpr
  scale: ClosedJaxpr
  finals: dict
  through: bool
  first_until: int
  whole_batch: bool
  program_at: Any = None


def trace_pipelined(fun, args, prep, *, n: int, mesh, axis_sizes: dict[str, int],
                    name: str, output_reductions=None) -> PipelineTrace:
  """Traces the step ``fun`` (``args``: its arguments for tracing; ``prep``:
  their leaves, flags, inputs and names, as ``api`` prepared them) with the
  loss function captured, for ``n`` micro-batches on a mesh of
  ``axis_sizes`` (``mesh``: the one to trace under), and builds ``P``: at a
  symbolic batch size where the step traces so, else at a micro-batch's
  rows (and at the size of each stage's rows per device as the planner
  asks, ``Context.program_at``)."""
  batch = check_batch_leaves(prep.leaves, num_micro_batches=n, data_axes=(),
                             data_size=1, fn_name=name)
  if not batch:
    raise InputError(f"{name}: PipeshardParallel streams micro-batches through the "
                     f"stages, but the step has no batch argument. Fix: say which "
                     f"arguments hold the batch with batch_argnums=.")
  micro = batch // n

  def trace_at(rows):
    with capture_mode(), remat_mode("none"):
      return trace_step(fun, args, prep.flags, prep.leaves, prep.inputs,
                        micro_batch_size=rows, mesh=mesh, names=prep.names)

  def split_of(traced, reference):
    split = split_step(traced, fn_name=name, output_reductions=output_reductions,
                       pipeline=True, reference=reference,
                       keep_rules=not jc.is_symbolic_dim(traced.micro_batch_size))
    if not split.has_marker:
      raise MarkerError(f"{name}: PipeshardParallel needs the gradients from "
                        f"autopar.value_and_grad / autopar.grad (the grad marker).")
    return split

  with capture_mode(), remat_mode("none"):
    traced = trace_step_any_batch(fun, args, prep.flags, prep.leaves, prep.inputs,
                                  mesh=mesh, names=prep.names)
  # A custom_vjp in the loss function (cuDNN's attention, a straight-through
  # estimator): its gradient is its rule's, which only a trace at a concrete
  # size keeps (the Instantiator cannot write the rule's Python out); so
  # does a custom_jvp rule that cannot be traced at a symbolic size.
  symbolic = traced is not None and not loss_has_vjp_rules(traced.jaxpr) and \
      loss_jvp_rules_trace(traced.jaxpr)
  if symbolic:
    split = split_of(traced, None)
  else:
    # At a micro-batch's rows (the step's own error first, if it fails), and
    # at another size to tell which dimensions hold rows: the whole batch,
    # whose update and loss scale the step runs with.
    traced = trace_at(micro)
    if loss_rules_draw(traced.jaxpr):
      raise InputError(
          f"{name}: the loss function draws random numbers inside a "
          f"jax.custom_vjp or jax.custom_jvp whose rule PipeshardParallel keeps "
          f"(the step is traced at concrete sizes), where it cannot give each "
          f"device its rows of the whole batch's draw. Fix: draw the numbers "
          f"outside the custom derivative and pass them in, or use ShardParallel.")
    other_rows = batch if batch != micro else micro // 2 if micro % 2 == 0 else 2 * micro
    other = trace_at(other_rows)
    split, split_other = split_of(traced, other), split_of(other, traced)
    # (The update and the loss's scale are the other size's: lined up with
    # this one's outputs, reductions and sums.)
    why = disagreement(split, split_other)
    sa, sb = split.apply.jaxpr, split_other.apply.jaxpr
    if not why and (len(sa.invars), len(sa.outvars)) != (len(sb.invars), len(sb.outvars)):
      why = "the update reads or makes other values"
    if why:
      raise InputError(
          f"{name}: the step cannot be traced at a symbolic batch size, so "
          f"PipeshardParallel traces it at a micro-batch's {micro} rows and at "
          f"{other_rows}, and they split otherwise: {why}. Its program changes with "
          f"the batch size (a Python branch on it), so autopar cannot give each "
          f"device the whole batch's results. Fix: keep the batch size out of the "
          f"step's Python logic; or use ShardParallel.")
  split = _with_constant_seeds(split)
  through = _check_loss(split, name, n)
  if through:
    warnings.warn(
        f"autopar: the gradient of the loss of {split.loss.name} needs values the "
        f"stages compute (sums over the rows that depend on the parameters, a ratio "
        f"or a log of such sums, or a parameter-dependent factor of one) over the "
        f"whole batch before any backward pass; a first pass runs the stages' "
        f"forward passes once more per step (plan.summary() gives its time).",
        stacklevel=4)
  # (Traced at concrete sizes, the first pass of sums the parameters do not
  # change is P's too: P at a stage's rows, cut down to them.)
  first = through or not symbolic and bool(split.loss.num_sums)
  program = _program(split, traced, first, name)
  if symbolic:
    oracle = RowOracle.symbolic()
    apply, scale, program_at = apply_at(split, batch), scale_at(split, batch), None
  else:
    program_other = _program(split_other, other, first, name)
    oracle = RowOracle.paired(program.jaxpr, program_other.jaxpr, micro, other_rows)
    whole = split_other if other_rows == batch else split
    apply, scale = whole.apply, whole.loss.scale
    program_at = _programs_at(
        program, oracle, micro, {micro: (program, split.consts),
                                 other_rows: (program_other, split_other.consts)},
        lambda rows: _program_and_consts(split_of(trace_at(rows), traced), traced,
                                         first, name), name)
    program_at(other_rows)       # (checked alike as any other size)
  analysis = program.analysis(oracle)
  hints = find_hints("compute", eqns_by_path(program.jaxpr), oracle)
  check_hints(hints, axis_sizes, (), f"{name} under PipeshardParallel")
  return PipelineTrace(split=split, traced=traced, program=program, analysis=analysis,
                       hints=hints, batch=batch, micro=micro, apply=apply, scale=scale,
                       finals=_finals(split, program, name),
                       through=through,
                       first_until=_first_until(program, analysis) if through else 0,
                       whole_batch=lowers_with_devices(program.jaxpr),
                       program_at=program_at)


def _program(split: SplitStep, traced, first: bool, name: str) -> Program:
  """``P`` of ``split`` (``first``: with the first pass's outputs)."""
  compute = split.compute.jaxpr
  values = split.loss.values
  return build_program(split.traced.jaxpr, leaves=traced.leaves,
                       grads=compute.outvars[:split.num_grads],
                       outs=compute.outvars[split.num_grads:], loss=split.loss,
                       first=[*values.sums, *values.inputs] if first else (),
                       fn_name=name)


def _program_and_consts(split: SplitStep, traced, first: bool, name: str):
  return _program(split, traced, first, name), split.consts


def _programs_at(program: Program, oracle, micro: int, known: dict, make, name: str):
  """``Context.program_at``: ``P`` traced at ``rows`` (``make(rows)``: it
  and the step's constants there, kept in ``known``), checked to be
  ``program``'s equations (``program.unlike``) on the same constants."""
  consts = known[micro][1]
  checked: set = {micro}

  def at(rows: int) -> Program:
    if rows not in known:
      known[rows] = make(rows)
    other, other_consts = known[rows]
    if rows not in checked:
      why = unlike(program, other, oracle)
      if not why and not _same_consts(consts, other_consts):
        why = "the constants it closes over differ"
      if why:
        raise InputError(
            f"{name}: the step cannot be traced at a symbolic batch size, so "
            f"PipeshardParallel traces it at each size a stage runs it at, and its "
            f"program at {rows} rows is not its program at {micro} rows: {why}. "
            f"Its program changes with the batch size (a Python branch on it, or JAX "
            f"writing some operations only where a dimension is not 1), so autopar "
            f"cannot give each device the whole batch's results. Fix: keep the batch "
            f"size out of the step's Python logic so that it traces at a symbolic "
            f"size; or give each device more rows of each micro-batch (fewer "
            f"micro-batches, or a larger batch); or use ShardParallel.")
      checked.add(rows)
    return other
  return at


def _same_consts(a, b) -> bool:
  return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))


def _with_constant_seeds(split: SplitStep) -> SplitStep:
  """``split`` with each seed of its loss's cotangent that is a literal
  under sharding hints (``reshard(1.0)``: what value_and_grad seeds with
  under an explicit mesh, as MaxText's) as that literal."""
  values = split.loss.values
  producer = {v: e for e in split.traced.jaxpr.jaxpr.eqns for v in e.outvars}

  def constant(v):
    while not isinstance(v, Literal):
      e = producer.get(v)
      if e is None or e.primitive.name not in HINT_PRIMITIVES or len(e.invars) != 1:
        return v
      v = e.invars[0]
    return v
  seeds = tuple(constant(v) for v in values.seeds)
  if seeds == tuple(values.seeds):
    return split
  loss = dataclasses.replace(split.loss, values=dataclasses.replace(values, seeds=seeds))
  return dataclasses.replace(split, loss=loss)


def _check_loss(split: SplitStep, name: str, n: int) -> bool:
  """The loss as a pipeline can seed it (``loss.py``): derived, from
  constant seeds. Returns whether the values its cotangents read need a
  first pass through the stages: sums over the batch that depend on the
  parameters (a ratio, a log or a product of such sums: a mixture of
  experts' load-balancing loss), or a factor that depends on them."""
  loss = split.loss
  check_loss(loss, name, f"{n} micro-batch(es) and the pipeline stages' devices")
  values = loss.values
  if any(not isinstance(v, Literal) for v in values.seeds):
    raise MarkerError(f"{name}: the loss's cotangent seed is computed from the "
                      f"step's inputs; PipeshardParallel needs a constant seed (as "
                      f"autopar.value_and_grad gives).")
  return bool(loss.num_sums and loss.forward_sums) or not all(values.fixed)


def _first_until(program, analysis) -> int:
  """``Context.first_until``: after the last equation of ``P`` that makes a
  first-pass output (one made by no stage's own equation, or by a floating
  one, is the last stage's)."""
  out = 0
  for j in program.first_outputs:
    v = program.jaxpr.outvars[j]
    i = analysis.producer.get(v) if not isinstance(v, Literal) else None
    out = max(out, len(program.eqns) if i is None or i in analysis.floating else i + 1)
  return out


def _finals(split: SplitStep, program, name: str) -> dict[int, FinalInfo]:
  """How each output of ``P`` is combined over micro-batches."""
  out = {j: FinalInfo(None, None) for j in range(program.num_seeded)}
  base = program.num_seeded
  for r, op in enumerate(split.reduced):
    out[base + r] = FinalInfo(op, None)
  base += len(split.reduced)
  for o, (kind, idx) in enumerate(zip(split.out_kinds, split.out_index, strict=True)):
    if kind is OutputKind.APPLY:
      continue
    if kind is OutputKind.CONCAT:
      out[base + idx] = FinalInfo(None, split.out_dims[o].dim)
    elif kind in BY_DEVICE:
      out[base + idx] = FinalInfo(BY_DEVICE[kind], None)
    else:
      why = split.why.get(o, "it cannot be combined over micro-batches")
      raise InputError(
          f"{name}: output {split.traced.out_paths[o]} is computed from the batch "
          f"before the gradient marker and autopar cannot tell how to combine it "
          f"over micro-batches and devices: {why}. Fix: say how with "
          f"parallelize(..., output_reductions={{...: 'mean'}}).")
  for j in program.first_outputs:       # (the first pass combines them)
    out[j] = FinalInfo(None, None)
  return out
