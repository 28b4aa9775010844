"""Trace a training step to a jaxpr at micro-batch shapes.

The front end's first step (``frontend/``): user function + example args -> :class:`TracedStep`,
a closed jaxpr plus everything later stages need to know about its inputs
and outputs (pytree paths, which leaves are batch data or donated state).

Arguments are classified once per call, by :func:`classify_args`:

* static: listed in ``static_argnums``, or with ``"auto"`` an argument that
  is a Python scalar, a string or None (compiled in as a constant; a new
  value recompiles). Inside the other arguments, leaves that are not arrays
  are static too (``pytrees.partition``: Equinox's rule);
* batch: listed in ``batch_argnums``, or with ``"auto"`` found from the
  arguments' leading dimensions (:func:`find_batch`); every leaf has a
  leading batch axis that is split into micro-batches and over the data
  mesh axes;
* donated: listed in ``donate_argnums``, or with ``"auto"`` a first argument
  that looks like a flax ``TrainState`` (has ``params`` and ``opt_state`` or
  ``apply_gradients``);
* updated: arguments holding Flax NNX variables, which the step may change
  in place (``pytrees.mutable_args``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import sys
from typing import Any, Callable, Sequence

import jax
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, Literal, Var
from jax.sharding import NamedSharding

from autopar import jax_compat as jc
from autopar.errors import AutoparError, InputError, MarkerError
from autopar.frontend.marker import grad_marker_p
from autopar.frontend.capture import backward_p, capture_mode, forward_lin_p, forward_p
from autopar.frontend.pytrees import Partition, mutable_args, partition, write_back
from autopar.frontend.retype import Instantiator, jaxprs_in, primitive_names, without_meshes

__all__ = ["ArgFlags", "LeafInfo", "TracedStep", "classify_args", "batch_candidates",
           "state_args",
           "abstract_leaves", "trace_step", "check_batch_leaves", "eqns_by_path", "ROWS_NAME",
           "region_jaxprs", "DRAW_PRIMITIVES", "HINT_PRIMITIVES"]


# -- argument classification --------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ArgFlags:
  """Which positional arguments are static, batch data, donated, updated in
  place."""
  static: tuple[int, ...]
  batch: tuple[int, ...]
  donate: tuple[int, ...]
  update: tuple[int, ...] = ()


_SCALAR_TYPES = (bool, int, float, complex, str, type(None))


def _looks_like_train_state(arg: Any) -> bool:
  return hasattr(arg, "params") and (hasattr(arg, "opt_state")
                                     or hasattr(arg, "apply_gradients"))


def _holds_state(arg: Any) -> bool:
  """A model or optimizer state (never the batch): a TrainState, an
  Equinox module or an optax state anywhere in it."""
  if _looks_like_train_state(arg):
    return True
  eqx = sys.modules.get("equinox")
  def state_node(x):
    return ((eqx is not None and isinstance(x, eqx.Module)) or
            type(x).__module__.split(".")[0] == "optax")
  return any(state_node(x) for x in jax.tree_util.tree_leaves(arg, is_leaf=state_node))


def _leading_size(arg: Any) -> int | None:
  """The leading size all of ``arg``'s array leaves share, if they do."""
  arrays, _ = partition(arg)
  shapes = [tuple(getattr(x, "shape", ())) for x in arrays
            if not isinstance(x, (int, float, complex))]
  if not shapes or any(not s for s in shapes) or len({s[0] for s in shapes}) != 1:
    return None
  return shapes[0][0]


def find_batch(args: Sequence[Any], exclude, names: Sequence[str], fn_name: str
               ) -> tuple[int, ...]:
  """The batch arguments when ``batch_argnums="auto"``: those whose array
  leaves all share one leading size, leaving out ``exclude`` (static
  arguments) and model or optimizer states. Arguments of one
  leading size are the batch together (``x, y``); where sizes differ, the
  group with argument 1 (the classic ``step(state, batch)``) is chosen if its
  size is the largest, and anything else is ambiguous (an error naming the
  candidates: a wrong guess would split a weight into micro-batches)."""
  groups: dict[int, list[int]] = {}
  others = []                     # arrays, but no one leading size
  for i, a in enumerate(args):
    if i in exclude or _holds_state(a):
      continue
    size = _leading_size(a)
    if size is not None:
      groups.setdefault(size, []).append(i)
    elif partition(a)[0]:
      others.append(i)
  if not groups and 1 in others:
    return (1,)       # as step(state, batch) has it; its leaves' check says what is off
  if len(groups) <= 1:
    return tuple(next(iter(groups.values()), ()))
  with_one = [size for size, g in groups.items() if 1 in g]
  if with_one and with_one[0] == max(groups):
    return tuple(groups[with_one[0]])
  listed = ", ".join(f"{names[i]} (argument {i}, leading size {size})"
                     for size, g in groups.items() for i in g)
  last = max(groups.values(), key=max)           # the batch usually comes last
  raise InputError(
      f"{fn_name}: cannot tell which argument is the batch: {listed} could each "
      f"be split into micro-batches. Fix: pass batch_argnums= naming the batch "
      f"argument(s), e.g. parallelize(step, batch_argnums={tuple(last)}).")


def _normalize_argnums(argnums: int | Sequence[int], nargs: int, what: str,
                       fn_name: str) -> tuple[int, ...]:
  if isinstance(argnums, int):
    argnums = (argnums,)
  out = []
  for a in argnums:
    if not isinstance(a, int) or not -nargs <= a < nargs:
      raise InputError(
          f"{fn_name}: {what}={tuple(argnums)!r} names argument {a!r}, but the "
          f"step was called with {nargs} positional argument(s). Fix: give "
          f"indices in range(0, {nargs}).")
    out.append(a % nargs)
  return tuple(sorted(set(out)))


def batch_candidates(args: Sequence[Any], static: Sequence[int]) -> list[int]:
  """The arguments ``batch_argnums="auto"`` chooses among (before knowing
  which the step differentiates): those whose array leaves share a leading
  size, other than model and optimizer states and ``static`` ones."""
  return [i for i, a in enumerate(args) if i not in static and not _holds_state(a)
          and _leading_size(a) is not None]


def state_args(closed: ClosedJaxpr, leaves: Sequence[LeafInfo]) -> frozenset[int]:
  """The arguments of a step traced with nothing split (``closed``: over
  ``leaves``) that hold state, never the batch: those whose leaves the loss
  function is differentiated with respect to (``autopar.value_and_grad``'s
  operands, and what they are computed from), or that the update reads
  besides the gradients (``w - lr * g``)."""
  jaxpr = closed.jaxpr
  arg = {v: l.argnum for v, l in zip(jaxpr.invars, leaves, strict=True)}
  producer = {v: e for e in jaxpr.eqns for v in e.outvars}
  found: set[int] = set()
  stack = []
  for e in jaxpr.eqns:
    if e.primitive is backward_p:
      stack += [v for v, d in zip(e.invars, e.params["diff"]) if d and isinstance(v, Var)]
  seen: set = set()
  while stack:
    v = stack.pop()
    if v in seen:
      continue
    seen.add(v)
    if v in arg:
      found.add(arg[v])
    elif v in producer:
      stack.extend(a for a in producer[v].invars if isinstance(a, Var))
  # The update: the outputs computed from the gradients, and what they read
  # besides them (walking back, never through the gradients or the loss
  # function's calls, which read the batch).
  grads: set = set()
  marked: set = set()
  for e in jaxpr.eqns:
    if e.primitive is grad_marker_p:
      grads.update(e.outvars)
      marked.update(e.outvars)
    elif any(isinstance(a, Var) and a in grads for a in e.invars):
      grads.update(e.outvars)
  stack = [v for v in jaxpr.outvars if isinstance(v, Var) and v in grads]
  seen = set()
  while stack:
    v = stack.pop()
    if v in seen or v in marked:
      continue
    seen.add(v)
    if v in arg:
      found.add(arg[v])
    elif v in producer and producer[v].primitive not in _LOSS_CALLS:
      stack.extend(a for a in producer[v].invars if isinstance(a, Var))
  return frozenset(found)


def classify_args(args: Sequence[Any], *, static_argnums, batch_argnums,
                  donate_argnums, fn_name: str,
                  names: Sequence[str] | None = None,
                  not_batch: Sequence[int] = ()) -> ArgFlags:
  """Resolves ``"auto"`` argnums against concrete (or abstract) arguments.
  ``not_batch``: arguments ``batch_argnums="auto"`` must not take (the
  state the step differentiates or updates: :func:`state_args`)."""
  nargs = len(args)
  names = names or [f"args[{i}]" for i in range(nargs)]
  explicit_batch = () if batch_argnums == "auto" else _normalize_argnums(
      batch_argnums, nargs, "batch_argnums", fn_name)
  if static_argnums == "auto":
    static = tuple(i for i, a in enumerate(args)
                   if i not in explicit_batch and isinstance(a, _SCALAR_TYPES))
  else:
    static = _normalize_argnums(static_argnums, nargs, "static_argnums", fn_name)
  if donate_argnums == "auto":
    donate = (0,) if nargs and 0 not in explicit_batch and 0 not in static and \
        _looks_like_train_state(args[0]) else ()
  else:
    donate = _normalize_argnums(donate_argnums, nargs, "donate_argnums", fn_name)
  batch = explicit_batch if batch_argnums != "auto" else find_batch(
      args, set(static) | set(not_batch), names, fn_name)
  for name, nums in (("static_argnums", static), ("donate_argnums", donate)):
    both = sorted(set(nums) & set(batch))
    if both:
      raise InputError(
          f"{fn_name}: argument {both[0]} is in both batch_argnums and {name}. "
          f"Fix: a batch argument is split into micro-batches, so it can be "
          f"neither static nor donated; remove it from one of the two.")
  both = sorted(set(static) & set(donate))
  if both:
    raise InputError(
        f"{fn_name}: argument {both[0]} is both static and donated. Fix: only "
        f"array arguments can be donated; remove it from donate_argnums.")
  update = tuple(i for i in mutable_args(args) if i not in static and i not in batch)
  return ArgFlags(static=static, batch=batch, donate=donate, update=update)


# -- leaves -------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LeafInfo:
  """One array leaf of the step's non-static arguments."""
  path: str                  # e.g. "state.params['Dense_0']['kernel']"
  shape: tuple[int, ...]
  dtype: Any                 # numpy dtype, or a JAX extended dtype (PRNG keys)
  weak_type: bool
  argnum: int
  is_batch: bool
  is_donated: bool

  def abstract(self, shape: tuple[int, ...] | None = None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(self.shape if shape is None else shape,
                                self.dtype, weak_type=self.weak_type)


def arg_names(fn: Callable, nargs: int) -> list[str]:
  """Parameter names of ``fn`` for its first ``nargs`` positional args."""
  try:
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
  except (TypeError, ValueError):
    params = []
  names = [p.name for p in params[:nargs]]
  return names + [f"args[{i}]" for i in range(len(names), nargs)]


def _leaf_aval(x: Any) -> tuple[tuple[int, ...], Any, bool]:
  if isinstance(x, jax.ShapeDtypeStruct):
    return tuple(x.shape), x.dtype, bool(getattr(x, "weak_type", False))
  aval = jax.typeof(x)
  return tuple(aval.shape), aval.dtype, bool(aval.weak_type)


def abstract_leaves(args: Sequence[Any], flags: ArgFlags, names: Sequence[str]
                    ) -> tuple[list[LeafInfo], Partition, list[Any]]:
  """Splits the non-static args into traced leaves and static ones.

  Returns (an info per traced leaf, the partition of the tuple of non-static
  args, the traced leaves).
  """
  dynamic = [i for i in range(len(args)) if i not in flags.static]
  leaves, part = partition(tuple(args[i] for i in dynamic))
  keys = _keys(part, tuple(args[i] for i in dynamic))
  infos = []
  for x, (pos, key) in zip(leaves, keys, strict=True):
    shape, dtype, weak = _leaf_aval(x)
    i = dynamic[pos]
    infos.append(LeafInfo(path=names[i] + key, shape=shape, dtype=dtype,
                          weak_type=weak, argnum=i, is_batch=i in flags.batch,
                          is_donated=i in flags.donate))
  return infos, part, leaves


# Pytree structure -> (argument position, key path) of each traced leaf. Every
# call of a step flattens its arguments; spelling out the paths of a large
# train state is slow (0.1 s for 3000 leaves), so it is done once per
# structure. Process-wide (docs/design.md), cleared at 1,024 structures.
_KEYS: dict = {}


def _keys(part: Partition, args: tuple) -> tuple[tuple[int, str], ...]:
  key = (part.treedef, part.dynamic)
  keys = _KEYS.get(key)
  if keys is None:
    paths = jax.tree_util.tree_flatten_with_path(args)[0]
    keys = tuple((kp[0].idx, jax.tree_util.keystr(kp[1:]))
                 for (kp, _), d in zip(paths, part.dynamic, strict=True) if d)
    if len(_KEYS) >= 1024:
      _KEYS.clear()
    _KEYS[key] = keys
  return keys


def check_batch_leaves(leaves: Sequence[LeafInfo], *, num_micro_batches: int,
                       data_axes: Sequence[str], data_size: int,
                       fn_name: str) -> int:
  """Checks that the batch leaves can be split; returns the batch size.

  The batch is split into ``num_micro_batches`` micro-batches, and each
  micro-batch over the ``data_axes`` of the mesh (``data_size`` devices), so
  the leading axis of every batch leaf must be divisible by their product.
  """
  batch_leaves = [l for l in leaves if l.is_batch]
  if not batch_leaves:
    if num_micro_batches > 1:
      raise InputError(
          f"{fn_name}: num_micro_batches={num_micro_batches} but the step has "
          f"no batch argument with arrays to split. Fix: pass batch_argnums= "
          f"naming the argument that holds the batch.")
    return 0
  for l in batch_leaves:
    if len(l.shape) == 0:
      raise InputError(
          f"{fn_name}: batch argument leaf {l.path} is a scalar (shape ()), "
          f"but every leaf of a batch argument needs a leading batch axis to "
          f"split into micro-batches. Fix: give it a batch axis, or move it "
          f"out of the batch argument (e.g. into its own argument, which is "
          f"replicated); if this argument is not the batch, name the batch "
          f"with batch_argnums=.")
  first = batch_leaves[0]
  size = first.shape[0]
  for l in batch_leaves[1:]:
    if l.shape[0] != size:
      raise InputError(
          f"{fn_name}: batch leaves disagree on the batch size: {first.path} "
          f"has shape {first.shape} but {l.path} has shape {l.shape}. Fix: "
          f"every leaf of a batch argument must have the same leading "
          f"(batch) dimension; if this argument is not the batch, name the "
          f"batch with batch_argnums=.")
  divisor = num_micro_batches * data_size
  if size % divisor:
    axes = ", ".join(f"'{a}'" for a in data_axes) or "none"
    good = [d for d in range(max(1, size - 3 * divisor), size + 3 * divisor + 1)
            if d % divisor == 0 and d > 0]
    raise InputError(
        f"{fn_name}: batch leaf {first.path} has shape {first.shape}; its batch "
        f"size {size} must be divisible by num_micro_batches "
        f"({num_micro_batches}) x the data-parallel mesh size ({data_size}, "
        f"mesh axes {axes}) = {divisor}. Fix: use a batch size that is a "
        f"multiple of {divisor} (e.g. {', '.join(map(str, good[:3]))}), or "
        f"change num_micro_batches.")
  return size


# -- tracing ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TracedStep:
  """The step as a closed jaxpr over the traced leaves of its arguments.

  ``jaxpr.jaxpr.invars[k]`` is ``leaves[k]`` (at micro-batch shape for batch
  leaves); ``jaxpr.jaxpr.outvars[k]`` has pytree path ``out_paths[k]``.

  Attributes:
    inputs: the partition of the tuple of non-static arguments (its traced
      leaves are ``leaves``; ``pytrees.Partition``).
    outputs: the partition of the step's result, as the caller gets it back:
      the step's own result, or with arguments updated in place
      ``(result, (updated argument, ...))`` (``updated``).
    updated: the arguments (positions) whose values after the step are
      results too (Flax NNX modules, changed in place).
  """
  jaxpr: ClosedJaxpr
  leaves: tuple[LeafInfo, ...]
  inputs: Partition
  outputs: Partition
  out_paths: tuple[str, ...]
  micro_batch_size: int          # 0 when the step has no batch argument
  updated: tuple[int, ...] = ()
  # Comparisons of the symbolic batch size the step's Python made, answered
  # for the whole batch (SizeDecisions): "x.shape[0] == 16 at f.py:3: True ...".
  size_decisions: tuple[str, ...] = ()

  def __str__(self) -> str:
    return str(self.jaxpr)


def trace_step(fn: Callable, args: Sequence[Any], flags: ArgFlags,
               leaves: Sequence[LeafInfo], inputs: Partition, *,
               micro_batch_size: int | Any, mesh=None,
               names: Sequence[str] | None = None) -> TracedStep:
  """Traces ``fn`` with batch leaves cut to ``micro_batch_size`` rows.

  ``micro_batch_size`` may be a symbolic dimension (``jax.export``), which
  traces the step once for every batch size; see :func:`instantiate`.
  ``mesh``: the method's mesh (all axes Auto). A step whose sharding hints
  are bare PartitionSpecs needs a mesh in context; where the caller set
  none, they refer to this one. ``names``: the arguments' names, for the
  paths of arguments updated in place.
  """
  static_vals = {i: args[i] for i in flags.static}
  nargs = len(args)
  names = names or [f"args[{i}]" for i in range(nargs)]
  results = []       # the partition and key paths of the result (per trace)

  def flat_fn(*flat):
    it = iter(inputs.merge(flat))
    full = [static_vals[i] if i in static_vals else next(it) for i in range(nargs)]
    out = fn(*full)
    if flags.update:          # changed in place: their values after the step
      out = (out, tuple(full[i] for i in flags.update))
    dyn, part = partition(out)
    results.append((part, jax.tree_util.tree_flatten_with_path(out)[0]))
    return dyn

  abstract = [l.abstract((micro_batch_size, *l.shape[1:]) if l.is_batch else None)
              for l in leaves]
  in_context = not jc.get_abstract_mesh().empty
  try:
    # The loss function autopar.value_and_grad differentiates is one call in
    # the trace (frontend/capture.py), so that split.py can derive its
    # gradient as the whole batch's (loss.py).
    with capture_mode():
      try:
        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*abstract)
      except (RuntimeError, ValueError) as e:
        if mesh is None or in_context or not _wants_a_mesh(e):
          raise
        with _in_context(mesh):
          closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*abstract)
        in_context = True
  except AutoparError:
    raise
  except Exception as e:   # noqa: BLE001 - said with the batch, if the cut caused it
    batch = sorted({names[l.argnum] for l in leaves if l.is_batch})
    if (not batch or jc.is_symbolic_dim(micro_batch_size) or
        _fails_whole(flat_fn, leaves, mesh)):
      raise                     # the step's own error, as the user wrote it
    raise InputError(
        f"{getattr(fn, '__name__', 'step')}: the step failed when traced with its "
        f"batch argument(s) {', '.join(batch)} cut to {micro_batch_size} rows (a "
        f"micro-batch on one device): {type(e).__name__}: {e}\nFix: if "
        f"{' and '.join(batch)} {'is' if len(batch) == 1 else 'are'} not the batch, "
        f"name the batch with batch_argnums=; otherwise the step must work on any "
        f"number of rows.") from e
  outputs, paths = results[-1]
  out_paths = tuple(_out_path(kp, flags.update, names)
                    for (kp, _), d in zip(paths, outputs.dynamic, strict=True) if d)
  closed = _inline_marked_calls(closed, fn_name=getattr(fn, "__name__", "step"))
  closed = without_meshes(closed, in_context=in_context)
  return TracedStep(jaxpr=closed, leaves=tuple(leaves), inputs=inputs,
                    outputs=outputs, out_paths=out_paths,
                    micro_batch_size=micro_batch_size, updated=flags.update)


def _fails_whole(flat_fn, leaves: Sequence[LeafInfo], mesh) -> bool:
  """Whether the step fails when traced on the batch as given (not cut):
  then its error is its own, not the batch split's."""
  # (jax.set_mesh sets the mesh when called: make each context when entered.)
  contexts = [contextlib.nullcontext] + ([lambda: _in_context(mesh)] if mesh is not None
                                         else [])
  for context in contexts:
    try:
      with capture_mode(), context():
        jax.make_jaxpr(flat_fn)(*[l.abstract() for l in leaves])
    except (RuntimeError, ValueError) as e:
      if _wants_a_mesh(e):
        continue
      return True
    except Exception:  # noqa: BLE001 - any failure: the step's own
      return True
    return False
  return True


def split_updates(traced: TracedStep, result, args: Sequence[Any]):
  """The step's own result from ``result`` (the whole of ``traced.outputs``),
  after writing the values of arguments changed in place into ``args``."""
  if not traced.updated:
    return result
  out, updated = result
  for i, new in zip(traced.updated, updated, strict=True):
    write_back(args[i], new)
  return out


def _out_path(kp, updated: Sequence[int], names: Sequence[str]) -> str:
  """A result leaf's path: ``out...``, or for an argument updated in place
  its own path (``model['layers'][0]...``)."""
  if not updated:
    return "out" + jax.tree_util.keystr(kp)
  if kp[0].idx == 0:
    return "out" + jax.tree_util.keystr(kp[1:])
  return names[updated[kp[1].idx]] + jax.tree_util.keystr(kp[2:])


def _wants_a_mesh(e: Exception) -> bool:
  """Whether ``e`` says a bare PartitionSpec (a sharding hint) needs a mesh
  in context: JAX's RuntimeError, or the ValueError of a shim that a
  library put in place of with_sharding_constraint (MaxText's tunix adapter
  reshards instead, once imported)."""
  text = str(e)
  return "mesh in context" in text or "not under a mesh context" in text


def _in_context(mesh):
  """``mesh`` as the context mesh while a step is traced."""
  if isinstance(mesh, jax.sharding.AbstractMesh):
    return jax.sharding.use_abstract_mesh(mesh)
  return jax.set_mesh(mesh)


# -- one trace for every batch size -------------------------------------------

ROWS_NAME = "autopar_rows"    # the symbolic batch dimension

def trace_step_any_batch(fn: Callable, args: Sequence[Any], flags: ArgFlags,
                         leaves: Sequence[LeafInfo], inputs: Partition, *,
                         mesh=None, names: Sequence[str] | None = None,
                         failures: list | None = None) -> TracedStep | None:
  """Traces ``fn`` once with a symbolic micro-batch size, or None if it can't be.

  The planner needs the step at several per-device batch sizes (one per
  choice of batch axes). Tracing a large model costs seconds each time, so
  it is traced once with JAX's shape polymorphism and :func:`instantiate`
  writes out the jaxpr at each concrete size in one pass over the equations.

  The trace is the program ``jax.jit`` runs on the whole batch: where the
  step's Python compares its batch size (``x.shape[0] == 16``, ``!=``), the
  comparison is answered as it is for the whole batch's rows
  (:class:`SizeDecisions`), not with JAX's guess for a symbolic size
  (unequal). A step whose Python needs a concrete batch size otherwise
  (``float(x.shape[0])``, ``<``, a library checking for ints) cannot be
  traced this way and is traced per size instead; the exception that said
  so is appended to ``failures``, for messages. (A step that fails for
  another reason fails again, with its own error, when it is traced at a
  concrete size.)
  """
  from jax import export
  rows, = export.symbolic_shape(ROWS_NAME)
  whole = next((l.shape[0] for l in leaves if l.is_batch), None)
  if whole == 1:
    # One row: nothing is split, and JAX's own guesses at a symbolic size
    # ("not 1": jnp.squeeze keeps the dimension) would not be jax.jit's.
    if failures is not None:
      failures.append(ValueError("a batch of one row is traced at its size"))
    return None
  decisions = SizeDecisions(rows, whole)
  try:
    with jc.undecided_dim_equalities(decisions.decide):
      traced = trace_step(fn, args, flags, leaves, inputs, micro_batch_size=rows,
                          mesh=mesh, names=names)
  except MarkerError:
    raise
  except Exception as e:   # noqa: BLE001 - any failure means: trace per batch size
    if failures is not None:
      failures.append(e)
    return None
  return dataclasses.replace(traced, size_decisions=tuple(decisions.made))


class SizeDecisions:
  """Answers the equalities of a symbolic batch size that JAX cannot decide
  (``jax_compat.undecided_dim_equalities``) as they are for ``whole`` rows,
  the batch the step is called with: the step's Python then takes the
  branches ``jax.jit`` takes on the whole batch. Comparisons made by JAX's
  own code keep JAX's answer: its shape checks take "unequal" for "not
  provably equal" and keep to what holds at every size (as ``jax.export``
  relies on); answered for ``whole`` rows, a broadcast would accept shapes
  that hold at that size only."""

  def __init__(self, rows, whole: int | None):
    self.rows = rows                     # this trace's symbolic batch size
    self.whole = whole
    self.made: list[str] = []            # "autopar_rows == 16 at file:line: True ..."

  def decide(self, a, b, frame) -> bool | None:
    if self.whole is None or (frame is not None and
                              frame.f_code.co_filename.startswith(jc.JAX_SOURCE_DIR)):
      return None
    if any(jc.is_symbolic_dim(d) and d.scope is not self.rows.scope for d in (a, b)):
      return None                        # another trace's dimension (a nested one)
    try:
      equal = jc.evaluate_dim(a - b, {ROWS_NAME: self.whole}) == 0
    except Exception:  # noqa: BLE001 - not a function of the batch size alone
      return None
    where = f" at {frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else ""
    self.made.append(f"{a} == {b}{where}: {equal} for {self.whole} rows")
    return equal


def instantiate(traced: TracedStep, micro_batch_size: int,
                instantiator: "Instantiator | None" = None) -> TracedStep:
  """``traced`` (from :func:`trace_step_any_batch`) at a concrete batch size.

  ``instantiator``: one made by :func:`instantiator` for this size, to write
  out further jaxprs that share equations with this one (the split step's).
  """
  inst = instantiator or Instantiator({ROWS_NAME: micro_batch_size})
  jaxpr = inst.jaxpr(traced.jaxpr.jaxpr)
  return dataclasses.replace(traced, jaxpr=ClosedJaxpr(jaxpr, traced.jaxpr.consts),
                             micro_batch_size=micro_batch_size)


def instantiator(micro_batch_size: int) -> "Instantiator":
  """Writes jaxprs from :func:`trace_step_any_batch` out at a batch size;
  variables and equations they share come out shared."""
  return Instantiator({ROWS_NAME: micro_batch_size})


# -- equations by path ----------------------------------------------------------

def region_jaxprs(eqn) -> list:
  """The planned sub-jaxprs of a control-flow equation, by index: a scan's
  body (0); a while's cond (0) and body (1); a cond's branches; a
  checkpoint's body (0)."""
  p = eqn.params
  name = eqn.primitive.name
  if name == "scan":
    return [p["jaxpr"].jaxpr]
  if name == "while":
    return [p["cond_jaxpr"].jaxpr, p["body_jaxpr"].jaxpr]
  if name == "cond":
    return [b.jaxpr for b in p["branches"]]
  if name == "remat2":            # jax.checkpoint / remat
    return [p["jaxpr"]]
  return []


def eqns_by_path(jaxpr, prefix: str = ""):
  """(path, equation) of every equation in path order: an equation, then
  the equations of its bodies (``"12.0.5"`` is equation 5 of body 0 of
  equation 12)."""
  for idx, eqn in enumerate(jaxpr.eqns):
    path = f"{prefix}{idx}"
    yield path, eqn
    for k, sub in enumerate(region_jaxprs(eqn)):
      yield from eqns_by_path(sub, f"{path}.{k}.")


# -- markers inside nested calls ---------------------------------------------

# Calls that are planned through: their bodies are inlined into the step. The
# step is traced after differentiation, so a custom JVP/VJP rule is no longer
# needed and its primal body is what runs.
INLINED_CALLS = ("jit", "pjit", "closed_call", "core_call", "custom_jvp_call",
                 "custom_vjp_call", "custom_vjp_call_jaxpr")
# Inside the loss function autopar differentiates later (``loss.py``), only
# plain calls: a custom derivative rule is still needed there.
_PLAIN_CALLS = ("jit", "pjit", "closed_call", "core_call")
_LOSS_CALLS = (forward_p, forward_lin_p, backward_p)


def count_markers(jaxpr) -> int:
  """Number of grad-marker equations in ``jaxpr``, nested ones included."""
  n = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive is grad_marker_p:
      n += 1
    for sub in jaxprs_in(eqn):
      n += count_markers(sub)
  return n


def _inline_marked_calls(closed: ClosedJaxpr, *, fn_name: str) -> ClosedJaxpr:
  """Inlines nested ``jit`` and custom-derivative calls into the step.

  The splitter cuts the top-level jaxpr and the planner gives every equation
  a sharding, so calls (a ``jit`` equation, ``custom_jvp_call`` of
  ``jax.nn.relu``, ...) are replaced by their bodies, at the top level and
  inside scan / while / cond / checkpoint bodies. This is done by
  substituting variables, not by re-tracing, so it costs a pass over the
  equations. A marker inside ``scan``/``while``/``cond`` cannot be brought out
  and is an error.
  """
  if not _has_calls(closed.jaxpr):
    return closed
  jaxpr, consts = _inline(closed.jaxpr, list(closed.consts), fn_name)
  return ClosedJaxpr(jaxpr, consts)


def inline_calls(closed: ClosedJaxpr, *, fn_name: str) -> ClosedJaxpr:
  """:func:`_inline_marked_calls` for a jaxpr autopar made (``loss.py``)."""
  return _inline_marked_calls(closed, fn_name=fn_name)


# A pipeline traced at a symbolic size keeps a custom_jvp's rule (the
# Instantiator writes its jaxpr out at each size) but not a custom_vjp's,
# whose backward is a Python function: such a step is traced at concrete
# sizes instead (``loss_has_vjp_rules``).
_VJP_CALLS = tuple(c for c in INLINED_CALLS if c != "custom_jvp_call")


# The primitives that draw random numbers, their `shape` param saying how many
# (rng.py), and the user's sharding hints (hints.py): named here, which both
# modules import (through rows.py).
DRAW_PRIMITIVES = ("random_bits", "random_split")
HINT_PRIMITIVES = ("sharding_constraint", "reshard")
_DRAWS = frozenset(DRAW_PRIMITIVES)
_DRAWS_AND_HINTS = frozenset(DRAW_PRIMITIVES + HINT_PRIMITIVES)


def _bodies_hold(jaxpr, names, calls=("custom_jvp_call",)) -> bool:
  """Whether a call ``calls`` names in ``jaxpr`` (at any depth) holds one of
  the primitives ``names`` in its body."""
  return any((e.primitive.name in calls and
              any(primitive_names(sub) & names for sub in jaxprs_in(e))) or
             any(_bodies_hold(sub, names, calls) for sub in jaxprs_in(e))
             for e in jaxpr.eqns)


def loss_rules_draw(closed: ClosedJaxpr) -> bool:
  """Whether a custom derivative's body in the loss function's forward call
  in ``closed`` draws random numbers: kept as a call (a step traced at
  concrete sizes keeps its rules), the draw would not be given its rows of
  the whole batch's draw."""
  return any(e.primitive is forward_p and _bodies_hold(
      e.params["jaxpr"].jaxpr, _DRAWS, ("custom_jvp_call", "custom_vjp_call",
                                       "custom_vjp_call_jaxpr"))
      for e in closed.jaxpr.eqns)


def inline_loss_rules(closed: ClosedJaxpr, *, fn_name: str) -> ClosedJaxpr:
  """``closed`` with the ``custom_vjp`` calls inside its loss function's
  forward call inlined too, for a pipeline traced at a symbolic size: it
  differentiates each stage's share of the loss function on its own, from
  its primal equations and custom_jvp rules. Only autopar's own custom_vjp
  is left at that point, whose backward is its primal's derivative."""
  eqns = []
  for eqn in closed.jaxpr.eqns:
    if eqn.primitive is forward_p:
      f = eqn.params["jaxpr"]
      # A random draw or a sharding hint inside a custom_jvp's body: the
      # passes that give draws their rows and hints their stage do not look
      # into the call, so the loss's custom_jvp calls are inlined (each stage
      # differentiates their primal equations, as before rules were kept).
      keep_jvp = not _bodies_hold(f.jaxpr, _DRAWS_AND_HINTS)
      jaxpr, consts = _inline(f.jaxpr, list(f.consts), fn_name,
                              _VJP_CALLS if keep_jvp else INLINED_CALLS)
      eqn = eqn.replace(params={**eqn.params, "jaxpr": ClosedJaxpr(jaxpr, consts)})
    eqns.append(eqn)
  return ClosedJaxpr(closed.jaxpr.replace(eqns=eqns), closed.consts)


def loss_has_vjp_rules(closed: ClosedJaxpr) -> bool:
  """Whether the loss function's forward call in ``closed`` holds a
  ``jax.custom_vjp`` call (at any depth) other than autopar's own (whose
  backward is its primal's derivative, written to save memory: the chunked
  cross-entropy's): its gradient is the rule's, which a pipeline traced at a
  symbolic size cannot keep (:func:`inline_loss_rules`)."""
  def user_rule(eqn) -> bool:
    if eqn.primitive.name not in ("custom_vjp_call", "custom_vjp_call_jaxpr"):
      return False
    bwd = eqn.params.get("bwd")
    module = getattr(getattr(bwd, "f", bwd), "__module__", None) or ""
    return not module.startswith("autopar.")

  def has(jaxpr) -> bool:
    return any(user_rule(e) or any(has(s) for s in jaxprs_in(e)) for e in jaxpr.eqns)
  return any(e.primitive is forward_p and has(e.params["jaxpr"].jaxpr)
             for e in closed.jaxpr.eqns)


def loss_jvp_rules_trace(closed: ClosedJaxpr) -> bool:
  """Whether every ``jax.custom_jvp`` rule in the loss function's forward
  call in ``closed`` (a step traced at a symbolic size) can be traced at
  that size, as a pipeline's stages trace them (:func:`inline_loss_rules`
  keeps them): a rule whose Python compares the batch size cannot, and the
  step is then traced at concrete sizes. Each rule is traced here once (JAX
  keeps the trace for the stages)."""
  def rules(jaxpr):
    for e in jaxpr.eqns:
      if e.primitive.name == "custom_jvp_call" and any(
          any(jc.is_symbolic_dim(d) for d in getattr(v.aval, "shape", ()))
          for v in (*e.invars, *e.outvars)):
        yield e
      for sub in jaxprs_in(e):
        yield from rules(sub)
  for call in closed.jaxpr.eqns:
    if call.primitive is not forward_p:
      continue
    for e in rules(call.params["jaxpr"].jaxpr):
      try:
        e.params["jvp_jaxpr_fun"].call_wrapped(
            *[False] * (len(e.invars) - e.params["num_consts"]))
      except Exception:    # (whatever the rule's Python raises at a symbolic size)
        return False
  return True


def _has_calls(jaxpr, inlinable=INLINED_CALLS) -> bool:
  return any(e.primitive.name in inlinable or
             any(_has_calls(s, _PLAIN_CALLS if e.primitive in _LOSS_CALLS else inlinable)
                 or count_markers(s) for s in jaxprs_in(e))
             for e in jaxpr.eqns)


def _inline(top: Jaxpr, top_consts: list, fn_name: str,
            inlinable=INLINED_CALLS) -> tuple[Jaxpr, list]:
  """(``top`` with its calls inlined, its consts): callees' consts become
  constvars of ``top``."""
  constvars, consts = list(top.constvars), list(top_consts)
  eqns: list = []

  def inline(jaxpr, env: dict, fresh: bool, names=None):
    # ``names``: the name stack of the calls ``jaxpr`` is inlined from, which
    # its equations' names continue (as lowering the call would name them:
    # ``transpose(jvp(...))`` marks a backward pass's operations in XLA's
    # op names, hlo.entry_schedule).
    def read(a):
      return a if isinstance(a, Literal) else env.get(a, a)
    for eqn in jaxpr.eqns:
      if names is not None:
        eqn = eqn.replace(source_info=eqn.source_info.replace(
            name_stack=names + eqn.source_info.name_stack))
      invars = [read(a) for a in eqn.invars]
      name = eqn.primitive.name
      if name not in inlinable:
        if any(count_markers(s) for s in jaxprs_in(eqn)):
          raise MarkerError(
              f"{fn_name}: the grad marker (autopar.grad / autopar.value_and_grad) "
              f"is inside a '{name}' equation. autopar splits the step at the "
              f"marker, which must not sit inside control flow. Fix: call "
              f"autopar.grad outside scan/while_loop/cond/checkpoint and use "
              f"jax.grad inside them.")
        outvars = eqn.outvars
        if fresh:     # a body inlined twice must not define a variable twice
          outvars = [v if isinstance(v, DropVar) else Var(v.aval) for v in outvars]
          env.update((v, w) for v, w in zip(eqn.outvars, outvars)
                     if not isinstance(v, DropVar))
        params = _inline_params(eqn, fn_name, _PLAIN_CALLS if eqn.primitive in _LOSS_CALLS
                                else inlinable)
        if (outvars is eqn.outvars and params is eqn.params and
            all(a is b for a, b in zip(invars, eqn.invars))):
          eqns.append(eqn)             # reads nothing inlined: kept as it is
        else:
          eqns.append(eqn.replace(invars=invars, outvars=outvars, params=params))
        continue
      sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
      sub_jaxpr = getattr(sub, "jaxpr", sub)
      inner = {}
      for cv, c in zip(sub_jaxpr.constvars, getattr(sub, "consts", ()), strict=True):
        inner[cv] = Var(cv.aval)
        constvars.append(inner[cv])
        consts.append(c)
      # A nested jit's in/out shardings are the user's sharding hints: they
      # stay in the program as sharding constraints (see hints.py).
      ins = eqn.params.get("in_shardings") or (None,) * len(invars)
      invars = [_hint(eqns, x, s, eqn) for x, s in zip(invars, ins, strict=True)]
      inner.update(zip(sub_jaxpr.invars, invars, strict=True))
      inline(sub_jaxpr, inner, True, eqn.source_info.name_stack)
      outs = eqn.params.get("out_shardings") or (None,) * len(eqn.outvars)
      for v, r, s in zip(eqn.outvars, sub_jaxpr.outvars, outs, strict=True):
        if not isinstance(v, DropVar):
          env[v] = _hint(eqns, r if isinstance(r, Literal) else inner.get(r, r), s, eqn)

  env: dict = {}
  inline(top, env, False)
  outvars = [a if isinstance(a, Literal) else env.get(a, a) for a in top.outvars]
  return Jaxpr(constvars, top.invars, outvars, eqns, top.effects, top.debug_info), consts


def _hint(eqns: list, x, sharding, call):
  """``x`` passed through a sharding constraint to ``sharding`` (appended to
  ``eqns``), if it is a NamedSharding; else ``x``."""
  if isinstance(x, Literal) or not isinstance(sharding, NamedSharding):
    return x
  out = Var(x.aval)
  params = dict(sharding=sharding, layout=None, context_mesh=sharding.mesh,
                unconstrained_dims=frozenset())
  eqns.append(jc.new_jaxpr_eqn([x], [out], jc.sharding_constraint_p, params,
                                     jc.no_effects, call.source_info, call.ctx))
  return out


def _inline_params(eqn, fn_name: str, inlinable=INLINED_CALLS) -> dict:
  """Params of a control-flow equation with calls in its bodies inlined."""
  params = eqn.params
  if not any(_has_calls(s, inlinable) for s in jaxprs_in(eqn)):
    return params

  def closed(c):
    jaxpr, consts = _inline(c.jaxpr, list(c.consts), fn_name, inlinable)
    return ClosedJaxpr(jaxpr, consts)

  def opened(j):
    jaxpr, consts = _inline(j, [], fn_name, inlinable)
    return j if consts else jaxpr    # a checkpoint body cannot take consts

  new = {}
  for k, v in params.items():
    if isinstance(v, ClosedJaxpr):
      new[k] = closed(v)
    elif isinstance(v, Jaxpr):
      new[k] = opened(v)
    elif isinstance(v, tuple) and v and all(isinstance(x, ClosedJaxpr) for x in v):
      new[k] = tuple(closed(x) for x in v)
    else:
      new[k] = v
  return new
