"""The model libraries people use, written as their users write them: Flax
NNX (modules passed in and changed in place, or split and merged), Equinox
(modules with non-array leaves, filtered gradients), NNX metrics; each
against the library's own jit."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import autopar
from models import assert_trees_close

SGD = optax.sgd(0.1, momentum=0.9)
VOCAB, SEQ, D, HEADS, LAYERS, BATCH = 32, 8, 32, 4, 2, 16


def methods():
  return {
      "dp": lambda n, **kw: autopar.DataParallel(
          mesh=jax.make_mesh((8,), ("data",)), num_micro_batches=n, **kw),
      "zero3": lambda n, **kw: autopar.Zero3Parallel(
          mesh=jax.make_mesh((4, 2), ("data", "model")), num_micro_batches=n, **kw),
      "shard": lambda n, **kw: autopar.ShardParallel(
          mesh=jax.make_mesh((2, 4), ("data", "model")), num_micro_batches=n, **kw),
      "pipeshard": lambda n, **kw: autopar.PipeshardParallel(
          mesh=jax.make_mesh((2, 4), ("data", "model")), num_micro_batches=n,
          num_stages=2, **kw),
  }


def tokens(seed=0):
  rng = np.random.RandomState(seed)
  return rng.randint(0, VOCAB, size=(BATCH, SEQ + 1)).astype(np.int32)


# -- Flax NNX --------------------------------------------------------------------

class NnxBlock(nnx.Module):
  def __init__(self, rngs):
    self.ln1, self.ln2 = nnx.LayerNorm(D, rngs=rngs), nnx.LayerNorm(D, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(HEADS, D, decode=False, rngs=rngs)
    self.up, self.down = nnx.Linear(D, 4 * D, rngs=rngs), nnx.Linear(4 * D, D, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.ln1(x), mask=nnx.make_causal_mask(x[..., 0]))
    return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class NnxGPT(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.blocks = nnx.List([NnxBlock(rngs) for _ in range(LAYERS)])
    self.head = nnx.Linear(D, VOCAB, rngs=rngs)

  def __call__(self, t):
    x = self.embed(t)
    for block in self.blocks:
      x = block(x)
    return self.head(x)


def nnx_loss(model, t):
  logits = model(t[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, t[:, 1:]).mean()


def nnx_step(value_and_grad):
  """The nnx.jit style: modules in, changed in place, the loss out."""
  def train_step(model, optimizer, batch):
    loss, grads = value_and_grad(nnx_loss)(model, batch)
    optimizer.update(model, grads)
    return loss
  return train_step


def nnx_make():
  model = NnxGPT(nnx.Rngs(0))
  return model, nnx.Optimizer(model, SGD, wrt=nnx.Param)


def params_of(model):
  return jax.tree.leaves(nnx.state(model, nnx.Param))


@pytest.fixture(scope="module")
def nnx_reference():
  model, opt = nnx_make()
  step = nnx.jit(nnx_step(nnx.value_and_grad))
  losses = [float(step(model, opt, tokens())) for _ in range(2)]
  return losses, params_of(model)


@pytest.mark.parametrize("method", ["dp", "zero3", "shard", "pipeshard"])
def test_nnx_modules_passed_in_and_changed_in_place(nnx_reference, method):
  ref_losses, ref_params = nnx_reference
  for n in ((2,) if method == "pipeshard" else (1, 2)):     # (a pipeline streams several)
    model, opt = nnx_make()
    p = autopar.parallelize(nnx_step(autopar.value_and_grad), method=methods()[method](n))
    losses = [float(p(model, opt, tokens())) for _ in range(2)]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=f"n={n}")
    assert_trees_close(params_of(model), ref_params)
    assert int(opt.step[...]) == 2


def test_nnx_split_and_merge_style(nnx_reference):
  ref_losses, ref_params = nnx_reference

  def train_step(graphdef, state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = autopar.value_and_grad(nnx_loss)(model, batch)
    optimizer.update(model, grads)
    return nnx.split((model, optimizer))[1], loss

  for method, n in (("dp", 1), ("zero3", 2), ("shard", 2)):
    # (The state holds NNX variables, which a step changes in place, as
    # nnx.jit does: each run starts from a fresh one.)
    graphdef, state = nnx.split(nnx_make())
    p = autopar.parallelize(train_step, method=methods()[method](n))
    s, losses = state, []
    for _ in range(2):
      s, loss = p(graphdef, s, tokens())
      losses.append(float(loss))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    model, _ = nnx.merge(graphdef, s)
    assert_trees_close(params_of(model), ref_params)


@pytest.mark.parametrize("loop", ["scan", "unrolled"])
def test_nnx_remat_layers_rolls_the_blocks(nnx_reference, loop):
  ref_losses, ref_params = nnx_reference
  model, opt = nnx_make()
  p = autopar.parallelize(nnx_step(autopar.value_and_grad),
                          method=methods()["dp"](2, remat="layers", remat_loop=loop))
  with warnings.catch_warnings():
    warnings.simplefilter("error")              # "found no repeated layers" fails
    losses = [float(p(model, opt, tokens())) for _ in range(2)]
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert_trees_close(params_of(model), ref_params)
  m2, o2 = nnx_make()
  # Scan: one loop over the layers for the forward pass and one for the
  # backward; unrolled: none, and no conditional.
  text = p.get_executable(m2, o2, tokens()).as_text()["accumulate_grad"]
  assert text.count(" while(") == (2 if loop == "scan" else 0)
  assert text.count(" conditional(") == (2 if loop == "scan" else 0)


def test_an_nnx_update_without_a_grad_marker_is_kept():
  """One micro-batch, no marker: the step's in-place change reaches the
  caller's module (it was lost)."""
  model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
  before = np.asarray(model.kernel[...])

  def double(model, x):
    model.kernel[...] = model.kernel[...] * 2
    return model(x).sum()

  x = np.ones((8, 4), np.float32)
  autopar.parallelize(double, method=methods()["dp"](1))(model, x)
  np.testing.assert_allclose(model.kernel[...], 2 * before)


# -- NNX metrics: combined as the program computes them ------------------------------

class Classifier(nnx.Module):
  def __init__(self, rngs):
    self.l1, self.l2 = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return self.l2(nnx.relu(self.l1(x)))


def metric_step(value_and_grad):
  """The Flax tutorial's train step, with an nnx.MultiMetric passed in."""
  def train_step(model, optimizer, metrics, batch):
    def loss_fn(model):
      logits = model(batch["x"])
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
      return loss, logits
    (loss, logits), grads = value_and_grad(loss_fn, has_aux=True)(model)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])
    optimizer.update(model, grads)
  return train_step


def metric_make():
  model = Classifier(nnx.Rngs(0))
  return (model, nnx.Optimizer(model, SGD, wrt=nnx.Param),
          nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(),
                          loss=nnx.metrics.Average("loss")))


@pytest.mark.parametrize("method", ["dp", "zero3", "shard"])
def test_nnx_multimetric_equals_nnx_jit(method):
  rng = np.random.RandomState(0)
  batch = {"x": rng.randn(32, 8).astype(np.float32),
           "label": rng.randint(0, 4, 32).astype(np.int32)}
  model, opt, metrics = metric_make()
  ref = nnx.jit(metric_step(nnx.value_and_grad))
  for _ in range(2):
    ref(model, opt, metrics, batch)
  want = metrics.compute()
  for n in (1, 2, 4):
    model, opt, metrics = metric_make()
    p = autopar.parallelize(metric_step(autopar.value_and_grad),
                            method=methods()[method](n))
    for _ in range(2):
      p(model, opt, metrics, batch)
    got = metrics.compute()
    for k in want:
      np.testing.assert_allclose(got[k], want[k], rtol=1e-5, err_msg=f"{k}, n={n}")


def test_nnx_metrics_made_and_returned_by_the_step():
  rng = np.random.RandomState(1)
  batch = {"x": rng.randn(32, 8).astype(np.float32),
           "label": rng.randint(0, 4, 32).astype(np.int32)}

  def make_step(value_and_grad):
    def train_step(model, optimizer, batch):
      metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(),
                                loss=nnx.metrics.Average("loss"))
      inner = metric_step(value_and_grad)
      inner(model, optimizer, metrics, batch)
      return metrics.compute(), metrics
    return train_step

  model, opt, _ = metric_make()
  want, want_metrics = nnx.jit(make_step(nnx.value_and_grad))(model, opt, batch)
  for n in (2, 4):
    model, opt, _ = metric_make()
    got, got_metrics = autopar.parallelize(make_step(autopar.value_and_grad),
                                           method=methods()["zero3"](n))(model, opt, batch)
    assert_trees_close(got, want)
    assert int(got_metrics.accuracy.count[...]) == 32    # the whole batch's count


def test_outputs_combined_as_the_program_computes_them():
  """A summed float metric, a count from the batch's size, a root mean
  square, a max and a running total: each the whole batch's; an output no
  sum, max or min over the rows makes is an error naming output_reductions,
  which then says how to combine it."""
  def step(w, total, x):
    def loss_fn(w):
      h = x @ w
      return jnp.mean(h ** 2), h
    (loss, h), g = autopar.value_and_grad(loss_fn, has_aux=True)(w)
    return (w - 0.1 * g, total + jnp.sum(h > 0), loss, jnp.sum(h),
            jnp.asarray(h.shape[0]), jnp.sqrt(jnp.mean(h ** 2)), jnp.max(h))

  w, total = jnp.ones((4, 3)) / 4, jnp.asarray(5, jnp.int32)
  x = np.random.RandomState(0).randn(32, 4).astype(np.float32)
  ref = jax.jit(step)(w, total, x)
  for n in (1, 4):
    out = autopar.parallelize(step, method=methods()["dp"](n), batch_argnums=2)(w, total, x)
    assert_trees_close(out, ref)

  def median(w, x):
    loss, g = autopar.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
    return w - g, jnp.median(x @ w)

  with pytest.raises(autopar.InputError, match=r"out\[1\].*output_reductions"):
    autopar.parallelize(median, method=methods()["dp"](2))(w, x)
  p = autopar.parallelize(median, method=methods()["dp"](2),
                          output_reductions={"out[1]": "max"})
  medians = [float(jnp.median(x[i:i + 2] @ w)) for i in range(0, 32, 2)]
  np.testing.assert_allclose(p(w, x)[1], max(medians), rtol=1e-6)


# -- Equinox ---------------------------------------------------------------------

class EqxBlock(eqx.Module):
  attn: eqx.nn.MultiheadAttention
  mlp: eqx.nn.MLP
  ln1: eqx.nn.LayerNorm
  ln2: eqx.nn.LayerNorm

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    self.attn = eqx.nn.MultiheadAttention(HEADS, D, key=k1)
    self.mlp = eqx.nn.MLP(D, D, 4 * D, 1, activation=jax.nn.gelu, key=k2)
    self.ln1, self.ln2 = eqx.nn.LayerNorm(D), eqx.nn.LayerNorm(D)

  def __call__(self, x):
    h = jax.vmap(self.ln1)(x)
    mask = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
    x = x + self.attn(h, h, h, mask=mask)
    return x + jax.vmap(self.mlp)(jax.vmap(self.ln2)(x))


class EqxGPT(eqx.Module):
  embed: eqx.nn.Embedding
  blocks: list
  head: eqx.nn.Linear

  def __init__(self, key):
    keys = jax.random.split(key, LAYERS + 2)
    self.embed = eqx.nn.Embedding(VOCAB, D, key=keys[0])
    self.blocks = [EqxBlock(k) for k in keys[1:-1]]
    self.head = eqx.nn.Linear(D, VOCAB, key=keys[-1])

  def __call__(self, t):
    x = jax.vmap(self.embed)(t)
    for block in self.blocks:
      x = block(x)
    return jax.vmap(self.head)(x)


def eqx_step(filter_value_and_grad):
  """The eqx.filter_jit style: four arguments, a filtered gradient."""
  def train_step(model, opt_state, x, y):
    def loss_fn(model, x, y):
      logits = jax.vmap(model)(x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    loss, grads = filter_value_and_grad(loss_fn)(model, x, y)
    updates, opt_state = SGD.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss
  return train_step


def eqx_make():
  model = EqxGPT(jax.random.key(0))
  return model, SGD.init(eqx.filter(model, eqx.is_array))


@pytest.fixture(scope="module")
def eqx_reference():
  model, opt_state = eqx_make()
  t = tokens()
  step = eqx.filter_jit(eqx_step(eqx.filter_value_and_grad))
  losses = []
  for _ in range(2):
    model, opt_state, loss = step(model, opt_state, t[:, :-1], t[:, 1:])
    losses.append(float(loss))
  return losses, jax.tree.leaves(eqx.filter(model, eqx.is_array))


@pytest.mark.parametrize("method", ["dp", "zero3", "shard", "pipeshard"])
def test_equinox_transformer_equals_filter_jit(eqx_reference, method):
  ref_losses, ref_arrays = eqx_reference
  t = tokens()
  for n, remat in (((2, "none"),) if method == "pipeshard" else
                   ((1, "none"), (2, "none"), (2, "layers"))):
    model, opt_state = eqx_make()
    p = autopar.parallelize(eqx_step(autopar.filter_value_and_grad),
                            method=methods()[method](n, remat=remat))
    losses = []
    for _ in range(2):
      model, opt_state, loss = p(model, opt_state, t[:, :-1], t[:, 1:])
      losses.append(float(loss))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=f"n={n} {remat}")
    assert_trees_close(jax.tree.leaves(eqx.filter(model, eqx.is_array)), ref_arrays)
    assert model.blocks[0].mlp.activation is jax.nn.gelu      # static leaves come back
    if remat == "layers":
      text = p.get_executable(model, opt_state, t[:, :-1], t[:, 1:]).as_text()
      # forward, backward; ZeRO-3 runs its layers unrolled (remat.layer_loop)
      assert text["accumulate_grad"].count(" while(") == (0 if method == "zero3" else 2)


def test_filter_grad_has_equinox_semantics():
  model = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(0))
  x = jnp.ones((5, 3))

  def loss(m, x, scale):
    return jnp.mean(jax.vmap(m)(x) ** 2) * scale, jnp.float32(1.0)

  (v, aux), g = autopar.filter_value_and_grad(loss, has_aux=True)(model, x, 2.0)
  (rv, raux), rg = eqx.filter_value_and_grad(loss, has_aux=True)(model, x, 2.0)
  np.testing.assert_allclose(v, rv)
  assert jax.tree.structure(g) == jax.tree.structure(rg)
  assert_trees_close(g, rg)
  g2, aux2 = autopar.filter_grad(loss, has_aux=True)(model, x, 2.0)
  assert_trees_close(g2, rg)


# -- arguments a user does not spell out ----------------------------------------------

def test_batch_argument_found_and_errors_name_the_fix():
  w = jnp.ones((4, 3))
  x, y = np.ones((32, 4), np.float32), np.ones((32, 3), np.float32)

  def step(w, x, y):
    loss, g = autopar.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
    return w - g, loss
  p = autopar.parallelize(step, method=methods()["dp"](2))
  assert p._prepare((w, x, y)).flags.batch == (1, 2)       # x and y, one size
  p(w, x, y)
  # A matrix first and the batch second, or the other way round: the step
  # says which is the weight (the gradient is taken of it), whatever the
  # leading sizes; naming the batch gives the same.
  swapped = lambda x, w: step(w, x, x @ w)
  p = autopar.parallelize(swapped, method=methods()["dp"](2))
  assert p._prepare((x, w)).flags.batch == (0,)
  assert_trees_close(p(x, w), jax.jit(swapped)(x, w))
  out = autopar.parallelize(swapped, method=methods()["dp"](2), batch_argnums=0)(x, w)
  assert_trees_close(out, jax.jit(swapped)(x, w))
  square = jnp.ones((32, 32)) / 32                 # as many rows as the batch
  sq = autopar.parallelize(step, method=methods()["dp"](2))
  assert sq._prepare((square, x @ np.ones((4, 32), np.float32), y @ np.ones(
      (3, 32), np.float32))).flags.batch == (1, 2)
  with pytest.raises(autopar.InputError, match="(?s)w cut to 2 rows.*TypeError.*"
                     "if w is not the batch, name the batch with batch_argnums="):
    autopar.parallelize(step, method=methods()["dp"](2), batch_argnums=0)(w, x, y)


def test_a_donated_state_reused_is_an_autopar_error():
  model, opt_state = eqx_make()
  t = tokens()
  p = autopar.parallelize(eqx_step(autopar.filter_value_and_grad),
                          method=methods()["dp"](1), donate_argnums=(0, 1))
  p(model, opt_state, t[:, :-1], t[:, 1:])
  with pytest.raises(autopar.InputError, match="was donated to an earlier call.*"
                     "donate_argnums=\\(\\)"):
    p(model, opt_state, t[:, :-1], t[:, 1:])


def test_alpa_names_and_option_axes():
  import dataclasses
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  option = autopar.AutoShardingOption(mesh_beta={"data": 1e-9})
  alpa = autopar.ShardParallel(devices=mesh, num_micro_batches=2,
                               auto_sharding_option=option)
  ours = autopar.ShardParallel(mesh=mesh, num_micro_batches=2, option=option)
  assert alpa == ours and dataclasses.replace(alpa, num_micro_batches=4).option == option
  assert autopar.DataParallel(devices=jax.devices()[:4]).mesh.axis_sizes == (4,)
  with pytest.raises(autopar.MeshError, match="mesh_beta.*'dta'"):
    autopar.ShardParallel(mesh=mesh, option=autopar.AutoShardingOption(
        mesh_beta={"dta": 1e-9}))
  with pytest.raises(autopar.InputError, match="both option= and auto_sharding_option="):
    autopar.ShardParallel(mesh=mesh, option=option, auto_sharding_option=option)
  w, x = jnp.ones((4, 3)), np.ones((32, 4), np.float32)

  def step(w, x):
    loss, g = autopar.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
    return w - g, loss
  a = autopar.parallelize(step, method=alpa).plan(w, x)
  b = autopar.parallelize(step, method=ours).plan(w, x)
  assert a.inputs == b.inputs and a.objective == b.objective
  # Alpa's force_batch_dim_to_mesh_dim is a mesh dimension's index.
  forced = autopar.ShardParallel(devices=mesh, auto_sharding_option=autopar.AutoShardingOption(
      force_batch_dim_to_mesh_dim=1))
  assert autopar.parallelize(step, method=forced).plan(w, x).batch_axes == ("model",)


# -- Gemma (DeepMind's gemma package, Python >= 3.12) --------------------------------

def gemma_model(version: int, dtype=jnp.float32):
  """A tiny Gemma 3 or Gemma 4 (4 layers alternating sliding-window and global
  attention; Gemma 4 with its per-layer inputs and scalar-reshaped norms)."""
  gm = pytest.importorskip(
      "gemma.gm", reason="the gemma package needs Python >= 3.12 (make test installs "
      "it there)")
  if version == 3:
    cfg = gm.nn.config.TransformerConfig(
        num_embed=VOCAB, embed_dim=D, hidden_dim=2 * D, num_heads=2, head_dim=16,
        num_kv_heads=1, final_logit_softcap=None, use_post_attn_norm=True,
        use_post_ffw_norm=True, use_qk_norm=True, sliding_window_size=4,
        transpose_gating_einsum=True,
        attention_types=gm.nn.config.make_attention_layers_types(
            (gm.nn.AttentionType.LOCAL_SLIDING, gm.nn.AttentionType.GLOBAL), num_layers=4))
    return gm.nn.Gemma3_1B(config=cfg, dtype=dtype)
  from gemma.gm.nn.gemma4 import _config, _gemma4, _modules
  cfg = _config.TransformerConfig(
      num_embed=VOCAB, embed_dim=D, hidden_dim=2 * D, num_heads=2, head_dim=16,
      num_kv_heads=1, final_logit_softcap=30.0, use_post_attn_norm=True,
      use_post_ffw_norm=True, sliding_window_size=4, global_key_size=16,
      global_rope_proportion=0.25, local_rope_proportion=1.0, per_layer_input_dim=8,
      attention_types=_config.make_attention_layers_types(
          (_modules.AttentionType.LOCAL_SLIDING, _modules.AttentionType.GLOBAL),
          num_layers=4))
  return _gemma4.Gemma4_E2B(config=cfg, dtype=dtype)


def gemma_step(model):
  def step(params, opt_state, t):
    def loss_fn(p):
      logits = model.apply({"params": p}, t[:, :-1]).logits
      return optax.softmax_cross_entropy_with_integer_labels(logits, t[:, 1:]).mean()
    loss, grads = autopar.value_and_grad(loss_fn)(params)
    updates, opt_state = SGD.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return step


# (Plain data parallelism on Gemma is the pipeline's trace without remat,
# and data parallelism's path with it: "pipeshard" and "dp remat unrolled".)
GEMMA_METHODS = {
    "shard remat": lambda: methods()["shard"](2, remat="layers"),
    "dp remat unrolled": lambda: methods()["dp"](2, remat="layers", remat_loop="unrolled"),
    "pipeshard": lambda: autopar.PipeshardParallel(
        mesh=jax.make_mesh((2, 4), ("data", "model")), num_micro_batches=2, num_stages=2),
}


@pytest.mark.parametrize("method", sorted(GEMMA_METHODS))
@pytest.mark.parametrize("version", [3, 4])
def test_gemma_equals_jit(version, method):
  """Gemma's Transformer (its __call__ wrapped in nn.jit) two steps as jax.jit
  takes them; every primitive has a sharding rule; remat="layers" finds the
  layers inside the nested jit.

  float32's rounding of the tied embedding's sums, taken in another order on
  8 devices, depends on the CPU's kernels (1e-5 apart on one machine, 1e-6 on
  another), so the comparison is made in float64, where a real difference
  stands out from rounding by ten orders of magnitude. Gemma 4's remat runs
  in float32 (in float64 its layers differ by casts and are not found):
  there autopar's distance from the float64 step is bounded by a small
  multiple of jax.jit's own float32 rounding."""
  x64 = not (version == 4 and "remat" in method)
  dtype = jnp.float64 if x64 else jnp.float32
  with jax.enable_x64(True):
    model = gemma_model(version, dtype)
    t = tokens()
    params = model.init(jax.random.PRNGKey(0), t[:1, :-1])["params"]
    params = jax.tree.map(lambda a: a.astype(dtype), params)
    step = gemma_step(model)

    def two_steps(run, params):
      state, losses = (params, SGD.init(params)), []
      for _ in range(2):
        *state, loss = run(*state, t)
        losses.append(float(loss))
      return state[0], losses

    ref, ref_losses = two_steps(jax.jit(step), params)
    pf = autopar.parallelize(step, method=GEMMA_METHODS[method](), batch_argnums=(2,))
    with warnings.catch_warnings(record=True) as record:
      warnings.simplefilter("always")
      got, losses = two_steps(pf, params)
    if not x64:
      exact, _ = two_steps(jax.jit(gemma_step(gemma_model(version, jnp.float64))),
                           jax.tree.map(lambda a: a.astype(jnp.float64), params))
  said = [str(w.message) for w in record
          if "no sharding rule" in str(w.message) or "found no repeated layers" in str(w.message)]
  assert not said, said
  assert {a.dtype for a in jax.tree.leaves(got)} == {np.dtype(dtype)}
  if x64:
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-12)
    assert_trees_close(got, ref, rtol=1e-10, atol=1e-12)
    return
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  for g, r, e in zip(jax.tree.leaves(got), jax.tree.leaves(ref), jax.tree.leaves(exact),
                     strict=True):
    e = np.asarray(e)
    jit_error = np.max(np.abs(np.asarray(r, np.float64) - e))
    scale = np.max(np.abs(e)) * np.finfo(np.float32).eps
    assert np.max(np.abs(np.asarray(g, np.float64) - e)) <= 8 * jit_error + 64 * scale


def test_remat_and_pipeline_find_layers_inside_a_nested_jit():
  """A Linen model whose __call__ is wrapped in nn.jit (as Gemma's is): the
  layers are found inside the nested jit by remat="layers" and by the
  pipeline's layers="auto"; both equal jax.jit."""
  import flax.linen as nn

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      return x + nn.Dense(D)(jax.nn.gelu(nn.Dense(2 * D)(nn.LayerNorm()(x))))

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      for _ in range(4):
        x = Block()(x)
      return nn.Dense(1)(x)

  model = nn.jit(Net)()
  rng = np.random.RandomState(0)
  x = jnp.asarray(rng.randn(BATCH, D), jnp.float32)
  y = jnp.asarray(rng.randn(BATCH, 1), jnp.float32)
  params = model.init(jax.random.PRNGKey(0), x[:1])

  def step(params, x, y):
    loss, g = autopar.value_and_grad(lambda p: ((model.apply(p, x) - y) ** 2).mean())(params)
    return jax.tree.map(lambda a, b: a - 0.1 * b, params, g), loss

  jaxpr = jax.make_jaxpr(lambda p: model.apply(p, x))(params).jaxpr
  assert [e.primitive.name for e in jaxpr.eqns] == ["jit"]       # the layers are nested
  ref = jax.jit(step)(params, x, y)
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  for method in (autopar.ShardParallel(mesh=mesh, num_micro_batches=2, remat="layers"),
                 autopar.PipeshardParallel(mesh=mesh, num_micro_batches=2, num_stages=2)):
    with warnings.catch_warnings():
      warnings.filterwarnings("error", message=".*found no repeated layers")
      pf = autopar.parallelize(step, method=method, batch_argnums=(1, 2))
      out = pf(params, x, y)
    assert_trees_close(out, ref, rtol=1e-5, atol=1e-6)
  pipeline = pf.get_executable(params, x, y)
  assert len(pipeline.plan.stages) == 2
