"""The model zoo: tiny configurations of the model code people bring, each
trained two steps under every method (DataParallel on 8 devices, Zero3,
ShardParallel on a 2 x 4 mesh, PipeshardParallel with two stages; two
micro-batches each) and compared with single-device ``jax.jit`` of the same
step: keras-hub's GPT-2 and Gemma on Keras 3's JAX backend, trained
statelessly, and MaxText's decoder. Flax NNX, Equinox and DeepMind's Gemma
are in test_model_libraries.py.

The libraries are pinned in .ci/zoo-deps.txt; ``make test`` installs them
on Python >= 3.12. Where one is missing its tests skip, saying so.

No model here computes wholly in float64 (Keras casts layer normalization
and attention to float32 whatever the dtype policy, MaxText its RMSNorm's
input), so parameters are compared in float32 with a tolerance taken from
the computation (:func:`assert_params_close`).
"""

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import autopar
from test_model_libraries import SGD, methods

VOCAB, SEQ, BATCH = 32, 8, 16
STEPS = 2
METHODS = ("dp", "zero3", "shard", "pipeshard")


def method(name):
  return methods()[name](2)


def batch(seed=0):
  """Token ids and a padding mask of ``BATCH`` rows of ``SEQ + 1`` tokens,
  each row 3 to SEQ + 1 tokens long (the rest padding)."""
  rng = np.random.RandomState(seed)
  ids = rng.randint(1, VOCAB, size=(BATCH, SEQ + 1)).astype(np.int32)
  lengths = rng.randint(3, SEQ + 2, size=(BATCH, 1))
  mask = (np.arange(SEQ + 1)[None] < lengths).astype(np.int32)
  return ids * mask, mask


def without_missing_rules(fn, *args):
  """``fn(*args)``, checking that no primitive ran without a sharding rule."""
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    out = fn(*args)
  said = [str(w.message) for w in record if "no sharding rule" in str(w.message)]
  assert not said, said
  return out


def assert_params_close(got, want, start):
  """Parameters after ``STEPS`` SGD steps from ``start``, as float32 allows.

  Two runs from one start differ only in the order of float32 sums (over
  the devices' and micro-batches' rows, inside contractions of other
  shapes). Reordering a sum of n terms moves it by at most about
  n * eps * (the sum of the terms' magnitudes) (Higham's gamma_n); a step's
  gradient sums the batch's BATCH * SEQ tokens' terms, and SGD moves every
  parameter by the learning rate times such sums. So a parameter may differ
  by about BATCH * SEQ * eps of the largest change a step makes to any
  parameter, per step (a scale read from the run, whatever the CPU), and by
  the last bit of its own value where a step's rounding went the other way
  (eps of the value, per step). Observed: at most 11 eps of that change.
  """
  got, want, start = (jax.tree.leaves(t) for t in (got, want, start))
  moved = max(float(np.max(np.abs(np.asarray(w, np.float64) - np.asarray(s, np.float64))))
              for w, s in zip(want, start, strict=True))
  eps = float(np.finfo(np.float32).eps)
  for g, w in zip(got, want, strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=STEPS * eps,
                               atol=STEPS * BATCH * SEQ * eps * moved)


# -- keras-hub (Keras 3 on the JAX backend; conftest.py sets KERAS_BACKEND) ------------

def keras_hub_models():
  kh = pytest.importorskip("keras_hub", reason="keras-hub is installed by make test "
                           "(.ci/zoo-deps.txt, Python >= 3.12)")
  import keras
  if keras.backend.backend() != "jax":
    pytest.skip(f"keras was imported on the {keras.backend.backend()} backend; "
                f"these tests need KERAS_BACKEND=jax before keras is imported")
  return keras, kh


def keras_lm(name):
  """A tiny keras-hub causal LM: the backbone, and its tied embedding's
  reverse for the logits, as keras-hub's CausalLM tasks build them (no
  preprocessor: token ids in). GPT-2 keeps its dropout (0.1)."""
  keras, kh = keras_hub_models()
  keras.utils.set_random_seed(0)
  if name == "gpt2":
    backbone = kh.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=16,
        intermediate_dim=32, max_sequence_length=SEQ)
    return kh.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
  backbone = kh.models.GemmaBackbone(
      vocabulary_size=VOCAB, num_layers=2, num_query_heads=2, num_key_value_heads=1,
      hidden_dim=16, intermediate_dim=32, head_dim=8)
  return kh.models.GemmaCausalLM(backbone=backbone, preprocessor=None)


def keras_step(lm, value_and_grad):
  """Keras 3's stateless training loop on JAX: the variables' values in,
  ``stateless_call(..., training=True)`` in a masked token-mean cross
  entropy, the non-trainable variables it returns (dropout's seed
  generators) out, optax on the trainable variables' list."""
  def train_step(trainable, non_trainable, opt_state, ids, mask):
    def loss_fn(trainable, non_trainable):
      logits, non_trainable = lm.stateless_call(
          trainable, non_trainable, {"token_ids": ids[:, :-1], "padding_mask": mask[:, :-1]},
          training=True)
      nll = optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:])
      weights = mask[:, 1:]
      return jnp.sum(nll * weights) / jnp.sum(weights), non_trainable
    (loss, non_trainable), grads = value_and_grad(loss_fn, has_aux=True)(
        trainable, non_trainable)
    updates, opt_state = SGD.update(grads, opt_state, trainable)
    return optax.apply_updates(trainable, updates), non_trainable, opt_state, loss
  return train_step


def run_keras(step, start, non_trainable):
  ids, mask = batch()
  trainable, opt_state, losses = start, SGD.init(start), []
  for _ in range(STEPS):
    trainable, non_trainable, opt_state, loss = step(trainable, non_trainable, opt_state,
                                                     ids, mask)
    losses.append(float(loss))
  return losses, trainable, non_trainable


@pytest.fixture(scope="module", params=["gpt2", "gemma"])
def keras_reference(request):
  lm = keras_lm(request.param)
  start = [v.value for v in lm.trainable_variables]
  non_trainable = [v.value for v in lm.non_trainable_variables]
  reference = run_keras(jax.jit(keras_step(lm, jax.value_and_grad)), start, non_trainable)
  return lm, start, non_trainable, reference


@pytest.mark.parametrize("name", METHODS)
def test_keras_hub_equals_jit(keras_reference, name):
  """Dropout draws each row's mask of the whole batch's draw, so the losses
  and parameters are jax.jit's."""
  lm, start, non_trainable, (ref_losses, ref_params, ref_seeds) = keras_reference
  step = autopar.parallelize(keras_step(lm, autopar.value_and_grad), method=method(name),
                             batch_argnums=(3, 4))
  losses, params, seeds = without_missing_rules(run_keras, step, start, non_trainable)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert_params_close(params, ref_params, start)
  for got, want in zip(seeds, ref_seeds, strict=True):
    np.testing.assert_array_equal(got, want)


# -- MaxText ---------------------------------------------------------------------

MAXTEXT_OVERRIDES = (
    "run_name=zoo", "decoder_block=llama2", "base_emb_dim=32", "base_num_query_heads=2",
    "base_num_kv_heads=2", "head_dim=16", "base_mlp_dim=64", "base_num_decoder_layers=2",
    f"vocab_size={VOCAB}", f"max_target_length={SEQ}", "per_device_batch_size=2",
    "attention=dot_product", "scan_layers=false", "dtype=float32", "weight_dtype=float32",
    "enable_dropout=false", "enable_checkpointing=false", "skip_jax_distributed_system=true")


JAX_LAX = {k: getattr(jax.lax, k) for k in ("with_sharding_constraint", "top_k")}


@pytest.fixture(scope="module")
def maxtext(tmp_path_factory, request):
  """MaxText's config (configs/base.yml with a tiny llama2 decoder), its
  mesh, a model maker and the batch in MaxText's keys."""
  mt = pytest.importorskip("maxtext", reason="MaxText is installed by make test "
                           "(.ci/zoo-deps.txt, Python >= 3.12)")
  # (MaxText's tunix adapter replaces jax.lax.with_sharding_constraint and
  # top_k for the whole process when imported: JAX's are put back after.)
  request.addfinalizer(lambda: vars(jax.lax).update(JAX_LAX))
  from maxtext.configs import pyconfig
  from maxtext.trainers.pre_train import train
  from maxtext.utils import maxtext_utils, model_creation_utils

  base = os.path.join(os.path.dirname(mt.__file__), "configs", "base.yml")
  out = tmp_path_factory.mktemp("maxtext")          # (its logs and metrics)
  config = pyconfig.initialize([None, base, *MAXTEXT_OVERRIDES,
                                f"base_output_directory={out}"])
  mesh = maxtext_utils.get_mesh_from_config(config)

  def make():
    model = model_creation_utils.from_config(config, mesh=mesh, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, SGD, wrt=nnx.Param)

  def step(value_and_grad):
    """The nnx.jit style, with MaxText's own loss (its pre-training
    loss_fn: a masked token-mean cross entropy over targets_segmentation)."""
    def train_step(model, optimizer, data):
      def loss_fn(model):
        return train.loss_fn(model, config, dict(data), None, None, is_train=True)[0]
      loss, grads = value_and_grad(loss_fn)(model)
      optimizer.update(model, grads)
      return loss
    return train_step

  ids, mask = batch()
  positions = np.broadcast_to(np.arange(SEQ, dtype=np.int32), (BATCH, SEQ)).copy()
  data = {"inputs": ids[:, :-1], "inputs_position": positions,
          "inputs_segmentation": mask[:, :-1], "targets": ids[:, 1:],
          "targets_segmentation": mask[:, 1:]}
  return make, step, data, mesh


def params_of(model):
  return nnx.state(model, nnx.Param)


@pytest.fixture(scope="module")
def maxtext_reference(maxtext):
  make, step, data, _ = maxtext
  model, optimizer = make()
  start = jax.tree.map(np.asarray, params_of(model))
  train_step = nnx.jit(step(nnx.value_and_grad))
  losses = [float(train_step(model, optimizer, data)) for _ in range(STEPS)]
  return start, losses, params_of(model)


@pytest.mark.parametrize("name", [
    "dp", "zero3", "shard", "pipeshard",
])
def test_maxtext_equals_jit(maxtext, maxtext_reference, name):
  make, step, data, _ = maxtext
  start, ref_losses, ref_params = maxtext_reference
  model, optimizer = make()
  train_step = autopar.parallelize(step(autopar.value_and_grad), method=method(name))
  losses = without_missing_rules(
      lambda: [float(train_step(model, optimizer, data)) for _ in range(STEPS)])
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert_params_close(params_of(model), ref_params, start)


def test_maxtext_on_its_own_mesh(maxtext, maxtext_reference):
  """MaxText's mesh (twelve axes: fsdp 8, the others 1), its sharding
  constraints naming them: DataParallel, Zero3, ShardParallel and a 2-stage
  pipeline split the batch over it (ShardParallel plans its axes of size 1
  away: before, its planning ran past 130 s and 14 GB)."""
  make, step, data, mesh = maxtext
  start, ref_losses, ref_params = maxtext_reference
  assert len(mesh.axis_names) == 12 and mesh.shape["fsdp"] == 8
  for m in (autopar.DataParallel(mesh=mesh, num_micro_batches=2),
            autopar.Zero3Parallel(mesh=mesh, num_micro_batches=2),
            autopar.ShardParallel(mesh=mesh, num_micro_batches=2),
            autopar.PipeshardParallel(mesh=mesh, num_micro_batches=2, num_stages=2)):
    model, optimizer = make()
    train_step = autopar.parallelize(step(autopar.value_and_grad), method=m)
    losses = [float(train_step(model, optimizer, data)) for _ in range(STEPS)]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_params_close(params_of(model), ref_params, start)


# -- what the zoo found, reproduced small ---------------------------------------------

def test_nnx_remat_layers_in_a_pipeline():
  """An NNX model whose blocks are called through nnx.remat (as MaxText's
  are), under PipeshardParallel, equals nnx.jit. The remat call returns the
  layer's parameters unchanged beside its activations; before, the split
  took every output of the call as depending on the batch, and refused the
  step ("output ... kernel.value uses values computed from the batch other
  than through the gradients": split.depends_on now reads the call's
  body)."""
  import test_model_libraries as libs

  class RematGPT(libs.NnxGPT):
    def __call__(self, t):
      x = self.embed(t)
      for block in self.blocks:
        x = nnx.remat(lambda block, x: block(x))(block, x)
      return self.head(x)

  def make():
    model = RematGPT(nnx.Rngs(0))
    return model, nnx.Optimizer(model, SGD, wrt=nnx.Param)

  model, optimizer = make()
  start = jax.tree.map(np.asarray, params_of(model))
  ref_step = nnx.jit(libs.nnx_step(nnx.value_and_grad))
  ref_losses = [float(ref_step(model, optimizer, libs.tokens())) for _ in range(STEPS)]
  ref_params = params_of(model)
  model, optimizer = make()
  train_step = autopar.parallelize(libs.nnx_step(autopar.value_and_grad),
                                   method=method("pipeshard"))
  losses = without_missing_rules(
      lambda: [float(train_step(model, optimizer, libs.tokens())) for _ in range(STEPS)])
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert_params_close(params_of(model), ref_params, start)
