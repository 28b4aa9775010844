"""The Ray cluster's hosts: joining (or starting) Ray, and how many host
workers it gets with how many devices each.

:func:`connect_ray` joins the cluster at an address (``"auto"``,
``"host:port"``) or starts a local Ray instance, and turns Ray's errors on
joining (token authentication above all) into a ClusterError that says what
to set.

``autopar.init(cluster="ray", ...)`` may be told the host workers
(``num_hosts``), the devices of each (``num_devices_per_host``), the devices
in all (``num_devices``, e.g. the size of the mesh the script will ask
for), any two or one or none of them. :func:`host_layout` fills in the rest
from the cluster's alive nodes:

* A host is a node unless told otherwise: ``num_hosts`` defaults to the
  number of nodes, or to ``num_devices`` over the devices per host.
* With GPUs, a host takes a node's GPUs (the most any node has), or
  ``num_devices`` of them where that is fewer.
* Without GPUs, a host has ``num_devices_per_host`` simulated CPU devices,
  ``num_devices`` split evenly over the hosts, or 1.

For example, on a one-node CPU cluster (``ray start --head``) ``num_devices=8``
gives one host with 8 devices; on two nodes of 4 GPUs each, two hosts of 4;
``num_hosts=2, num_devices_per_host=4`` gives two hosts of 4 on any cluster
(several hosts may share a node). Numbers that do not fit together raise an
:class:`~autopar.errors.InputError` naming them and the fix.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

from autopar.errors import InputError
from autopar.runtime.host_errors import ClusterError

__all__ = ["connect_ray", "HostLayout", "host_layout"]


def connect_ray(address: str | None, num_hosts: int | None) -> None:
  """Connects this process to Ray: to the cluster at ``address``, or, where
  it is None, to a new local instance of this process's own (even where a
  cluster started with ``ray start`` is, or was, running on the machine),
  with a CPU per host worker at least (``num_hosts``).

  Raises:
    ClusterError: the cluster cannot be joined; where it refused this
      process's credentials (token authentication), what to set.
  """
  import ray
  if address is None:
    ray.init(address="local", num_cpus=max(num_hosts or 1, os.cpu_count() or 1),
             include_dashboard=False, log_to_driver=False)
    return
  try:
    ray.init(address=address, log_to_driver=False)
  except Exception as e:   # noqa: BLE001 - Ray wraps its errors in RuntimeError
    causes = [e]
    while causes[-1].__cause__ is not None:
      causes.append(causes[-1].__cause__)
    if any(type(c).__name__ == "AuthenticationError" or "InvalidAuthToken" in str(c)
           for c in causes):
      raise ClusterError(
          f"autopar.init: the Ray cluster at {address!r} refused this process's "
          f"credentials: it uses token authentication (Ray >= 2.52: `ray "
          f"start` turns it on where RAY_AUTH_MODE=token, and in Ray 2.60 where "
          f"a token already exists, e.g. the ~/.ray/auth_token a local "
          f"ray.init() writes since Ray 2.59) and RAY_AUTH_MODE is "
          f"{os.environ.get('RAY_AUTH_MODE', 'unset')!r} here. Fix: set "
          f"RAY_AUTH_MODE=token in this process's environment, with the "
          f"cluster's token in ~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or "
          f"RAY_AUTH_TOKEN (`ray get-auth-token` on the head node prints it).") from e
    raise ClusterError(f"autopar.init: could not join the Ray cluster at "
                       f"{address!r}: {e}. Fix: check the address (`ray status` "
                       f"on the head node prints it) and that the cluster is "
                       f"running.") from e


@dataclasses.dataclass(frozen=True)
class HostLayout:
  """The host workers to start.

  Attributes:
    num_hosts: host workers (one ``jax.distributed`` process each).
    devices_per_host: devices of each worker: GPUs where ``gpus``, otherwise
      simulated CPU devices.
    gpus: whether the cluster has GPUs (each worker then reserves
      ``devices_per_host`` of them).
  """
  num_hosts: int
  devices_per_host: int
  gpus: bool

  @property
  def num_devices(self) -> int:
    return self.num_hosts * self.devices_per_host


def host_layout(node_gpus: Sequence[float], *, num_hosts: int | None = None,
                num_devices_per_host: int | None = None,
                num_devices: int | None = None) -> HostLayout:
  """The host workers for a cluster whose alive nodes have ``node_gpus``.

  Args:
    node_gpus: the GPUs of each alive node (0 for a node without any).
    num_hosts, num_devices_per_host, num_devices: as given to
      ``autopar.init``; None leaves one to be chosen (module docstring).

  Returns:
    The :class:`HostLayout`.

  Raises:
    InputError: the numbers given do not fit together, or ``num_devices``
      does not split evenly over the hosts chosen for it.

  Example: ``host_layout([0], num_devices=8)`` is ``HostLayout(1, 8, False)``
  (one CPU node); ``host_layout([4, 4], num_devices=8)`` is
  ``HostLayout(2, 4, True)``.
  """
  nodes = len(node_gpus)
  gpus = int(max(node_gpus, default=0))
  given = (f"num_hosts={num_hosts}, num_devices_per_host={num_devices_per_host}, "
           f"num_devices={num_devices}")

  def split(total: int, by: int, what: str) -> int:
    if total % by:
      raise InputError(
          f"autopar.init: num_devices={total} is not a multiple of {what} "
          f"({given}; the cluster has {nodes} alive node(s)"
          f"{f' with up to {gpus} GPU(s) each' if gpus else ', no GPUs'}). Fix: "
          f"give num_hosts (a divisor of {total}) or num_devices_per_host, or a "
          f"mesh of another size.")
    return total // by

  if num_devices is None:
    hosts = num_hosts or nodes
    per_host = num_devices_per_host or gpus or 1
  elif num_hosts is not None and num_devices_per_host is not None:
    if num_hosts * num_devices_per_host != num_devices:
      raise InputError(
          f"autopar.init: {num_hosts} hosts x {num_devices_per_host} devices is "
          f"{num_hosts * num_devices_per_host} devices, not num_devices="
          f"{num_devices}. Fix: give two of the three, or numbers that agree.")
    hosts, per_host = num_hosts, num_devices_per_host
  elif num_devices_per_host is not None:
    per_host = num_devices_per_host
    hosts = split(num_devices, per_host, f"num_devices_per_host={per_host}")
  elif num_hosts is not None:
    hosts = num_hosts
    per_host = split(num_devices, hosts, f"num_hosts={hosts}")
  elif gpus:
    per_host = min(gpus, num_devices)
    hosts = split(num_devices, per_host, f"a node's {per_host} GPUs")
  else:
    hosts = nodes
    per_host = split(num_devices, hosts, f"the cluster's {hosts} node(s)")
  return HostLayout(num_hosts=hosts, devices_per_host=per_host, gpus=bool(gpus))
