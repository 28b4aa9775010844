"""autopar.DataSource in this process: the one host loads every row, step
after step, with the numbers of the same batches passed as arrays; a loader
that returns other shapes or dtypes, and a source inside another argument,
are named. (On a Ray cluster: tests/test_ray_runtime.py.)"""

import jax
import numpy as np
import pytest

import autopar
from models import StoredBatches, assert_trees_close, transformer_setup


def test_a_source_gives_the_numbers_of_its_batches():
  batches = [transformer_setup(batch=16, seed=s)[2] for s in range(3)]
  make_state, step, _ = transformer_setup(batch=16)
  loader = StoredBatches(batches)
  source = autopar.DataSource(loader, like=loader.like())
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  loaded = autopar.parallelize(step, method=autopar.ShardParallel(mesh=mesh,
                                                                  num_micro_batches=2))
  given = autopar.parallelize(step, method=autopar.ShardParallel(mesh=mesh,
                                                                 num_micro_batches=2))
  a, b = make_state(), make_state()
  for k in range(4):                      # (the fourth step is batch 0 again)
    a, loss_a = loaded(a, source)
    b, loss_b = given(b, batches[k % 3])
    np.testing.assert_allclose(float(loss_a), float(loss_b), rtol=1e-6)
  assert_trees_close(jax.device_get(a.params), jax.device_get(b.params), rtol=1e-6)
  # Planning and compiling take the source as its shapes, loading nothing.
  assert loaded.plan(a, source).summary() == loaded.plan(a, batches[0]).summary()
  assert loaded.get_executable(a, source) is loaded.get_executable(a, batches[0])
  assert source.step == 4


def test_what_a_loader_returns_is_checked():
  make_state, step, batch = transformer_setup(batch=16)
  like = StoredBatches([batch]).like()
  p = autopar.parallelize(step, method=autopar.DataParallel(
      mesh=jax.make_mesh((8,), ("data",))))
  short = autopar.DataSource(lambda s: {k: v[:4] for k, v in batch.items()}, like)
  with pytest.raises(autopar.InputError, match=r"shape \(4, 9\).*expected \(16, 9\)"):
    p(make_state(), short)
  assert short.step == 0                  # (a failed load takes the same batch again)
  floats = autopar.DataSource(lambda s: {k: v.astype(np.float32) for k, v in batch.items()},
                              like)
  with pytest.raises(autopar.InputError, match="as float32; like says int32"):
    p(make_state(), floats)
  other = autopar.DataSource(lambda s: list(batch.values()), like)
  with pytest.raises(autopar.InputError, match="same structure as like"):
    p(make_state(), other)
  with pytest.raises(autopar.InputError, match="a whole argument"):
    p(make_state(), {"inner": autopar.DataSource(StoredBatches([batch]), like)})


def test_a_source_says_what_is_wrong_with_like():
  with pytest.raises(autopar.InputError, match="batch sizes"):
    autopar.DataSource(lambda s: None, like={"x": jax.ShapeDtypeStruct((8, 2), np.float32),
                                             "y": jax.ShapeDtypeStruct((4,), np.int32)})
  with pytest.raises(autopar.InputError, match="scalar"):
    autopar.DataSource(lambda s: None, like={"x": jax.ShapeDtypeStruct((), np.float32)})
  with pytest.raises(autopar.InputError, match="callable"):
    autopar.DataSource("data.npy", like={"x": jax.ShapeDtypeStruct((8,), np.float32)})
