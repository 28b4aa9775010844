"""Every JAX internal autopar uses, in one place.

autopar reads and writes jaxprs, registers primitives and lowers some of
them by hand, so it needs names JAX does not promise to keep
(``jax._src``, ``jax.interpreters``). They are imported here and only here:
when a JAX release moves or changes one, this file changes, not the two
dozen modules that use it. ``tests/test_jax_compat.py`` checks that no other
module imports them.

Versions handled: jax and jaxlib 0.10.2 through 0.12.x (the range
``setup.py`` allows). What differs between them is adapted below, each
with the versions it concerns:

- DCE rules: ``rule(used_outputs, eqn)`` up to 0.11, ``rule(used_outputs,
  live_inputs, eqn)`` from 0.12 (``dce_rule``).
- ``scan``'s params: ``num_consts`` / ``num_carry`` up to 0.11, flat trees
  ``ft_in`` / ``ft_out`` from 0.12 (``scan_counts``); the operands are
  consts, carries, scanned inputs in that order in both.
- An equation's context (``JaxprEqnContext._create``) gains the layout mode
  and ``no_collectives`` in 0.12 (``eqn_context_without_mesh``).
- ``jax.interpreters.mlir`` keeps only registration (``register_lowering``,
  ``lower_fun``) in 0.12: ``mlir`` here is ``jax._src.interpreters.mlir``,
  which has the lowering helpers (``broadcast_in_dim``, ``iota``...) in
  every version, and ``hlo`` the StableHLO dialect.

The public, documented extension API (``jax.extend.core``: ``Var``,
``Literal``, ``Jaxpr``, ``ClosedJaxpr``, ``Primitive``...) is imported
directly by the modules that use it.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import inspect
import os
import sys
import sysconfig
import threading
from typing import Callable, Optional, Sequence

import jax
import jaxlib
from jax._src import config as _config
from jax._src import core as _core
from jax._src import dispatch as _dispatch
from jax._src import linear_util as _lu
from jax._src import mesh as _mesh
from jax._src import source_info_util
from jax._src.export import shape_poly as _shape_poly
from jax._src.interpreters import mlir
from jax._src.interpreters import partial_eval as _pe
from jax._src.lax import lax as _lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo
from jax._src.pjit import sharding_constraint_p
from jax._src.xla_bridge import backends_are_initialized
from jax.interpreters import ad, batching

JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())
JAXLIB_VERSION = tuple(int(p) for p in jaxlib.__version__.split(".")[:3] if p.isdigit())

# Whether an executable called with one buffer donated twice, or donated and
# also read, refuses the call before it runs (INVALID_ARGUMENT, nothing
# donated used up): jaxlib 0.12. jaxlib 0.10.2 and 0.11.0 crash the process
# on it (measured), so a caller checks the arguments' identities first.
EXECUTE_REFUSES_REUSED_DONATION = JAXLIB_VERSION >= (0, 12)

# jaxpr data and evaluation ----------------------------------------------------
Tracer = _core.Tracer
ShapedArray = _core.ShapedArray
eval_jaxpr = _core.eval_jaxpr
new_jaxpr_eqn = _core.new_jaxpr_eqn
no_effects = _core.no_effects
is_symbolic_dim = _core.is_symbolic_dim
add_p = _lax.add_p

# partial evaluation -----------------------------------------------------------
convert_constvars_jaxpr = _pe.convert_constvars_jaxpr
make_jaxpr_effects = _pe.make_jaxpr_effects
has_effects = _pe.has_effects
dce_jaxpr = _pe.dce_jaxpr

# meshes -----------------------------------------------------------------------
get_abstract_mesh = _mesh.get_abstract_mesh
# Whether a jaxpr holds a primitive that lowers with the devices in hand (a
# host callback, ``custom_partitioning``, cuDNN's fused attention): then JAX
# requires every sharding of the program to be on one mesh, axis types and all.
needs_devices_to_lower = _dispatch.jaxpr_has_prim_requiring_devices

# source locations -------------------------------------------------------------
summarize_source = source_info_util.summarize
current_name_stack = source_info_util.current_name_stack
user_context = source_info_util.user_context

# Re-exported as they are: the modules primitives are registered and lowered
# with (ad, batching, mlir; ir for hand-written lowerings), the
# sharding-constraint primitive, and whether a backend has been started.
__all__ = [
    "ad", "batching", "mlir", "ir", "hlo", "scan_counts", "sharding_constraint_p", "Tracer", "ShapedArray",
    "eval_jaxpr", "new_jaxpr_eqn", "no_effects",
    "is_symbolic_dim", "add_p", "convert_constvars_jaxpr", "make_jaxpr_effects",
    "has_effects", "dce_jaxpr", "dce_rule", "get_abstract_mesh", "needs_devices_to_lower",
    "summarize_source", "current_name_stack", "user_context", "eqn_context_without_mesh",
    "evaluate_dim", "key_impl_of", "debug_info", "JAX_VERSION", "backends_are_initialized",
    "undecided_dim_equalities", "JAX_SOURCE_DIR", "mapped_jvp_rule",
    "persistent_cache_keeps_all", "JAXLIB_VERSION", "EXECUTE_REFUSES_REUSED_DONATION",
    "serialize_compiled", "load_compiled", "lowering_context", "persistent_cache_hits",
    "lowered_by_jax",
]


def persistent_cache_keeps_all():
  """A context in which (in this thread) JAX's persistent compilation cache
  keeps every module compiled, however quick its compile: a step's small
  stages too (by default JAX keeps those taking >= 1 s), so that a second
  process reads every stage instead of compiling any."""
  return _config.persistent_cache_min_compile_time_secs(0.0)


_HITS = threading.local()
_HITS_HEARD: list = []           # [True] once the listener is registered
_HITS_LOCK = threading.Lock()


def _count_hit(event: str, **_) -> None:
  if event == "/jax/compilation_cache/cache_hits":
    _HITS.count = getattr(_HITS, "count", 0) + 1


def persistent_cache_hits() -> int:
  """How many of this thread's compiles JAX's persistent compilation cache
  has answered (read from it, not compiled), counted from the first call of
  this function in the process on."""
  with _HITS_LOCK:
    if not _HITS_HEARD:
      jax.monitoring.register_event_listener(_count_hit)
      _HITS_HEARD.append(True)
  return getattr(_HITS, "count", 0)


def serialize_compiled(compiled) -> tuple | None:
  """``compiled`` (a ``jax.stages.Compiled``, compiled in this process: one
  read from JAX's persistent cache serializes without some of its code,
  measured on jaxlib 0.12's CPUs) as ``(bytes, in_tree, out_tree)`` that
  :func:`load_compiled` makes an executable of again in another process;
  None for one that cannot be kept so: one that calls back
  into this process (a ``pure_callback``, ``debug.print``: its callbacks
  are this process's objects), has side effects, or closes over constants
  or mutable arrays passed at each call."""
  from jax.experimental import serialize_executable
  unloaded = getattr(getattr(compiled, "_executable", None), "_unloaded_executable", None)
  if unloaded is None or any(getattr(unloaded, name, None) for name in (
      "host_callbacks", "keepalive", "ordered_effects", "unordered_effects")):
    return None
  params = getattr(compiled, "_params", None)
  if params is None or getattr(params, "const_args", None):
    return None
  try:
    return serialize_executable.serialize(compiled)
  except Exception:  # noqa: BLE001 - a backend that cannot serialize: not kept
    return None


def load_compiled(saved: tuple, devices: Sequence) -> "jax.stages.Compiled":
  """The executable :func:`serialize_compiled` kept, loaded onto ``devices``
  (its mesh's, in the mesh's order)."""
  from jax.experimental import serialize_executable
  data, in_tree, out_tree = saved
  return serialize_executable.deserialize_and_load(
      data, in_tree, out_tree, backend=devices[0].client, execution_devices=list(devices))


def lowering_context() -> str:
  """What, besides a program and its shardings, decides what JAX lowers and
  XLA compiles it to in this process: the versions of jax and jaxlib, the
  backend's, the XLA flags, and JAX's configuration: the part tracing and
  lowering read (``jax_default_matmul_precision``, x64, ...) and every
  option besides (``jax_disable_most_optimizations``,
  ``jax_optimization_level``, ...; some change nothing compiled, and a
  change of one only compiles again). Its reprs hold this process's object
  addresses (``text.without_addresses`` leaves them out)."""
  backend = jax.devices()[0].client
  return repr((jax.__version__, jaxlib.__version__, backend.platform,
               backend.platform_version, os.environ.get("XLA_FLAGS", ""),
               os.environ.get("LIBTPU_INIT_ARGS", ""), _config.trace_context(),
               sorted(jax.config.values.items())))


def lowered_by_jax(closed, owners=("jax", "jaxlib", "autopar")) -> bool:
  """Whether every primitive of ``closed`` (a ClosedJaxpr, its sub-programs
  included) lowers by a rule of JAX's or autopar's own: a rule from
  elsewhere (a Triton kernel's, a custom op's) is Python that lowering runs,
  which may make another module from the same program."""
  from jax._src.interpreters import mlir as _mlir
  from jax.extend.core import ClosedJaxpr, Jaxpr
  platform_rules = [rules for rules in _mlir._platform_specific_lowerings.values()]
  seen: set = set()

  plain = ("numpy", "builtins", "functools", "operator", "math", "itertools")

  def owner_ok(rule, depth: int = 0) -> bool:
    # The rule, and the functions it holds (a partial's, a closure's: JAX's
    # mlir.lower_fun wraps the function it lowers), are JAX's or autopar's.
    if isinstance(rule, functools.partial):
      return all(owner_ok(x, depth) for x in (rule.func, *rule.args,
                                               *rule.keywords.values()))
    if not callable(rule) or isinstance(rule, type):
      return True
    module = (getattr(rule, "__module__", None) or "").split(".")[0]
    if module in plain:
      return True
    if module not in owners:
      return False
    cells = getattr(rule, "__closure__", None) or ()
    return depth >= 4 or all(owner_ok(c.cell_contents, depth + 1) for c in cells
                             if _has_contents(c))

  def walk(j) -> bool:
    for eqn in j.eqns:
      prim = eqn.primitive
      if prim not in seen:
        seen.add(prim)
        entries = [r[prim] for r in (_mlir._lowerings, *platform_rules) if prim in r]
        if not entries or not all(owner_ok(e.rule) for e in entries):
          return False
      for p in eqn.params.values():
        for sub in (p if isinstance(p, (tuple, list)) else (p,)):
          if isinstance(sub, ClosedJaxpr) and not walk(sub.jaxpr):
            return False
          if isinstance(sub, Jaxpr) and not walk(sub):
            return False
    return True

  return walk(closed.jaxpr)


def _has_contents(cell) -> bool:
  try:
    cell.cell_contents
  except ValueError:               # (a cell not yet filled)
    return False
  return True


def _takes_live_inputs(rule) -> bool:
  try:
    return len(inspect.signature(rule).parameters) >= 3
  except (TypeError, ValueError):
    return JAX_VERSION >= (0, 12)


# JAX's DCE rule -> its adapted version (process-wide: one per rule).
_ADAPTED: dict = {}


def dce_rule(primitive) -> Optional[Callable]:
  """JAX's DCE rule for ``primitive`` as ``rule(used_outputs, eqn) ->
  (used_inputs, new_eqn | None)``, or None where it has none (the
  equation is kept whole when any output is used)."""
  rule = _pe.dce_rules.get(primitive)
  if rule is None or not _takes_live_inputs(rule):
    return rule
  adapted = _ADAPTED.get(rule)
  if adapted is None:
    def adapted(used_outputs: Sequence[bool], eqn, rule=rule):
      return rule(list(used_outputs), [True] * len(eqn.invars), eqn)
    _ADAPTED[rule] = adapted
  return adapted


def mapped_jvp_rule(rule, write: Callable):
  """A ``custom_jvp_call``'s ``jvp_jaxpr_fun`` param whose jaxpr is
  ``write(jaxpr)`` of ``rule``'s (e.g. written out at a concrete size).

  JAX keeps the rule as a thunk, ``rule(*tangent_is_zero) -> (jaxpr, consts,
  output_tangent_is_zero)``, traced on first call at the equation's input
  types; this one traces it through ``rule`` and rewrites it, once per
  pattern of zero tangents."""
  done: dict = {}

  def thunk(*in_zeros):
    out = done.get(in_zeros)
    if out is None:
      jaxpr, consts, out_zeros = rule.call_wrapped(*in_zeros)
      out = done[in_zeros] = (write(jaxpr), consts, out_zeros)
    return out
  return _lu.wrap_init(thunk, debug_info=rule.debug_info)


def eqn_context_without_mesh(ctx):
  """A copy of ``ctx`` (the config an equation was traced under) whose
  abstract mesh is empty."""
  metadata = ctx.xla_metadata
  metadata = None if metadata is None else tuple(sorted(metadata.items()))
  if hasattr(ctx, "no_collectives"):       # jax >= 0.12
    return _core.JaxprEqnContext._create(
        ctx.compute_type, ctx.threefry_partitionable, _mesh.empty_abstract_mesh,
        ctx.cur_layout_mode, ctx.remove_size_one_mesh_axis, ctx.no_collectives,
        metadata)
  return _core.JaxprEqnContext._create(
      ctx.compute_type, ctx.threefry_partitionable, _mesh.empty_abstract_mesh,
      ctx.remove_size_one_mesh_axis, metadata)


def scan_counts(params) -> tuple[int, int]:
  """(consts, carries) of a ``scan`` equation with ``params``: its operands
  are that many consts, then that many carries, then the scanned inputs;
  its outputs the carries, then the stacked outputs."""
  if "num_carry" in params:
    return params["num_consts"], params["num_carry"]
  consts, carry, _ = params["ft_in"].unpack()
  return len(consts), len(carry)


def debug_info(what: str, num_in: int, num_out: int):
  """Debug info for a jaxpr autopar builds (JAX warns, deprecated, on a
  jaxpr without one)."""
  return _core.DebugInfo("autopar", what, tuple(f"x{i}" for i in range(num_in)),
                         tuple(f"y{i}" for i in range(num_out)))


def key_impl_of(dtype):
  """The PRNG implementation of a key dtype (None for other dtypes)."""
  return getattr(dtype, "_impl", None)


def evaluate_dim(d, env: dict) -> int:
  """The value of the symbolic dimension ``d`` with its symbols bound by
  ``env`` (``{"b": 4}``)."""
  return int(d._evaluate(env))


# Equality of symbolic dimensions ----------------------------------------------
# JAX answers ``d == 16`` on a symbolic dimension ``d`` with False (and ``!=``
# with True) when it cannot prove the answer, instead of raising: ``__eq__``
# also serves hashing (jax/_src/export/shape_poly.py, ``_DimExpr.__eq__``).
# Traced once at a symbolic batch size, a step branching on ``x.shape[0] ==
# 16`` would silently take the other branch. ``undecided_dim_equalities``
# lets the caller answer those comparisons, and see JAX's own.

JAX_SOURCE_DIR = os.path.dirname(os.path.abspath(jax.__file__)) + os.sep
_DimExpr = _shape_poly._DimExpr
_JAX_EQ = _DimExpr.__eq__
_JAX_HASH = _DimExpr.__hash__
_deciding = threading.local()      # .deciders: this thread's, innermost last
_patch_lock = threading.Lock()     # held while the patch is put on or taken off
_patched = 0                       # contexts active, on all threads


def _undecided(a, b) -> bool:
  """Whether JAX's False for ``a == b`` (``a`` symbolic) is a guess: the
  difference is not a constant."""
  if isinstance(b, _DimExpr):
    if a.scope is not b.scope:
      return False
  elif not _core.is_constant_dim(b):
    return False
  return _core.is_symbolic_dim(a - b)


def _caller(depth: int):
  """The frame that compared or hashed a dimension: outside shape_poly
  (``!=`` calls ``==``), this module (``_eq`` calls JAX's, which hashes) and
  generated code (a dataclass's ``__eq__`` or ``__hash__``: its caller's)."""
  frame = sys._getframe(depth)
  while frame is not None and (frame.f_code.co_filename in (_shape_poly.__file__, __file__)
                               or frame.f_code.co_filename.startswith("<")):
    frame = frame.f_back
  return frame


# The instructions of a comparison in Python code: ``==``, ``!=`` (also of
# tuples holding the size) and ``in`` a tuple or list.
_COMPARING = frozenset(dis.opmap[name] for name in ("COMPARE_OP", "CONTAINS_OP"))


def _compares(frame) -> bool:
  """Whether ``frame`` is running a comparison of its own. Otherwise it is
  calling into compiled code that compares (a cache of JAX's looking up its
  key, whose hash table may compare keys of unequal hashes): that is no
  branch of the step's, and a decided "equal" would hand back another
  size's cached trace."""
  return frame.f_code.co_code[frame.f_lasti] in _COMPARING


def _eq(self, other):
  deciders = getattr(_deciding, "deciders", None)
  if not deciders or getattr(_deciding, "busy", False):
    return _JAX_EQ(self, other)
  _deciding.busy = True       # (JAX's answer and deciding hash and compare too)
  try:
    equal = _JAX_EQ(self, other)
    if equal or not _undecided(self, other):
      return equal
    frame = _caller(2)
    if frame is None or not _compares(frame):
      return equal
    for decide in reversed(deciders):
      answer = decide(self, other, frame)
      if answer is not None:
        return bool(answer)
    return equal
  finally:
    _deciding.busy = False


# Where installed libraries live (and autopar): their code hashes shapes for
# its own caches (Equinox does), which is no branch of the step's.
_INSTALLED = tuple(sorted({JAX_SOURCE_DIR, os.path.dirname(os.path.abspath(__file__)) + os.sep,
                           *(os.path.join(sysconfig.get_paths()[k], "")
                             for k in ("purelib", "platlib", "stdlib"))}))


def _hash(self):
  # A set or dict lookup (``x.shape[0] in {16, 32}``) compares by hash
  # first, and no hash of a symbolic size equals an integer's: the user's
  # own code hashing one cannot be answered, so it is refused.
  if getattr(_deciding, "deciders", None) and not getattr(_deciding, "busy", False):
    frame = _caller(2)
    if frame is not None and not frame.f_code.co_filename.startswith(_INSTALLED):
      raise _core.InconclusiveDimensionOperation(
          f"the symbolic dimension '{self}' is hashed at {frame.f_code.co_filename}:"
          f"{frame.f_lineno} (a set or dict lookup, whose answer is not known for "
          f"every size)")
  return _JAX_HASH(self)


@contextlib.contextmanager
def undecided_dim_equalities(decide: Callable):
  """While active, on this thread, an equality between symbolic dimensions
  (or one and an integer) that JAX cannot decide calls ``decide(a, b,
  frame)``: ``frame`` is the Python frame that compared them (outside
  JAX's shape_poly module). It returns whether they are equal, or None to
  leave the question to an enclosing context's ``decide``, and then to JAX
  (unequal). Decided equalities are those of ``==`` and ``!=``; ``<`` and
  the like raise ``InconclusiveDimensionOperation`` as before, and so does
  hashing a symbolic dimension from the user's own code, outside installed
  packages (a set or dict lookup, whose answer ``decide`` cannot give). No lock is held while the caller runs:
  other threads see JAX's answers."""
  global _patched
  with _patch_lock:
    if _patched == 0:
      _DimExpr.__eq__, _DimExpr.__hash__ = _eq, _hash
    _patched += 1
  deciders = _deciding.__dict__.setdefault("deciders", [])
  deciders.append(decide)
  try:
    yield
  finally:
    deciders.pop()
    with _patch_lock:
      _patched -= 1
      if _patched == 0:
        _DimExpr.__eq__, _DimExpr.__hash__ = _JAX_EQ, _JAX_HASH
