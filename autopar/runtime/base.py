"""Where parallelized steps run: one interface, a local and a Ray runtime.

A :class:`ParallelizedFunction <autopar.api.ParallelizedFunction>` call,
``save_checkpoint`` and ``restore_checkpoint`` go to the *active runtime*
(:func:`active`):

* :class:`LocalRuntime` (the default): this process's devices;
* the Ray cluster (:class:`autopar.runtime.cluster.RayCluster`), active between
  ``autopar.init("ray", ...)`` and ``autopar.shutdown()``: the driver plans,
  places each input's shards on the host workers and sends one message per
  step; every worker runs the same step on its shards.

A runtime has four operations:

* ``call(step, args)``: one call of a parallelized step. A runtime asks the
  step only for what its public runtime methods give:
  ``step.signature(args)`` (the plan, and how outputs are written back) and
  ``step.run_here(*args)`` (run in this process);
* ``abstractify(args)``: the arguments as the planner sees them (the Ray
  runtime's ``RemoteArray`` handles as shapes);
* ``save_checkpoint`` / ``restore_checkpoint``.

Inside a step both runtimes run the same code: the compiled executables,
and for a pipeline ``PipelineStep.run`` with ``pipeline.transfer.move``
moving values between submeshes (a ``jax.device_put`` in one process, JAX's
cross-host transfer between host workers: every worker runs the schedule,
each stage executes on the hosts that hold its submesh).

Imports go one way: ``api`` uses this module, which uses ``checkpoint``;
``cluster`` implements the Ray runtime and registers it with
:func:`activate`.
"""

from __future__ import annotations

import abc
import os
import threading
from typing import Any, Sequence

from autopar.runtime import checkpoint, data
from autopar.errors import InputError
from autopar.frontend.trace import split_updates

__all__ = ["Runtime", "LocalRuntime", "active", "activate", "deactivate",
           "save_checkpoint", "restore_checkpoint"]


class Runtime(abc.ABC):
  """Where steps run (see the module docstring).

  Attributes:
    platform: the platform of the devices steps run on, where this process
      plans on an AbstractMesh without them (a Ray cluster's, once
      started); None: the mesh's own devices say.
  """

  platform: str | None = None

  @abc.abstractmethod
  def call(self, step, args: Sequence[Any]) -> Any:
    """Runs one call of ``step`` (a ParallelizedFunction) on ``args``."""

  def abstractify(self, args: Any) -> Any:
    """``args`` as the planner sees them."""
    return args

  @abc.abstractmethod
  def save_checkpoint(self, path: str, state: Any) -> None:
    """Saves the arrays of ``state`` under ``path``."""

  @abc.abstractmethod
  def restore_checkpoint(self, path: str, target: Any, shardings: Any) -> Any:
    """The state saved under ``path``, shaped like ``target``."""


class LocalRuntime(Runtime):
  """This process's devices."""

  def call(self, step, args):
    if data.has_sources(args):      # (this process loads every row)
      args = data.materialize(args, step.name)
    whole, traced = step.run_here(*args)
    return split_updates(traced, whole, args)

  def abstractify(self, args):
    return data.as_shapes(args)

  def save_checkpoint(self, path, state):
    checkpoint.save_local(path, checkpoint.arrays_only(state))

  def restore_checkpoint(self, path, target, shardings):
    return checkpoint.restore_here(path, target, shardings)


LOCAL = LocalRuntime()
_ACTIVE: Runtime = LOCAL
_LOCK = threading.Lock()


def active() -> Runtime:
  """The runtime steps run on now."""
  return _ACTIVE


def activate(runtime: Runtime) -> None:
  """Makes ``runtime`` the active one (``autopar.init``)."""
  global _ACTIVE
  with _LOCK:
    _ACTIVE = runtime


def deactivate(runtime: Runtime) -> None:
  """Back to the local runtime, if ``runtime`` is the active one."""
  global _ACTIVE
  with _LOCK:
    if _ACTIVE is runtime:
      _ACTIVE = LOCAL


# -- checkpoints ------------------------------------------------------------------

def save_checkpoint(path: str, state: Any) -> None:
  """Saves the arrays of ``state`` under the directory ``path`` (replaced if
  it exists), each process its own shards. Non-array leaves (e.g. a
  TrainState's ``apply_fn``) are not saved: they come from the ``target``
  on restore. Under a Ray cluster the state stays on the host workers,
  which write it.

  Example::

      autopar.save_checkpoint("/ckpt/step_100", state)
      state = autopar.restore_checkpoint("/ckpt/step_100", state,
                                         exe.plan.input_shardings[0])

  Each array is written with its own sharding (a pipeline's stage arrays
  from their stages' submeshes; nothing is copied over the mesh first).
  Under Ray a state with arrays on part of the devices is written in
  autopar's stage format (``runtime/checkpoint.py``), else with orbax.
  """
  active().save_checkpoint(path, state)


def restore_checkpoint(path: str, target: Any, shardings: Any = None) -> Any:
  """Restores the state saved at ``path``.

  Args:
    path: the directory given to :func:`save_checkpoint`.
    target: a pytree of the same structure: arrays, ``jax.ShapeDtypeStruct``s
      or a state from ``jax.eval_shape``; gives shapes, dtypes and the
      non-array leaves.
    shardings: a pytree of ``NamedSharding`` or ``PartitionSpec`` (with the
      cluster's mesh) like ``target``, e.g. ``plan.input_shardings[0]``;
      None restores every array replicated on the default device (under a
      Ray cluster: each where it was saved, for a pipeline's state). Under
      a Ray cluster a pipeline plan's input_shardings put each array back
      on the stage submesh it was saved on (a submesh there says its shape,
      not where it lies); a state saved from the whole mesh is restored
      onto one mesh of every device.
  """
  if not os.path.isdir(path):
    raise InputError(f"restore_checkpoint: no checkpoint at {path!r}. Fix: pass "
                     f"the directory given to autopar.save_checkpoint.")
  return active().restore_checkpoint(path, target, shardings)
