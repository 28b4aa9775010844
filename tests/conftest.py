"""Test set-up: 8 simulated CPU devices, before jax is imported anywhere, and
a plan cache of this test session's own (so no plan from an earlier run, or
from the user's ~/.cache, is read)."""

import os
import tempfile

import pytest

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["KERAS_BACKEND"] = "jax"        # Keras 3 (test_model_zoo.py), before it is imported
os.environ["AUTOPAR_CACHE_DIR"] = tempfile.mkdtemp(prefix="autopar-test-cache-")


def pytest_sessionfinish(session, exitstatus):
  """The session's caches (plans, JAX's and autopar's compiled stages: some
  hundreds of MB) go with it."""
  import shutil
  shutil.rmtree(os.environ["AUTOPAR_CACHE_DIR"], ignore_errors=True)


@pytest.hookimpl(optionalhook=True)      # (pytest-xdist's hook)
def pytest_xdist_make_scheduler(config, log):
  """With pytest-xdist (``make test`` runs two processes): each file's
  tests on one process, one after another, so that a module's fixtures are
  made once; the Ray files' tests all on one process, so that no two tests
  run Ray clusters at once. (A scheduler of its own: xdist's
  ``--dist loadgroup`` marks are not read by pytest 9.2.)"""
  from xdist.scheduler import LoadScopeScheduling

  class ByFile(LoadScopeScheduling):
    def _split_scope(self, nodeid):
      path = nodeid.split("::")[0]
      return "ray" if os.path.basename(path).startswith("test_ray_") else path

  return ByFile(config, log)
