"""penzai's models as jax.jit trains them: a tiny llama-like transformer
(``penzai.models.transformer.variants.llamalike_common``, 2 blocks, named
axes, its frozen parameter values bound into the model inside the loss)
trained two steps with a masked token-mean loss under DataParallel,
Zero3Parallel, ShardParallel and a 2-stage PipeshardParallel.

penzai checks that named axes' sizes are ints, so its steps cannot be traced
at a symbolic batch size: autopar traces them at each concrete size it runs
(a device's rows of a micro-batch, a micro-batch, the whole batch). With 16
rows on 8 devices and 2 micro-batches a device holds one row, where JAX
writes the program with other equations than at other sizes (an implicit
broadcast's transpose sums no rows): the row analysis pairs the two traces'
equations by aligning them (``frontend/align.py``)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopar
from models import single_device

pytest.importorskip("penzai", reason="make test installs penzai on Python >= 3.12 "
                    "(.ci/zoo-deps.txt)")
from penzai import pz  # noqa: E402
from penzai.models.transformer.variants import llamalike_common  # noqa: E402

VOCAB, SEQ, BATCH = 32, 8, 16
SGD = optax.sgd(0.1, momentum=0.9)
STEPS = 2


def llamalike():
  """The model without its parameters, and their values by label."""
  config = llamalike_common.LlamalikeTransformerConfig(
      num_kv_heads=2, query_head_multiplier=1, embedding_dim=16, projection_dim=8,
      mlp_hidden_dim=32, num_decoder_blocks=2, vocab_size=VOCAB, mlp_variant="swiglu",
      tie_embedder_and_logits=False, parameter_dtype=jnp.float32,
      activation_dtype=jnp.float32)
  model = llamalike_common.build_llamalike_transformer(
      config, init_base_rng=jax.random.key(0))
  unbound, values = pz.unbind_params(model, freeze=True)
  return unbound, {v.label: v.value for v in values}


def make_step(unbound):
  def loss_fn(params, batch):
    model = pz.bind_variables(unbound, [pz.ParameterValue(label=k, value=v)
                                        for k, v in params.items()])
    tokens = pz.nx.wrap(batch["tokens"]).tag("batch", "seq")
    logits = model(tokens[{"seq": pz.slice[:-1]}])
    log_probs = pz.nx.nmap(jax.nn.log_softmax)(
        logits.untag("vocabulary")).tag("vocabulary")
    nll = -log_probs[{"vocabulary": tokens[{"seq": pz.slice[1:]}]}]
    mask = pz.nx.wrap(batch["mask"]).tag("batch", "seq")
    return ((nll * mask).unwrap("batch", "seq").sum()
            / mask.unwrap("batch", "seq").sum())

  def step(params, opt_state, batch):
    loss, grads = autopar.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = SGD.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return step


def batch_of():
  rng = np.random.RandomState(0)
  mask = (rng.rand(BATCH, SEQ) < 0.7).astype(np.float32)
  mask[:, 0] = 1.0
  return {"tokens": rng.randint(0, VOCAB, size=(BATCH, SEQ + 1)).astype(np.int32),
          "mask": mask}


def train(step, params, batch, run=None):
  """``STEPS`` steps from ``params``: the parameters and the losses."""
  run = run or single_device(step)
  state, losses = (params, SGD.init(params)), []
  for _ in range(STEPS):
    *state, loss = run(*state, batch)
    losses.append(float(loss))
  return state[0], losses


@pytest.fixture(scope="module")
def reference():
  unbound, params = llamalike()
  step = make_step(unbound)
  batch = batch_of()
  return step, params, batch, train(step, params, batch)


def mesh8():
  return jax.make_mesh((8,), ("data",))


def mesh24():
  return jax.make_mesh((2, 4), ("data", "model"))


METHODS = {
    "DataParallel n=2": lambda: autopar.DataParallel(mesh=mesh8(), num_micro_batches=2),
    "Zero3Parallel n=2": lambda: autopar.Zero3Parallel(mesh=mesh8(), num_micro_batches=2),
    "ShardParallel 2x4 n=2": lambda: autopar.ShardParallel(mesh=mesh24(),
                                                           num_micro_batches=2),
}


# How far float32 parameters may be from jit's after the steps. Each step's
# gradient sums the terms of BATCH x SEQ tokens, per device and micro-batch
# and then across, in another order than jit: the sums differ by at most
# about one rounding per term of their magnitude, so the update by
# SUMMATION of the largest update (not of each parameter: a parameter's
# update can be a sum that nearly cancels). Adding the update rounds the
# parameter itself, which can then sit a unit in its last place away, once
# per step: ROUNDING of the parameter. (Measured: one unit in the last place,
# 2.98e-8 on parameters near 0.3 and 1.19e-7 on norm scales near 1.)
EPS = float(np.finfo(np.float32).eps)
SUMMATION = BATCH * SEQ * EPS
ROUNDING = 2 * STEPS * EPS


def assert_params_close(got, ref_params, start):
  """``got`` within SUMMATION of the largest update from ``start`` and
  ROUNDING of jit's ``ref_params`` (see above)."""
  largest = max(float(np.max(np.abs(np.asarray(r) - np.asarray(p))))
                for r, p in zip(jax.tree.leaves(ref_params), jax.tree.leaves(start),
                                strict=True))
  for (path, a), r in zip(jax.tree_util.tree_leaves_with_path(got),
                          jax.tree.leaves(ref_params), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=ROUNDING,
                               atol=SUMMATION * largest, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("method", list(METHODS))
def test_llamalike_transformer_equals_jit(reference, method):
  step, params, batch, (ref_params, ref_losses) = reference
  pf = autopar.parallelize(step, method=METHODS[method](), batch_argnums=(2,),
                           donate_argnums=())
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    got, losses = train(step, params, batch, run=pf)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert_params_close(got, ref_params, params)


def test_pipeline_traces_at_each_size(reference):
  """PipeshardParallel cannot trace penzai's steps at a symbolic batch size:
  it traces them at a micro-batch's rows and at each stage's rows per device
  (the batch split over 'model': 2 rows), and gives jit's numbers. Before,
  an error said it needed a symbolic size."""
  step, params, batch, (ref_params, ref_losses) = reference
  pf = autopar.parallelize(step, method=autopar.PipeshardParallel(
      mesh=mesh24(), num_stages=2, num_micro_batches=2,
      option=autopar.AutoShardingOption(force_batch_dim_to_mesh_dim=("model",))),
      batch_argnums=(2,), donate_argnums=())
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    got, losses = train(step, params, batch, run=pf)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert_params_close(got, ref_params, params)
  plan = pf.get_executable(params, SGD.init(params), batch).plan
  assert [st.batch_axes for st in plan.stages] == [("model",)] * 2
