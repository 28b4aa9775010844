"""The sharding strategies' types, the rule registry and the spec helpers.

For one jaxpr equation, a rule lists its candidate :class:`Strategy`\\ s: the
sharding of each output, the sharding each input must have, and the compute
and communication cost of running the equation that way. Rules are plain
functions registered per primitive name::

    @register("transpose")
    def _transpose(eqn, ctx): ...

A primitive without a rule gets :func:`replicated_fallback`: every operand
gathered whole and the equation run on each device, priced as all of its
work on each. That is correct for any primitive (each device computes what
one device would), only without parallelism for that equation; the planner
warns once a plan with the primitives it ran so (:func:`missing_rules`).

Specs here cover the *planned* mesh axes only (the axes not used for the
batch split; see ``ilp.py``). A spec is a tuple with one entry per dimension,
each entry the tuple of mesh axes that split that dimension (major first)::

    ((), ("model",))      # a matrix split by columns over "model"
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import warnings
from typing import Callable, Mapping, Sequence

from jax.extend.core import Literal
from jax.sharding import PartitionSpec

from autopar.costs.cost_model import MeshCost, dtype_flop_seconds, itemsize
from autopar.frontend.retype import HOST_CALLBACKS, jaxprs_in
from autopar.frontend.trace import INLINED_CALLS

__all__ = ["Spec", "Strategy", "RuleContext", "register", "strategies_for",
           "enumerate_specs", "without_unit_axes", "grad_sync_costs", "grad_sync_latency",
           "replicated", "shard_count",
           "local_bytes", "to_partition_spec", "RULES", "missing_rules",
           "replicated_fallback", "warn_missing_rules", "PLANNED_THROUGH", "REGIONS",
           "batch_spec"]

Spec = tuple[tuple[str, ...], ...]


def replicated(rank: int) -> Spec:
  return ((),) * rank


def shard_count(spec: Spec, sizes: Mapping[str, int]) -> int:
  return math.prod(sizes[a] for entry in spec for a in entry)


def without_unit_axes(spec: Spec, sizes: Mapping[str, int]) -> Spec:
  """``spec`` with its mesh axes of size 1 left out: they split nothing, so
  specs equal without them shard a value alike (a user's pin to
  ``P("fsdp")`` on a mesh whose "fsdp" has size 1 is met by a replicated
  choice, the planners searching the axes of size > 1 alone)."""
  return tuple(tuple(a for a in e if sizes[a] > 1) for e in spec)


def local_shape(shape: Sequence[int], spec: Spec, sizes) -> tuple[int, ...]:
  return tuple(n // math.prod(sizes[a] for a in entry)
               for n, entry in zip(shape, spec, strict=True))


def local_bytes(aval, spec: Spec, sizes) -> float:
  return math.prod(local_shape(aval.shape, spec, sizes)) * itemsize(aval.dtype)


@functools.lru_cache(maxsize=4096)
def to_partition_spec(spec: Spec):
  """``spec`` (a tuple of axis-name tuples per dim) as a PartitionSpec; cached,
  as a plan converts one per value of the step."""
  return PartitionSpec(*(None if not e else e[0] if len(e) == 1 else tuple(e)
                         for e in spec))


def batch_spec(rank: int, dim: int, entry) -> PartitionSpec:
  """A spec splitting dimension ``dim`` of a rank-``rank`` value over the
  batch axes (``entry``) and nothing else."""
  return PartitionSpec(*([None] * dim), entry, *([None] * (rank - dim - 1)))


def enumerate_specs(shape: Sequence[int], axes: Sequence[str],
                    sizes: Mapping[str, int], *, fixed: Sequence[int] = ()
                    ) -> list[Spec]:
  """Every way to split ``shape`` over ``axes`` (each axis on one dim or none).

  Dims in ``fixed`` are never split; a dim split over several axes must be
  divisible by their product.
  """
  rank = len(shape)
  choices = [d for d in range(rank) if d not in fixed]
  out, seen = [], set()
  for assign in itertools.product([None, *choices], repeat=len(axes)):
    entries = [[] for _ in range(rank)]
    for a, d in zip(axes, assign):
      if d is not None:
        entries[d].append(a)
    if any(shape[d] % math.prod(sizes[a] for a in e) for d, e in enumerate(entries)):
      continue
    spec = tuple(tuple(e) for e in entries)
    if spec not in seen:
      seen.add(spec)
      out.append(spec)
  return out


def grad_sync_costs(aval, planned_axes: Sequence[str], batch_axes: Sequence[str],
                    sizes: Mapping[str, int], cost: MeshCost
                    ) -> tuple[list[Spec], list[float]]:
  """A gradient's specs over the planned axes, and the bandwidth seconds
  of its all-reduce over the batch axes at each (the ILP's grad nodes; the
  planner's cost lower bound takes their minimum). XLA combines the
  gradients' all-reduces into few, so the latency is paid once for all of
  them (:func:`grad_sync_latency`), not per gradient."""
  specs = enumerate_specs(aval.shape, planned_axes, sizes)
  latency = grad_sync_latency(batch_axes, cost)
  return specs, [max(0.0, cost.all_reduce(local_bytes(aval, s, sizes), batch_axes) - latency)
                 for s in specs]


def grad_sync_latency(batch_axes: Sequence[str], cost: MeshCost) -> float:
  """The latency of one all-reduce over the batch axes: what the combined
  gradient sync pays once a step (0 with no batch axes)."""
  return cost.latency("all-reduce", batch_axes)


@dataclasses.dataclass(frozen=True)
class Strategy:
  """One way to run an equation.

  Attributes:
    name: a short description ("S0 x R", "col(model)", ...).
    out_specs: spec of each output.
    in_specs: spec each input must have (None: no requirement, e.g. a literal).
    compute: seconds of compute per device.
    comm: seconds of communication the strategy itself causes.
    collectives: (kind, axes, bytes per device) of that communication.
  """
  name: str
  out_specs: tuple[Spec, ...]
  in_specs: tuple[Spec | None, ...]
  compute: float = 0.0
  comm: float = 0.0
  collectives: tuple[tuple[str, tuple[str, ...], float], ...] = ()


@dataclasses.dataclass(frozen=True)
class RuleContext:
  """What a rule needs to know: the planned axes and the cost model.

  A rule prices an equation's flops, each at the rate of the dtype that
  does the work (:meth:`flop_seconds`): a matmul or convolution at its
  operands' (bfloat16 on an H100's tensor cores, ~15x float32's),
  element-wise and reduction work at float32's (vector units). Memory
  traffic is not the rules': XLA fuses element-wise chains, so the bytes
  an equation moves depend on its neighbours, and the ILP counts them at
  fusion boundaries (``ilp_graph.py``).

  Attributes:
    seconds_per_flop: seconds per flop for a dtype not in ``flop_rates``.
    flop_rates: dtype name -> seconds per flop (from the device kind or a
      calibration); empty when ``seconds_per_flop`` was given by hand.
  """
  axes: tuple[str, ...]
  sizes: Mapping[str, int]
  cost: MeshCost
  seconds_per_flop: float = 1e-12
  flop_rates: Mapping[str, float] = dataclasses.field(default_factory=dict)

  def flop_seconds(self, dtype=None) -> float:
    """Seconds per flop of work in ``dtype`` (None: float32, the vector
    units' rate for element-wise work)."""
    return dtype_flop_seconds(self.flop_rates, dtype, self.seconds_per_flop)

  def compute(self, flops: float, spec_or_shards, dtype=None) -> float:
    """Seconds per device for ``flops`` (of the whole array) split evenly
    over the shards of ``spec_or_shards``, at ``dtype``'s rate."""
    shards = spec_or_shards if isinstance(spec_or_shards, int) else \
        shard_count(spec_or_shards, self.sizes)
    return self.flop_seconds(dtype) * flops / shards


Rule = Callable[..., list[Strategy]]
RULES: dict[str, Rule] = {}
# Control flow the ILP plans through (ilp_graph.py): its bodies' equations
# get the rules. remat2: jax.checkpoint.
REGIONS = ("scan", "while", "cond", "remat2")
# Need no rule of their own: planned through, or inlined before planning.
PLANNED_THROUGH = frozenset(REGIONS + INLINED_CALLS)


def register(*names: str):
  """Registers a rule for the primitives ``names``."""
  def deco(fn: Rule) -> Rule:
    for n in names:
      RULES[n] = fn
    return fn
  return deco


def replicated_fallback(eqn, ctx: RuleContext) -> list[Strategy]:
  """Every operand whole on every device, the equation run on each: its
  cost a flop per output element (its memory traffic is the ILP's, as for
  every equation; the reshards into it too)."""
  outs = tuple(replicated(len(v.aval.shape)) for v in eqn.outvars)
  ins = tuple(None if isinstance(v, Literal) else replicated(len(v.aval.shape))
              for v in eqn.invars)
  flops = sum(math.prod(getattr(v.aval, "shape", ())) for v in eqn.outvars)
  return [Strategy("replicated", outs, ins, compute=ctx.compute(flops, 1))]


# autopar's own: the loss's cotangents (loss.py), a few small values.
register("autopar_loss_cotangent")(replicated_fallback)


def strategies_for(eqn, ctx: RuleContext) -> list[Strategy]:
  """The candidate strategies of ``eqn`` (never empty)."""
  rule = RULES.get(eqn.primitive.name)
  if rule is None:
    return replicated_fallback(eqn, ctx)
  out = rule(eqn, ctx)
  return out or replicated_fallback(eqn, ctx)


def missing_rules(*jaxprs) -> dict[str, int]:
  """Primitive name -> how many equations of ``jaxprs`` (and of the bodies
  inside them) have it and no sharding rule: they run replicated. (A host
  callback is not one: it takes and gives whole values by its nature.)"""
  found: dict[str, int] = {}

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      name = eqn.primitive.name
      if name not in RULES and name not in PLANNED_THROUGH and name not in HOST_CALLBACKS:
        found[name] = found.get(name, 0) + 1
      for sub in jaxprs_in(eqn):
        walk(sub)
  for j in jaxprs:
    walk(getattr(j, "jaxpr", j))
  return found


def warn_missing_rules(missing: Mapping[str, int], where: str) -> None:
  """One warning naming the primitives ``missing_rules`` found."""
  if missing:
    names = ", ".join(f"'{k}' ({v}x)" for k, v in sorted(missing.items()))
    warnings.warn(
        f"autopar: {where}: no sharding rule for {names}; those equations run "
        f"replicated (each device computes the whole value: correct, without "
        f"parallelism). Please report the primitive.", stacklevel=3)
