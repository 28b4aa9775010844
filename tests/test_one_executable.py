"""one_executable (issue 34; the default): with one micro-batch the gradient
and the update compile as one executable, ``grad_and_apply``, with the
numbers of the separate stages (one_executable=False): the language-model losses of test_losses (a token mean
over a mask, a sum, weights, a second reduction, a loss whose cotangent
needs a first pass over the batch), float32 and bfloat16 state, every SPMD
method; and what it is not for is refused."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar
from models import assert_trees_close
from test_losses import (batch_of, make_state, make_step, mesh8, mesh24, summed,
                         token_mean, weighted, with_int_aux, with_z_loss)


def log_sum(p, b):
  from test_losses import nll_of
  return -jnp.log(jnp.sum(jnp.exp(-nll_of(p, b["tokens"])) * b["mask"]))


LOSSES = {"token mean": token_mean, "sum": summed, "weights": weighted,
          "z-loss": with_z_loss, "int aux": with_int_aux, "first pass": log_sum}
METHODS = {"DataParallel": lambda **k: autopar.DataParallel(mesh=mesh8(), **k),
           "Zero3Parallel": lambda **k: autopar.Zero3Parallel(mesh=mesh8(), **k),
           "ShardParallel 2x4": lambda **k: autopar.ShardParallel(mesh=mesh24(), **k)}


def two_ways(loss, method, dtype):
  out = {}
  for one in (False, True):
    pf = autopar.parallelize(make_step(LOSSES[loss]), method=METHODS[method](
        one_executable=one), donate_argnums=(0,), batch_argnums=(1,))
    state = make_state(dtype)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      for seed in range(2):
        state, loss_value, aux = pf(state, batch_of(seed))
    out[one] = (pf, jax.device_get((state.params, loss_value, aux)))
  return out


@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("method", list(METHODS))
def test_one_executable_gives_the_stages_numbers(loss, method):
  out = two_ways(loss, method, jnp.float32)
  pf, (params, value, aux) = out[True]
  separate, (ref_params, ref_value, ref_aux) = out[False]
  if loss == "first pass":      # (the separate stages start with the sums pass)
    assert separate.get_executable(make_state(), batch_of()).schedule[0] == "loss_sums"
  np.testing.assert_allclose(value, ref_value, rtol=1e-6)
  assert_trees_close(params, ref_params, rtol=1e-5, atol=1e-6)
  assert jax.tree.map(np.asarray, aux).keys() == ref_aux.keys()
  for k in aux:
    np.testing.assert_array_equal(aux[k], ref_aux[k])
  assert pf.get_executable(make_state(), batch_of()).schedule == ["grad_and_apply"]


@pytest.mark.parametrize("method", ["DataParallel", "ShardParallel 2x4"])
def test_one_executable_in_bfloat16(method):
  out = two_ways("token mean", method, jnp.bfloat16)
  (_, (params, value, _)), (_, (ref_params, ref_value, _)) = out[True], out[False]
  np.testing.assert_allclose(value, ref_value, rtol=1e-2)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
    assert a.dtype == b.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=2e-2, atol=2e-2)


def test_what_one_executable_is_not_for_is_refused():
  with pytest.raises(autopar.InputError, match="only with one micro-batch"):
    autopar.DataParallel(mesh=mesh8(), num_micro_batches=2, one_executable=True)
  with pytest.raises(autopar.InputError, match="a pipeline runs"):
    autopar.PipeshardParallel(mesh=mesh24(), one_executable=True)
  with pytest.raises(autopar.InputError, match="None, True or False"):
    autopar.DataParallel(mesh=mesh8(), one_executable="auto")
  # The default: one executable with one micro-batch, the stages apart with more.
  for n, schedule in ((1, ["grad_and_apply"]),
                      (2, ["zero_grad", "accumulate_grad", "accumulate_grad", "sync_grad",
                           "apply_grad"])):
    pf = autopar.parallelize(make_step(token_mean), method=autopar.ShardParallel(
        mesh=mesh24(), num_micro_batches=n), batch_argnums=(1,))
    assert pf.get_executable(make_state(), batch_of()).schedule[-len(schedule):] == schedule
