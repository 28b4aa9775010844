"""Arguments and results as pytrees: array leaves traced, the rest static.

A step's arguments are whatever its users' libraries make: a flax
``TrainState``, a Flax NNX module and ``nnx.Optimizer``, an Equinox module
(whose activation functions are leaves), an optax state with callables, plain
dicts. autopar takes each as :func:`partition` splits it, the rule of
``equinox.filter_jit``:

* array leaves (``jax.Array``, NumPy arrays and scalars, ``ShapeDtypeStruct``)
  are traced, sharded and donated;
* every other leaf (a function, a string, an object) is static: compiled in,
  part of the compilation key (by value where it can be hashed, else by
  identity), and handed back as it is where a result holds it;
* a Python number is traced as ``jax.jit`` traces it (a flax ``TrainState``'s
  step counter), except inside an Equinox module, where it is static as
  under ``equinox.filter_jit`` (``eqx.nn.Dropout``'s rate).

Flax NNX modules are pytrees whose leaves are their variables' values; a
step that changes them in place (``optimizer.update(model, grads)``) changes
copies made from the traced leaves. :func:`mutable_args` finds such
arguments, whose values after the step are returned with its results, and
:func:`write_back` puts them into the caller's objects, as ``nnx.jit`` does.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import sys
from typing import Any, Sequence

import jax
import numpy as np

__all__ = ["Partition", "partition", "leaf_mask", "mutable_args", "write_back",
           "ends_with_key", "key_parts"]

_NUMBERS = (int, float, complex)     # bool is an int


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def _static_number_types() -> tuple[type, ...]:
  """Pytree nodes inside which Python numbers are static: Equinox modules,
  if Equinox is in use (it is imported only by its users)."""
  eqx = sys.modules.get("equinox")
  return (eqx.Module,) if eqx is not None else ()


class _ByIdentity:
  """A static leaf that cannot be hashed, keyed by identity (and kept alive
  by the key, so that its id stays its own)."""
  __slots__ = ("obj",)

  def __init__(self, obj):
    self.obj = obj

  def __hash__(self):
    return id(self.obj)

  def __eq__(self, other):
    return isinstance(other, _ByIdentity) and other.obj is self.obj


def _key_of(value):
  try:
    hash(value)
    return value
  except TypeError:
    return _ByIdentity(value)


@dataclasses.dataclass(frozen=True, eq=False)
class Partition:
  """A pytree split into its traced (array) leaves and its static ones.

  Attributes:
    treedef: the structure over every leaf.
    dynamic: per leaf, whether it is traced.
    statics: the static leaves' values, in leaf order.
  """
  treedef: Any
  dynamic: tuple[bool, ...]
  statics: tuple

  @property
  def key(self) -> tuple:
    """What a compilation is keyed by (static leaves by value or identity)."""
    return (self.treedef, self.dynamic, tuple(_key_of(v) for v in self.statics))

  @property
  def num_dynamic(self) -> int:
    return sum(self.dynamic)

  def merge(self, dynamic_leaves: Sequence[Any]):
    """The pytree with ``dynamic_leaves`` in the traced leaves' places."""
    if not self.statics:             # (every leaf traced: a step's usual outputs)
      return jax.tree_util.tree_unflatten(self.treedef, dynamic_leaves)
    dyn, sta = iter(dynamic_leaves), iter(self.statics)
    leaves = [next(dyn) if d else next(sta) for d in self.dynamic]
    return jax.tree_util.tree_unflatten(self.treedef, leaves)

  def dynamic_of(self, leaves: Sequence[Any]) -> list:
    """The traced ones of all of a pytree's ``leaves``."""
    return [x for x, d in zip(leaves, self.dynamic, strict=True) if d]


def leaf_mask(tree, arrays: tuple[type, ...] = ()) -> list[bool]:
  """Per leaf of ``tree``, whether it is traced; ``arrays``: more types that
  stand for arrays (the Ray runtime's remote arrays)."""
  def array(x):
    return _is_array(x) or isinstance(x, arrays)
  modules = _static_number_types()
  if not modules:
    return [array(x) or isinstance(x, _NUMBERS) for x in jax.tree_util.tree_leaves(tree)]
  mask = []
  for piece in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, modules)):
    if isinstance(piece, modules):
      mask.extend(array(x) for x in jax.tree_util.tree_leaves(piece))
    else:
      mask.append(array(piece) or isinstance(piece, _NUMBERS))
  return mask


def partition(tree) -> tuple[list, Partition]:
  """(the traced leaves of ``tree``, its :class:`Partition`)."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  mask = leaf_mask(tree)
  return ([x for x, d in zip(leaves, mask) if d],
          Partition(treedef, tuple(mask), tuple(x for x, d in zip(leaves, mask) if not d)))


# -- in-place updates (Flax NNX) ---------------------------------------------------

def _variable_type():
  nnx = sys.modules.get("flax.nnx")
  return getattr(nnx, "Variable", None) if nnx is not None else None


def _variables(tree) -> list:
  variable = _variable_type()
  if variable is None:
    return []
  return [x for x in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, variable))
          if isinstance(x, variable)]


def mutable_args(args: Sequence[Any]) -> tuple[int, ...]:
  """The arguments a step can change in place: those holding NNX variables."""
  return tuple(i for i, a in enumerate(args) if _variables(a))


def write_back(original, updated) -> None:
  """Puts the values of ``updated`` (a copy of ``original`` the step changed)
  into ``original``'s NNX variables."""
  old, new = _variables(original), _variables(updated)
  assert len(old) == len(new), (len(old), len(new))
  for o, n in zip(old, new):
    if o.get_value() is not n.get_value():
      o.set_value(n.get_value())


_KEY = re.compile(r"\['((?:[^'\\]|\\.)*)'\]|\[\"((?:[^\"\\]|\\.)*)\"\]|\[([^\]]*)\]"
                  r"|\.([A-Za-z_]\w*)|^([A-Za-z_]\w*)")


@functools.lru_cache(maxsize=1 << 16)
def key_parts(path: str) -> tuple[str, ...]:
  """The keys of a pytree key path, however each is spelled:
  ``"s.params['w'][0]"`` -> ``("s", "params", "w", "0")``. Cached: reading
  a plan matches every state leaf's path against every gradient's
  (``tools/groups.py``, ``shard.grad_inputs``), a million calls for a
  24-layer GPT."""
  return tuple(next(g for g in m.groups() if g is not None) for m in _KEY.finditer(path))


def ends_with_key(path: str, suffix: str) -> bool:
  """Whether the pytree key path ``path`` ends with the keys of the key path
  ``suffix``, whole keys, however each is spelled (``"s.params['w']"`` ends
  with ``"['w']"``, not with ``"w']"``; an NNX module's ``model.l1.kernel``
  with its State's ``['l1']['kernel']``)."""
  keys = key_parts(suffix)
  return bool(keys) and key_parts(path)[-len(keys):] == keys
