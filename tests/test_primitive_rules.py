"""Every primitive a real model's train step uses has a sharding rule, and a
primitive without one still runs, replicated and correct."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

import autopar
import test_model_libraries as libs
from autopar.costs.cost_model import MeshCost
from autopar.costs.strategies import RuleContext, missing_rules, strategies_for
from models import assert_trees_close, transformer_setup

NO_RULE = "no sharding rule"


def mesh24():
  return jax.make_mesh((2, 4), ("data", "model"))


def _rule_warnings(record) -> list[str]:
  return [str(w.message) for w in record if NO_RULE in str(w.message)]


def _linen():
  make_state, step, batch = transformer_setup()
  return step, (make_state(), batch), None


def _nnx():
  model, opt = libs.nnx_make()
  return libs.nnx_step(autopar.value_and_grad), (model, opt, libs.tokens()), None


def _equinox():
  model, opt_state = libs.eqx_make()
  t = libs.tokens()
  return (libs.eqx_step(autopar.filter_value_and_grad), (model, opt_state, t[:, :-1], t[:, 1:]),
          (2, 3))


LIBRARIES = {"flax.linen": _linen, "flax.nnx": _nnx, "equinox": _equinox}


@pytest.mark.parametrize("library", sorted(LIBRARIES))
def test_library_steps_plan_without_a_missing_rule(library):
  """The whole step (forward, backward, update) as ShardParallel plans it:
  every primitive has a rule of its own."""
  step, args, batch_argnums = LIBRARIES[library]()
  kw = {} if batch_argnums is None else {"batch_argnums": batch_argnums}
  # (No plan cache: the warning comes from planning.)
  option = autopar.AutoShardingOption(plan_cache=False)
  pf = autopar.parallelize(step, method=autopar.ShardParallel(mesh=mesh24(), option=option),
                           **kw)
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    pf.plan(*args)
  assert not _rule_warnings(record), _rule_warnings(record)


def _step_with(extra):
  """An MLP step whose loss goes through ``extra(params, hidden)``."""
  def step(params, x, y):
    def loss_fn(p):
      h = jnp.tanh(x @ p["w1"])
      return ((extra(p, h) @ p["w2"] - y) ** 2).mean()
    loss, g = autopar.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda a, b: a - 0.1 * b, params, g), loss
  rng = np.random.RandomState(0)
  params = {"w1": jnp.asarray(rng.randn(8, 16), jnp.float32) * 0.3,
            "w2": jnp.asarray(rng.randn(16, 4), jnp.float32) * 0.3,
            "s": jnp.asarray(1.5, jnp.float32)}
  x = jnp.asarray(rng.randn(16, 8), jnp.float32)
  y = jnp.asarray(rng.randn(16, 4), jnp.float32)
  return step, (params, x, y)


def _scalar_reshape(p, h):
  return h * jnp.reshape(p["s"], (1, 1, 1))[0]          # scalar -> (1, 1, 1)


def _split(p, h):
  a, b = jnp.split(h, 2, axis=1)
  return jnp.concatenate([b * p["s"], a], axis=1)


def _cholesky(p, h):                                     # no sharding rule
  g = p["w1"].T @ p["w1"] + jnp.eye(p["w1"].shape[1])
  return h @ jnp.linalg.cholesky(g)


def _checkpoint_name(p, h):                               # an identity that names h
  return checkpoint_name(h * p["s"], "hidden")


def _dropout(p, h):                                      # rows of the whole batch's draw
  keep = jax.random.bernoulli(jax.random.key(0), 0.9, h.shape)
  return jnp.where(keep, h / 0.9, 0.0) * p["s"]


def _barrier(p, h):                                      # operands of three shapes
  h, w, s = jax.lax.optimization_barrier((h, p["w1"], p["s"]))
  return h * s + jnp.sum(w)


@pytest.mark.parametrize("extra", [_scalar_reshape, _split, _cholesky, _barrier,
                                   _checkpoint_name, _dropout],
                         ids=["scalar-reshape", "split", "no-rule", "barrier", "checkpoint-name",
                              "dropout"])
@pytest.mark.parametrize("method", ["shard", "pipeshard"])
def test_shape_primitives_and_the_fallback_equal_jit(extra, method):
  step, args = _step_with(extra)
  ref = jax.jit(step)(*args)
  option = autopar.AutoShardingOption(plan_cache=False)    # the warning is planning's
  m = (autopar.ShardParallel(mesh=mesh24(), num_micro_batches=2, option=option)
       if method == "shard" else
       autopar.PipeshardParallel(mesh=mesh24(), num_micro_batches=2, num_stages=2,
                                 option=option))
  pf = autopar.parallelize(step, method=m, batch_argnums=(1, 2))
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    out = pf(*args)
  assert_trees_close(out, ref, rtol=1e-5, atol=1e-6)
  said = _rule_warnings(record)
  if extra is _cholesky:
    assert len(said) == 1 and "'cholesky'" in said[0], said
  else:
    assert not said, said


def test_missing_rules_lists_primitives_inside_bodies():
  def f(x):
    return jax.lax.scan(lambda c, r: (c + jnp.linalg.cholesky(r).sum(), None), 0.0, x)[0]
  jaxpr = jax.make_jaxpr(f)(jnp.ones((3, 2, 2)))
  assert missing_rules(jaxpr) == {"cholesky": 1}
  assert missing_rules(jax.make_jaxpr(lambda x: jnp.split(jnp.tanh(x), 2))(jnp.ones(4))) == {}


def test_the_fallback_is_replicated_with_its_cost():
  eqn = next(e for e in jax.make_jaxpr(jax.lax.linalg.cholesky)(jnp.eye(64)).jaxpr.eqns
             if e.primitive.name == "cholesky")
  ctx = RuleContext(("model",), {"model": 4}, MeshCost({"model": 4}),
                    seconds_per_flop=1e-12)
  (only,) = strategies_for(eqn, ctx)
  assert only.out_specs == (((), ()),) and only.in_specs == (((), ()),)
  assert only.compute == pytest.approx(64 * 64 * 1e-12)   # a flop per output element


def test_a_cond_with_a_literal_index_in_the_loss():
  """lax.cond(True, ...) keeps a literal index in the jaxpr; the row
  analysis reads through it (it crashed: a Literal is not hashable)."""
  step, args = _step_with(lambda p, h: jax.lax.cond(True, lambda a: a * p["s"],
                                                     lambda a: a, h))
  ref = jax.jit(step)(*args)
  pf = autopar.parallelize(step, method=autopar.DataParallel(
      mesh=jax.make_mesh((8,), ("data",)), num_micro_batches=2), batch_argnums=(1, 2))
  assert_trees_close(pf(*args), ref, rtol=1e-5, atol=1e-6)
