"""Test set-up: 8 simulated CPU devices, before jax is imported anywhere, and
a plan cache of this test session's own (so no plan from an earlier run, or
from the user's ~/.cache, is read)."""

import os
import tempfile

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


def pytest_configure(config):
  # (pytest-xdist registers it; a run without it knows the mark too.)
  config.addinivalue_line("markers", "xdist_group(name): run with the group's tests")


def pytest_collection_modifyitems(config, items):
  """For pytest-xdist's ``--dist loadgroup`` (``make test`` runs two
  workers): each file's tests run on one worker, one after another, so a
  module's fixtures are made once; the Ray files' tests all on one worker,
  so that no two tests run Ray clusters at once."""
  import pytest
  for item in items:
    path = item.nodeid.split("::")[0]
    group = "ray" if os.path.basename(path).startswith("test_ray_") else path
    item.add_marker(pytest.mark.xdist_group(group))
