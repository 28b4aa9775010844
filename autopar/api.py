"""``@autopar.parallelize``: the public facade.

A call prepares its arguments (which are static, batch and donated; their
leaves), finds the :class:`~autopar.signature.Signature` of their key, and
runs its executable on the active runtime; trace -> split -> plan -> lower
is the signature's, made once.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import threading
import weakref
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from autopar import jax_compat
from autopar.runtime import base as runtime
from autopar.runtime import data as runtime_data
from autopar.errors import InputError
from autopar.runtime.executor import Executable, deleted as _deleted, picker
from autopar.method import (ParallelMethod, PipeshardParallel, ShardParallel,
                            auto_mesh, resolve_mesh)
from autopar.plan import Plan
from autopar.frontend.pytrees import Partition
from autopar.planner.replan import Replanner
from autopar.signature import Signature
from autopar.frontend.trace import (ArgFlags, LeafInfo, TracedStep, abstract_leaves, arg_names,
                           batch_candidates, classify_args,
                           state_args, trace_step)

__all__ = ["parallelize", "ParallelizedFunction", "StepSignature", "check_donation"]


def parallelize(fun: Callable | None = None, *, method: ParallelMethod | None = None,
                donate_argnums: int | Sequence[int] | str = "auto",
                batch_argnums: int | Sequence[int] | str = "auto",
                static_argnums: int | Sequence[int] | str = "auto",
                output_reductions: Mapping[str, str] | None = None):
  """Parallelizes a single-device training step over a device mesh.

  Use as ``@parallelize`` or ``@parallelize(method=..., ...)``.

  Args:
    fun: the step, e.g. ``train_step(state, batch) -> (new_state, loss)``. It
      computes its gradients with :func:`autopar.grad` or
      :func:`autopar.value_and_grad`, which marks where the step is split into
      the per-micro-batch gradient computation and the once-per-step update.
    method: how to parallelize (default ``ShardParallel()`` over all devices).
    donate_argnums: arguments whose buffers the step may reuse (the train
      state). ``"auto"`` donates a first argument that looks like a flax
      ``TrainState``.
    batch_argnums: arguments holding the batch; every leaf has a leading
      batch axis that is split into micro-batches and over devices.
      ``"auto"``: the arguments whose array leaves all share one leading
      size, other than the model and optimizer state (``step(state, batch)``,
      ``step(model, optimizer, batch)``, ``step(params, opt_state, x, y)``);
      an error names the candidates when that is ambiguous.
    static_argnums: arguments compiled in as constants. ``"auto"`` treats
      Python scalars, strings and None as static. Inside the other
      arguments, array leaves are traced and every other leaf (a function, a
      string) is static, as under ``equinox.filter_jit``.
    output_reductions: output path (as ``plan.outputs`` names it, or a glob)
      -> ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``: how to combine an
      output over micro-batches and devices where the program does not say
      (autopar derives it for sums, means, maxes and mins over the batch's
      rows and what is computed from them; see docs/gradient_accumulation.md).

  Returns:
    A :class:`ParallelizedFunction`: call it like ``fun``; results come back
    sharded per the plan.

  Example::

      @autopar.parallelize(method=autopar.DataParallel(num_micro_batches=4))
      def train_step(state, batch):
        def loss_fn(params):
          return jnp.mean((state.apply_fn(params, batch["x"]) - batch["y"]) ** 2)
        loss, grads = autopar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss
  """
  def wrap(f):
    return ParallelizedFunction(f, method=method or ShardParallel(),
                                donate_argnums=donate_argnums,
                                batch_argnums=batch_argnums,
                                static_argnums=static_argnums,
                                output_reductions=output_reductions)
  if fun is None:
    return wrap
  return wrap(fun)


@dataclasses.dataclass(frozen=True)
class _Prepared:
  flags: ArgFlags
  leaves: tuple[LeafInfo, ...]
  inputs: Partition            # of the tuple of non-static arguments
  values: list                 # their traced leaves
  key: Any
  names: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class StepSignature:
  """One call signature of a step, as a runtime needs it
  (:meth:`ParallelizedFunction.signature`).

  Attributes:
    plan: the step's plan for these arguments.
    static_argnums: the arguments passed as static Python values.
    traced: the traced step: its outputs (``traced.out_paths``,
      ``traced.outputs``) and the arguments it changes in place
      (``trace.split_updates`` writes them back).
    method: the step's method with the costs resolved for these arguments.
  """
  plan: Plan
  static_argnums: tuple[int, ...]
  traced: TracedStep
  method: ParallelMethod | None = None

  @property
  def num_outputs(self) -> int:
    return len(self.traced.out_paths)


class ParallelizedFunction:
  """A step wrapped by :func:`parallelize`.

  Calling it runs the step; :meth:`get_executable` returns the compiled
  stages and plan; :meth:`plan` plans without compiling.
  """

  def __init__(self, fun: Callable, *, method: ParallelMethod, donate_argnums,
               batch_argnums, static_argnums, output_reductions=None):
    if not isinstance(method, ParallelMethod):
      raise InputError(f"parallelize: method must be one of ShardParallel, "
                       f"DataParallel, Zero2Parallel, Zero3Parallel; got "
                       f"{type(method).__name__}.")
    for name, val in (("donate_argnums", donate_argnums),
                      ("static_argnums", static_argnums),
                      ("batch_argnums", batch_argnums)):
      if isinstance(val, str) and val != "auto":
        raise InputError(f"parallelize: {name}={val!r}; expected 'auto', an int "
                         f"or a tuple of ints.")
    self.fun = fun
    self.method = method
    self.donate_argnums = donate_argnums
    self.batch_argnums = batch_argnums
    self.static_argnums = static_argnums
    if output_reductions is not None and not isinstance(output_reductions, Mapping):
      raise InputError(f"parallelize: output_reductions must map output paths to "
                       f"'sum', 'mean', 'max' or 'min', got "
                       f"{type(output_reductions).__name__}.")
    self.output_reductions = dict(output_reductions or {})
    # Per input signature (its key, ``_prepare``), what autopar made for it:
    # its own costs, traces, plan and executable (``signature.Signature``).
    self._signatures: dict[Any, Signature] = {}
    self._state: dict[Any, frozenset] = {}    # signature -> arguments holding state
    # A call's arguments by what jax.jit keys on (tree structure; per leaf
    # its shape, dtype and weak type, or a static leaf's value) -> their
    # preparation without the values, and where the traced leaves are among
    # the flat leaves: a steady-state call flattens its arguments once.
    self._prepared: dict[Any, tuple[_Prepared, tuple[int, ...]]] = {}
    # Tree structure of a call's arguments -> (the first _Direct of that
    # structure, its batch leaves' shapes -> the compiled SPMD step it ran),
    # called on the next such call's leaves as they come (_Direct).
    self._direct: dict[Any, tuple[_Direct, dict[tuple, _Direct]]] = {}
    self._lock = threading.Lock()
    functools.update_wrapper(self, fun)

  @property
  def name(self) -> str:
    """The step's name in messages (its function's)."""
    return getattr(self.fun, "__name__", "step")

  @property
  def signatures(self) -> tuple[Signature, ...]:
    """The input signatures this step has been called (or planned) with."""
    with self._lock:
      return tuple(self._signatures.values())

  def signature_of(self, prep) -> Signature:
    """The :class:`~autopar.signature.Signature` of prepared arguments (made
    on first use)."""
    with self._lock:
      sig = self._signatures.get(prep.key)
      if sig is None:
        sig = self._signatures[prep.key] = Signature(self, prep)
      return sig

  # -- public ------------------------------------------------------------------

  def __call__(self, *args):
    # On the active runtime: this process, or the Ray cluster's host workers.
    return runtime.active().call(self, args)

  # -- for runtimes (runtime/) --------------------------------------------------

  def run_here(self, *args) -> tuple[Any, TracedStep]:
    """Runs the step on this process's devices (a Ray host worker: on its
    part of the global mesh). Returns the step's whole result, with the
    values of the arguments it changed in place not yet written back, and
    the traced step that says how to write them back
    (``trace.split_updates``)."""
    flat, treedef = jax.tree_util.tree_flatten(tuple(args))
    # (One lookup by the structure, whose hash and comparison walk its
    # nodes, then one by the batch's shapes.)
    entry = self._direct.get(treedef)
    direct = None
    if entry is not None:
      first, by_shape = entry
      direct = by_shape.get(first.batch_shapes(flat))
    if direct is not None:
      outs = direct.run(flat)
      if outs is not None:
        return direct.traced.outputs.merge(outs), direct.traced
    prep = self._prepare(args, (flat, treedef))
    _check_not_donated(prep, self.name)
    check_donation(prep.leaves, prep.values, self.name)
    exe = self.signature_of(prep).executable(prep)
    traced = exe.split.traced
    outs = exe.run_placing(prep.values)
    if isinstance(exe, Executable) and not prep.flags.static and len(prep.values) == len(flat):
      direct = _Direct(exe, traced)   # (every leaf traced: the flat leaves are its values)
      with self._lock:
        if len(self._direct) >= _PREPARED_BOUND:
          self._direct.clear()
        # (The first step of a structure picks the batch leaves of every
        # call of that structure: where they are is the same at every shape.)
        first, by_shape = self._direct.get(treedef, (direct, {}))
        if len(by_shape) >= _PREPARED_BOUND:
          by_shape = {}
        self._direct[treedef] = (first, {**by_shape, direct.batch_shapes(flat): direct})
    return traced.outputs.merge(outs), traced

  def check_donation(self, args: Sequence[Any]) -> None:
    """Raises if ``args`` pass one array as two donated leaves, or as a
    donated and a kept one (:func:`check_donation`)."""
    prep = self._prepare(args)
    check_donation(prep.leaves, prep.values, self.name)

  def signature(self, args: Sequence[Any]) -> StepSignature:
    """What a runtime needs before running a call on ``args`` (arrays or
    ``jax.ShapeDtypeStruct``s): the plan, and the step's outputs."""
    prep = self._prepare(args)
    sig = self.signature_of(prep)
    plan, micro = sig.plan(prep)
    if isinstance(self.method, PipeshardParallel) and sig.one_stage(prep) is None:
      traced = sig.pipeline(prep)[0].split.traced
    else:
      traced = sig.traced(prep, micro).traced
    return StepSignature(plan=plan, static_argnums=tuple(prep.flags.static),
                         traced=traced, method=sig.method)

  def with_method(self, method: ParallelMethod) -> "ParallelizedFunction":
    """The same step, with the same settings, under another method."""
    return ParallelizedFunction(self.fun, method=method,
                                donate_argnums=self.donate_argnums,
                                batch_argnums=self.batch_argnums,
                                static_argnums=self.static_argnums,
                                output_reductions=self.output_reductions)

  def get_executable(self, *args) -> Executable:
    """The compiled step for these arguments (compiled once per signature).

    Example::

        exe = train_step.get_executable(state, batch)
        print(exe.plan.summary()); print(exe.schedule)
    """
    prep = self._prepare(runtime_data.as_shapes(args))
    return self.signature_of(prep).executable(prep)

  def plan(self, *args) -> Plan:
    """Plans the step without compiling or touching devices.

    The arguments may be ``jax.ShapeDtypeStruct`` pytrees (e.g. from
    ``jax.eval_shape``) and the method's mesh an ``AbstractMesh``.
    """
    args = runtime.active().abstractify(args)
    prep = self._prepare(args)
    plan, _ = self.signature_of(prep).plan(prep)
    if isinstance(self.method, ShardParallel) and self.method.plan is None:
      # (Shapes only: the plan must not keep the caller's arrays alive.)
      shapes = jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=jax.typeof(x).weak_type)
          if isinstance(x, jax.Array) else
          jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, np.ndarray) else x, args)
      # The solver's problems where the plan keeps them (a plan the solver
      # made, or its JSON from the plan cache), and a weak reference to the
      # step for what they cannot answer.
      plan = dataclasses.replace(plan, replan=Replanner.with_step(
          plan.replan, weakref.ref(self), tuple(shapes), self.method.option.pin_map))
    return plan

  # -- pipeline ----------------------------------------------------------------

  def _prepare(self, args: Sequence[Any], flattened: tuple | None = None) -> _Prepared:
    """The arguments' flags, leaves, partition, values and key: found by
    what ``jax.jit`` keys on after the first call with such arguments
    (``_prepare_new`` otherwise). ``flattened``: ``tree_flatten(tuple(args))``
    where the caller has it."""
    flat, treedef = flattened or jax.tree_util.tree_flatten(tuple(args))
    try:
      fast = (treedef, tuple(map(_leaf_key, flat)))
      hit = self._prepared.get(fast)
    except TypeError:                     # a static leaf that cannot be compared
      fast, hit = None, None
    if hit is not None:
      template, take = hit
      return dataclasses.replace(template, values=[flat[k] for k in take])
    prep = self._prepare_new(args)
    if fast is not None:
      with self._lock:
        if len(self._prepared) >= _PREPARED_BOUND:
          self._prepared.clear()
        self._prepared[fast] = (dataclasses.replace(prep, values=()),
                                _traced_positions(args, prep))
    return prep

  def _prepare_new(self, args: Sequence[Any]) -> _Prepared:
    names = arg_names(self.fun, len(args))
    if any(isinstance(x, runtime_data.DataSource) for x in jax.tree.leaves(tuple(args))):
      path = next(p for p, x in jax.tree_util.tree_flatten_with_path(tuple(args))[0]
                  if isinstance(x, runtime_data.DataSource))
      raise InputError(
          f"{self.name}: a DataSource at argument{jax.tree_util.keystr(path)} is "
          f"inside another argument; a DataSource is a whole argument (the "
          f"batch). Fix: pass it as the batch itself, e.g. step(state, source), "
          f"with every batch leaf in its like.")
    flags = classify_args(args, static_argnums=self.static_argnums,
                          batch_argnums=self.batch_argnums,
                          donate_argnums=self.donate_argnums, fn_name=self.name,
                          names=names, not_batch=self._state_args(args, names))
    leaves, inputs, values = abstract_leaves(args, flags, names)
    statics = []
    for i in flags.static:
      try:
        hash(args[i])
      except TypeError as e:
        raise InputError(
            f"{self.name}: static argument {names[i]} (argument {i}) of type "
            f"{type(args[i]).__name__} is not hashable, so it cannot key the "
            f"compilation cache. Fix: make it hashable (e.g. a tuple or a frozen "
            f"dataclass), or pass it as arrays and set static_argnums.") from e
      statics.append((i, args[i]))
    key = (flags, tuple(statics), inputs.key,
           tuple((l.shape, l.dtype, l.weak_type) for l in leaves))
    return _Prepared(flags=flags, leaves=tuple(leaves), inputs=inputs,
                     values=values, key=key, names=tuple(names))

  def _state_args(self, args: Sequence[Any], names: Sequence[str]) -> frozenset[int]:
    """With ``batch_argnums="auto"`` and more than one argument it could take
    for the batch: the arguments that hold state instead, the step's own
    word on it (``trace.state_args``: what the gradient is taken of, what the
    update reads), from one trace of the step on the arguments as given,
    once per signature. ``step(w, x)`` with plain arrays then takes ``x``,
    whatever the two's leading sizes."""
    if self.batch_argnums != "auto":
      return frozenset()
    flags = classify_args(args, static_argnums=self.static_argnums, batch_argnums=(),
                          donate_argnums=(), fn_name=self.name, names=names)
    static = flags.static
    if len(batch_candidates(args, static)) < 2:
      return frozenset()
    leaves, inputs, _ = abstract_leaves(args, flags, names)
    key = (static, inputs.key, tuple((l.shape, l.dtype) for l in leaves),
           tuple((i, args[i]) for i in static))
    if key not in self._state:
      try:
        statics = {i: args[i] for i in static}
        traced = trace_step(self.fun, [statics.get(i) for i in range(len(args))], flags,
                            leaves, inputs, micro_batch_size=0,
                            mesh=auto_mesh(resolve_mesh(self.method)), names=names)
        self._state[key] = state_args(traced.jaxpr, leaves)
      except Exception:  # noqa: BLE001 - a step that fails says so when traced again
        self._state[key] = frozenset()
    return self._state[key]

# Kinds of arguments a step keeps the preparation of (``_prepare``); a step
# called with more starts again (like a static leaf that changes each call).
_PREPARED_BOUND = 64


_is_deleted = operator.methodcaller("is_deleted")


def _any_deleted(flat: list) -> bool:
  """Whether a leaf of ``flat`` is a deleted array (``_deleted``), asked in C
  where every leaf is an array."""
  try:
    return any(map(_is_deleted, flat))
  except (AttributeError, TypeError):    # (a leaf that is no jax.Array)
    return any(map(_deleted, flat))


def _single_device(x) -> bool:
  return isinstance(x, jax.Array) and type(x.sharding) is jax.sharding.SingleDeviceSharding


@dataclasses.dataclass(frozen=True, eq=False)
class _Direct:
  """A compiled SPMD step called on the flat leaves of its arguments as they
  come, every leaf traced: its executables check the leaves themselves (in
  JAX's C++, as ``jax.jit`` does), so a steady-state call does no work per
  leaf in Python beyond picking them by role. An executable refuses, before
  it runs and with nothing donated used up, a leaf of another type or
  sharding, a deleted array (one donated to an earlier call) and one buffer
  donated twice or donated and read; the call then takes the full path,
  which places the leaves, or says what is wrong with them. (With several
  executables, ``Executable.run`` places the batch once for all of them,
  and places the update's leaves where the update refuses them after the
  gradient stages ran.)"""
  exe: Executable
  traced: TracedStep

  @functools.cached_property
  def one_device(self) -> bool:
    return len(self.exe.lowered.in_shardings[0].device_set) == 1 \
        if self.exe.lowered.in_shardings else True

  @functools.cached_property
  def checks_identities(self) -> bool:
    """Whether :meth:`run` checks the donated leaves itself: where the
    executable would crash the process on a buffer donated twice (jaxlib <
    0.12, ``jax_compat.EXECUTE_REFUSES_REUSED_DONATION``), and on a
    one-device mesh, where two array objects can hold one buffer."""
    return self.one_device or not jax_compat.EXECUTE_REFUSES_REUSED_DONATION

  def batch_shapes(self, flat: list) -> tuple:
    """The shapes of the batch leaves among ``flat`` (with the structure,
    what tells one batch size's executable from another's)."""
    return tuple(getattr(flat[k], "shape", None) for k in self.exe.lowered.batch)

  @functools.cached_property
  def pickers(self) -> tuple:
    """The donated, kept and batch leaves from the flat ones."""
    lw = self.exe.lowered
    return picker(lw.donated), picker(lw.kept), picker(lw.batch)

  def run(self, flat: list) -> list | None:
    """The flat outputs, or None where the full path must run the call."""
    pick_donated, pick_kept, pick_batch = self.pickers
    donated, kept = pick_donated(flat), pick_kept(flat)
    if self.checks_identities:
      # The full path says what is wrong with: one array passed as two
      # donated leaves, or as a donated and a kept one, any donated
      # single-device array on a one-device mesh (check_donation), an array
      # donated before (_check_not_donated).
      ids = set(map(id, donated))
      if (len(ids) != len(donated) or not ids.isdisjoint(map(id, kept)) or
          _any_deleted(flat) or (self.one_device and any(map(_single_device, donated)))):
        return None
    try:
      if self.exe.one_call:
        return self.exe.run_by_role(donated, kept, pick_batch(flat))
      return self.exe.run(flat, placed=False)
    except (TypeError, ValueError, RuntimeError) as e:
      # The executables' refusals, made before they run: the full path says
      # what is wrong. But a donated leaf deleted after any other error
      # means the step ran (an error of its run or of its outputs): raise.
      # (A deleted array passed in, one donated to an earlier call, is
      # refused as "... has been deleted": the full path names it.)
      if "has been deleted" not in str(e) and any(map(_deleted, donated)):
        raise
      return None


def _leaf_key(x) -> Any:
  """What a leaf contributes to the key of a call's arguments: an array its
  shape, dtype and weak type; anything else (a static leaf, or a Python
  number the step traces) its type and value (identity where it has no
  hash). TypeError for arguments whose preparation is not kept."""
  if isinstance(x, jax.Array):
    return (x.shape, x.dtype, getattr(x, "weak_type", False))   # (a key array has none)
  if isinstance(x, np.ndarray):
    return ("ndarray", x.shape, x.dtype)
  if (hasattr(x, "shape") and hasattr(x, "dtype") and
      not isinstance(x, (np.generic, jax.ShapeDtypeStruct))):
    # Another runtime's array handle (a Ray RemoteArray): not kept by the
    # cache (its value lives as long as the handle), so not cached at all.
    raise TypeError("an array handle")
  try:
    hash(x)
    return (type(x), x)
  except TypeError:
    return (type(x), id(x))


def _traced_positions(args: Sequence[Any], prep: _Prepared) -> tuple[int, ...]:
  """Where ``prep``'s traced leaves are among the flat leaves of ``args``
  (the static arguments' leaves and the static leaves left out)."""
  positions, offset = [], 0
  static = set(prep.flags.static)
  for i, a in enumerate(args):
    n = len(jax.tree_util.tree_leaves(a))
    if i not in static:
      positions.extend(range(offset, offset + n))
    offset += n
  return tuple(p for p, d in zip(positions, prep.inputs.dynamic, strict=True) if d)


def _check_not_donated(prep: _Prepared, name: str) -> None:
  """A buffer donated to an earlier call is an autopar error, not JAX's
  "Array has been deleted"."""
  for leaf, x in zip(prep.leaves, prep.values, strict=True):
    if _deleted(x):
      raise InputError(
          f"{name}: argument leaf {leaf.path} (shape {leaf.shape}) was donated to "
          f"an earlier call of this step, which reused its buffer for the state it "
          f"returned. Fix: pass the state that call returned (state, loss = "
          f"step(state, batch)), or keep the inputs with donate_argnums=().")


def check_donation(leaves: Sequence[LeafInfo], values: Sequence[Any], name: str) -> None:
  """One array passed as two donated leaves (tied weights built by reuse),
  or as a donated leaf and a kept one, is an error before anything runs: a
  donated buffer is overwritten by one result (plain ``jax.jit`` crashes
  the process on it)."""
  # The common case at once: every donated array its own object on several
  # devices (their buffers differ), and no kept leaf one of them.
  donated_ids = {id(x) for l, x in zip(leaves, values) if l.is_donated}
  if (len(donated_ids) == sum(l.is_donated for l in leaves) and
      not any(l.is_donated and _single_device(x) for l, x in zip(leaves, values)) and
      not any(not l.is_donated and id(x) in donated_ids for l, x in zip(leaves, values))):
    return
  donated: dict[Any, LeafInfo] = {}
  for leaf, x in zip(leaves, values, strict=True):
    if leaf.is_donated and isinstance(x, jax.Array):
      first = donated.setdefault(_buffer_key(x), leaf)
      if first is not leaf:
        raise InputError(
            f"{name}: donated argument leaves {first.path} and {leaf.path} are the "
            f"same array (shape {leaf.shape}): tied weights built by passing one "
            f"array twice. A donated buffer holds one result after the step, so "
            f"this state cannot be donated. Fix: give each leaf its own array "
            f"(jnp.copy one of them; to tie weights, keep one leaf and read it "
            f"twice in the model), or keep the inputs: donate_argnums=().")
  for leaf, x in zip(leaves, values, strict=True):
    if not leaf.is_donated and isinstance(x, jax.Array) and _buffer_key(x) in donated:
      raise InputError(
          f"{name}: argument leaf {leaf.path} (shape {leaf.shape}) is the same array "
          f"as the donated leaf {donated[_buffer_key(x)].path}, whose buffer the step "
          f"overwrites with a result. Fix: pass a copy (jnp.copy), or keep the "
          f"inputs: donate_argnums=().")


def _buffer_key(x: jax.Array):
  """What tells two arrays' buffers apart: the object (a sharded array put
  again on its own sharding is the same object), or for an array on one
  device its buffer (``jax.device_put`` of it makes a new object on the same
  buffer)."""
  if isinstance(x.sharding, jax.sharding.SingleDeviceSharding):
    try:
      return ("buffer", x.unsafe_buffer_pointer())
    except RuntimeError:       # deleted (donated earlier): the donation check says so
      pass
  return id(x)
