"""Systematic check: random MLP and transformer shapes x meshes x methods x
micro-batches, each equal to single-device jax.jit (SGD with momentum)."""

import jax
import numpy as np
import optax
from hypothesis import HealthCheck, given, settings, strategies as st

import autopar
from models import assert_trees_close, mlp_setup, single_device, transformer_setup

SGD = optax.sgd(0.05, momentum=0.9)
MESHES = [((1,), ("x",)), ((2, 2), ("data", "model")), ((2, 4), ("data", "model")),
          ((8,), ("d",)), ((2, 2, 2), ("a", "b", "c"))]
METHODS = [autopar.ShardParallel, autopar.DataParallel, autopar.Zero2Parallel,
           autopar.Zero3Parallel]


def run(setup, mesh_i, method_i, n):
  make_state, step, batch = setup
  shape, names = MESHES[mesh_i]
  p = autopar.parallelize(step, method=METHODS[method_i](
      mesh=jax.make_mesh(shape, names), num_micro_batches=n))
  ref_state, ref_loss = single_device(step)(make_state(), batch)
  state, loss = p(make_state(), batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_trees_close(state.params, ref_state.params)


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(din=st.sampled_from([8, 16, 24]), hidden=st.sampled_from([16, 32, 64, 256]),
       dout=st.sampled_from([4, 8]), mesh_i=st.integers(0, 4),
       method_i=st.integers(0, 3), n=st.sampled_from([1, 2, 4]))
def test_random_mlps(din, hidden, dout, mesh_i, method_i, n):
  run(mlp_setup(batch=64, din=din, hidden=hidden, dout=dout, tx=SGD, seed=2),
      mesh_i, method_i, n)


@settings(max_examples=3, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(d=st.sampled_from([16, 32]), heads=st.sampled_from([2, 4]),
       mesh_i=st.integers(0, 4), method_i=st.integers(0, 3), n=st.sampled_from([1, 2]))
def test_random_transformers(d, heads, mesh_i, method_i, n):
  run(transformer_setup(batch=16, seq=8, d=d, heads=heads, layers=1, tx=SGD),
      mesh_i, method_i, n)
