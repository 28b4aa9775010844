"""docs/ray.md's recipes as written, on a Ray cluster of one node, then two.

The cluster is started as the docs start it: ``ray start --head`` with its
dashboard (``ray[default]``, which autopar's ``ray`` extra installs), token
authentication set up first where the installed Ray has it (2.52 and later:
``RAY_AUTH_MODE=token`` and ``ray get-auth-token --generate``). Then
``examples/train_gpt_ray.py --address auto --mesh 2,4`` joins it, the same
command goes through ``ray job submit`` to the dashboard with the job's
Python spelled out, and once a second node has joined as the several-machines
recipe joins one, it runs again. Each node runs in a fresh HOME and a temp
dir of its own (``RAY_TMPDIR``), so nothing left on this machine by other
runs (a token in ~/.ray, another cluster found by ``--address auto``) can
make the recipe pass, and on ports of its own, so that clusters of other
runs on the machine neither collide with it nor are stopped by it (no
``ray stop``, which would end them all).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
import ray
from models import wait_for_ray_start

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RAY_CLI = os.path.join(os.path.dirname(sys.executable), "ray")
# Token authentication came with Ray 2.52 (`ray get-auth-token`, RAY_AUTH_MODE).
HAS_TOKEN_AUTH = tuple(int(x) for x in ray.__version__.split(".")[:2]) >= (2, 52)
# The example, small: one transformer block, two steps, checkpoints off.
EXAMPLE = ["examples/train_gpt_ray.py", "--address", "auto", "--mesh", "2,4",
           "--layers", "1", "--steps", "2", "--checkpoint-every", "1000"]
LIMIT = 300          # seconds for one run of the example (it takes 15-30 s here)


def _free_ports(n: int) -> list[int]:
  """n distinct free TCP ports on the loopback interface."""
  socks = [socket.socket() for _ in range(n)]
  try:
    for s in socks:
      s.bind(("127.0.0.1", 0))
    return [s.getsockname()[1] for s in socks]
  finally:
    for s in socks:
      s.close()


def _run(cmd: list[str], env: dict, timeout: float = LIMIT) -> str:
  """Runs ``cmd`` in the repository's root; its output, or a test failure
  that shows it."""
  try:
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
  except subprocess.TimeoutExpired as e:
    pytest.fail(f"{' '.join(cmd)} took more than {timeout} s:\n{e.stdout}\n{e.stderr}")
  out = done.stdout + done.stderr
  if done.returncode:
    pytest.fail(f"{' '.join(cmd)} exited with {done.returncode}:\n{out[-6000:]}")
  return out


def _losses(out: str) -> list[str]:
  return re.findall(r"^step \d+: loss (\S+)$", out, flags=re.M)


class Machine:
  """One machine of the recipe: a HOME of its own (no ~/.ray/auth_token but
  what the recipe makes) and a Ray temp dir of its own (``RAY_TMPDIR``:
  ``--address auto`` finds only the cluster this machine's node joined)."""

  def __init__(self):
    self.home = tempfile.mkdtemp(prefix="autopar-ray-home-")
    # Short, under /tmp: Ray's socket paths under it must stay short.
    self.temp = tempfile.mkdtemp(prefix="rr-", dir="/tmp" if os.path.isdir("/tmp") else None)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RAY_") and k != "XLA_FLAGS"}
    env.update(HOME=self.home, RAY_TMPDIR=self.temp,
               # The checkout under test, whatever autopar pip installed.
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p),
               PATH=os.pathsep.join((os.path.dirname(sys.executable), env.get("PATH", ""))))
    self.env = env
    self.node: subprocess.Popen | None = None

  def ray_start(self, *args: str) -> None:
    """``ray start ARGS --block``, returning once the node is up."""
    (agent,) = _free_ports(1)
    self.node = subprocess.Popen(
        [RAY_CLI, "start", *args, "--block", f"--dashboard-agent-listen-port={agent}",
         "--node-ip-address=127.0.0.1", "--num-cpus=2", "--disable-usage-stats"],
        cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    wait_for_ray_start(self.node, f"ray start {' '.join(args)}")

  def end(self) -> None:
    """Ends ``ray start --block`` (which ends the node's processes), then
    any process of this node still running, found by the node's temp dir in
    its command line: this node's alone, never another cluster's."""
    if self.node is not None:
      self.node.terminate()
      try:
        self.node.wait(timeout=60)
      except subprocess.TimeoutExpired:
        self.node.kill()
        self.node.wait(timeout=30)
      for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
          with open(f"/proc/{pid}/cmdline", "rb") as f:
            if self.temp.encode() in f.read():
              os.kill(int(pid), 9)
        except OSError:
          pass
    shutil.rmtree(self.temp, ignore_errors=True)
    shutil.rmtree(self.home, ignore_errors=True)


@pytest.fixture(scope="module")
def head():
  """The head node as the docs' recipe starts it: token authentication set
  up, then ``ray start --head`` with the dashboard. Yields the machine (the
  environment its users run in), the cluster's address and the dashboard's."""
  # Looked for in a process of its own: nothing of Ray's dashboard is
  # imported into the test process.
  probe = subprocess.run([sys.executable, "-c", "import ray.dashboard.optional_deps"],
                         capture_output=True, text=True, timeout=300)
  if probe.returncode != 0:
    pytest.skip(f"Ray's dashboard is not installed (ray[default]; `pip install "
                f"autopar[ray]` or `make test` installs it): "
                f"{probe.stderr.strip().splitlines()[-1:]}")
  machine = Machine()
  try:
    if HAS_TOKEN_AUTH:
      machine.env["RAY_AUTH_MODE"] = "token"
      _run([RAY_CLI, "get-auth-token", "--generate"], machine.env, timeout=120)
      assert os.path.exists(os.path.join(machine.home, ".ray", "auth_token"))
    gcs, dashboard, client = _free_ports(3)
    machine.ray_start("--head", f"--port={gcs}", f"--dashboard-port={dashboard}",
                      "--dashboard-host=127.0.0.1", f"--ray-client-server-port={client}")
    yield machine, f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dashboard}"
  finally:
    machine.end()


@pytest.fixture(scope="module")
def direct(head, tmp_path_factory):
  """The example run on the head node: ``python examples/train_gpt_ray.py
  --address auto --mesh 2,4``; its output."""
  machine, _, _ = head
  ckpt = str(tmp_path_factory.mktemp("direct-ckpt"))
  start = time.monotonic()
  out = _run([sys.executable, *EXAMPLE, "--checkpoint-dir", ckpt], machine.env)
  print(f"\nthe example with --address auto, one node: {time.monotonic() - start:.1f} s")
  return out


def test_the_example_joins_a_ray_start_cluster_of_one_node(direct):
  """--mesh 2,4 alone sizes the cluster: its one node is one host of 8
  simulated devices (it was one device, and a MeshError)."""
  assert "1 hosts, 8 devices, mesh {'data': 2, 'model': 4}" in direct, direct
  losses = _losses(direct)
  assert len(losses) == 2 and all(float(x) > 0 for x in losses), direct


def test_ray_job_submit_runs_the_example_with_the_python_named(head, direct,
                                                               tmp_path):
  """``ray job submit --address http://127.0.0.1:PORT --working-dir . --
  /path/to/python examples/train_gpt_ray.py --address auto --mesh 2,4``:
  the job succeeds, with the losses of the run above."""
  machine, _, dashboard = head
  job = f"autopar-recipe-{os.getpid()}"
  start = time.monotonic()
  submitted = _run([RAY_CLI, "job", "submit", "--address", dashboard,
                    "--submission-id", job, "--working-dir", ".", "--",
                    sys.executable, *EXAMPLE, "--checkpoint-dir", str(tmp_path)],
                   machine.env)
  print(f"\nthe example through ray job submit: {time.monotonic() - start:.1f} s")
  status = _run([RAY_CLI, "job", "status", "--address", dashboard, job], machine.env,
                timeout=120)
  assert re.search(rf"Job '{job}' succeeded", status), submitted + status
  logs = _run([RAY_CLI, "job", "logs", "--address", dashboard, job], machine.env,
              timeout=120)
  assert "1 hosts, 8 devices, mesh {'data': 2, 'model': 4}" in logs, logs
  assert _losses(logs) == _losses(direct), logs


@pytest.fixture(scope="module")
def second_node(head):
  """A second node joined as the multi-machine recipe joins one: a machine
  of its own (no token file in its HOME), ``RAY_AUTH_MODE=token`` and the
  head's token in ``RAY_AUTH_TOKEN``, then ``ray start --address HEAD``."""
  head_machine, address, _ = head
  machine = Machine()
  try:
    if HAS_TOKEN_AUTH:
      token = _run([RAY_CLI, "get-auth-token"], head_machine.env, timeout=120)
      machine.env.update(RAY_AUTH_MODE="token",
                         RAY_AUTH_TOKEN=token.strip().splitlines()[0].strip())
    machine.ray_start(f"--address={address}")
    yield machine
  finally:
    machine.end()


def test_the_example_on_two_nodes_gets_a_host_on_each(head, second_node, direct,
                                                      tmp_path):
  """The multi-machine recipe, two nodes on this one machine: the same
  command on the head node, ``--address auto --mesh 2,4``, now makes a host
  of 4 devices on each node (two processes, jax.distributed between them),
  with the one-host losses."""
  assert not os.path.exists(os.path.join(second_node.home, ".ray", "auth_token"))
  machine, _, _ = head
  start = time.monotonic()
  out = _run([sys.executable, *EXAMPLE, "--checkpoint-dir", str(tmp_path)], machine.env)
  print(f"\nthe example with --address auto, two nodes: {time.monotonic() - start:.1f} s")
  assert "2 hosts, 8 devices, mesh {'data': 2, 'model': 4}" in out, out
  # Printed to 4 decimals: equal up to that rounding (one process's sums and
  # the two processes' gloo all-reduce differ in order only).
  np.testing.assert_allclose([float(x) for x in _losses(out)],
                             [float(x) for x in _losses(direct)], rtol=0, atol=2e-4)
