"""autopar: an auto-parallelizing compiler front end for stock JAX.

Decorate a single-device ``train_step`` with :func:`parallelize`, compute its
gradients with :func:`grad` / :func:`value_and_grad`, and autopar splits it
into per-micro-batch gradient accumulation and a once-per-step update,
chooses a sharding for every array on the mesh, and runs it.
"""

from autopar.api import ParallelizedFunction, parallelize
from autopar.costs.calibrate import calibrate
from autopar.runtime.host_errors import ClusterError
from autopar.runtime.cluster import RemoteArray, global_mesh, init, shutdown
from autopar.errors import (AutoparError, InputError, KeptStagesError, MarkerError, MeshError,
                            PlanError)
from autopar.runtime.executor import Executable
from autopar.frontend.marker import filter_grad, filter_value_and_grad, grad, value_and_grad
from autopar.method import (AutoShardingOption, DataParallel, PipeshardParallel,
                            ShardParallel, Zero2Parallel, Zero3Parallel)
from autopar.frontend.capture import mark_pipeline_boundary
from autopar.plan import Plan
from autopar.runtime.base import restore_checkpoint, save_checkpoint
from autopar.runtime.data import DataSource, HostShard
from autopar.tools.diff import diff
from autopar.version import __version__
from autopar import nn  # noqa: E402  (autopar.nn: memory helpers)


__all__ = [
    "parallelize", "ParallelizedFunction", "Executable", "grad", "value_and_grad",
    "filter_grad", "filter_value_and_grad",
    "ShardParallel", "DataParallel", "Zero2Parallel", "Zero3Parallel",
    "PipeshardParallel", "mark_pipeline_boundary",
    "AutoShardingOption", "Plan", "AutoparError", "InputError", "MarkerError",
    "MeshError", "PlanError", "KeptStagesError", "ClusterError", "init", "shutdown", "global_mesh",
    "RemoteArray", "DataSource", "HostShard", "save_checkpoint", "restore_checkpoint",
    "diff", "calibrate", "nn",
    "__version__",
]
