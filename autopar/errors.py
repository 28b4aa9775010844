"""autopar's exceptions.

Every user-facing failure is an :class:`AutoparError` whose message names what
is wrong (the argument's pytree path, the shape, the mesh axis) and how to fix
it. Internal invariants use ``assert``; nothing a user can cause does.
"""

from __future__ import annotations


class AutoparError(Exception):
  """Base class of every error autopar raises for bad input or bad state."""


class InputError(AutoparError, ValueError):
  """An argument of the parallelized step does not fit the method or the mesh."""


class MarkerError(AutoparError):
  """The step has no grad marker, or more than one, or uses it in a way that cannot be split."""


class MeshError(AutoparError, ValueError):
  """A mesh or a mesh axis name given to autopar is not usable."""


class PlanError(AutoparError):
  """A plan cannot be made, loaded or applied to the given step."""


class KeptStagesError(AutoparError, RuntimeError):
  """The compiled stages autopar loaded from its cache failed on their first
  run, after using up the arrays the step donates."""
