"""The losses language models are trained with, as on one device, under
every method: a token mean over a padding mask, a sum, per-example weights,
a micro-batch with no valid row, autopar.nn.chunked_cross_entropy(mask=),
an integer auxiliary output; bfloat16 parameters; and the steps that mix
rows, refused."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax.sharding import PartitionSpec as P

import autopar
from models import assert_trees_close, single_device

V, D, T, B = 16, 16, 6, 16


def init_params(dtype=jnp.float32, seed=0):
  k = jax.random.split(jax.random.PRNGKey(seed), 5)
  n = lambda key, shape, s: (jax.random.normal(key, shape) * s).astype(dtype)
  return {"embed": n(k[0], (V, D), 1.0),
          "layers": [{"w": n(k[1 + i], (D, D), 0.4), "b": jnp.zeros((D,), dtype)}
                     for i in range(2)],
          "head": n(k[3], (D, V), 0.4)}


def hidden_of(params, tokens):
  h = params["embed"][tokens]
  for layer in params["layers"]:
    h = h + jnp.tanh(h @ layer["w"] + layer["b"])
  return h


def nll_of(params, tokens):
  logits = (hidden_of(params, tokens[:, :-1]) @ params["head"]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])


def batch_of(seed=0, empty_rows=0):
  rng = np.random.RandomState(seed)
  tokens = rng.randint(0, V, size=(B, T + 1)).astype(np.int32)
  mask = (rng.rand(B, T) < 0.6).astype(np.float32)
  mask[:, 0] = 1.0
  mask[:empty_rows] = 0.0          # rows with no valid token at all
  weights = rng.rand(B).astype(np.float32) * 2
  return {"tokens": tokens, "mask": mask, "weights": weights}


def token_mean(p, b):
  return jnp.sum(nll_of(p, b["tokens"]) * b["mask"]) / jnp.sum(b["mask"])


def summed(p, b):
  return jnp.sum(nll_of(p, b["tokens"]))


def weighted(p, b):
  per_example = jnp.mean(nll_of(p, b["tokens"]), axis=1)
  return jnp.sum(b["weights"] * per_example) / jnp.sum(b["weights"])


def chunked(p, b):
  h = hidden_of(p, b["tokens"][:, :-1])
  return autopar.nn.chunked_cross_entropy(h, p["head"], b["tokens"][:, 1:],
                                          chunk_size=8, mask=b["mask"])


def with_z_loss(p, b):
  """A token mean plus a second one (PaLM's z-loss, in spirit): two
  reductions that depend on the parameters, one count."""
  h = hidden_of(p, b["tokens"][:, :-1])
  z = jnp.sum(jnp.mean(h ** 2, axis=-1) * b["mask"]) / jnp.sum(b["mask"])
  return token_mean(p, b) + 0.1 * z


def with_weight_decay(p, b):
  """A token mean plus a term of the parameters alone: each device and
  micro-batch seeds its share of it."""
  return token_mean(p, b) + 1e-2 * sum(jnp.sum(x ** 2) for x in jax.tree.leaves(p))


def with_int_aux(p, b):
  loss = token_mean(p, b)
  valid = jnp.sum(b["mask"], axis=1) > 0
  return loss, {"tokens": jnp.sum(b["mask"] > 0).astype(jnp.int32),
                "counter": jnp.int32(7),
                "all valid": jnp.all(valid),                  # combined as a min
                "one long": jnp.any(jnp.sum(b["mask"], axis=1) > 4)}   # a max


LOSSES = {"token mean": (token_mean, 0), "sum": (summed, 0), "weights": (weighted, 0),
          "empty micro-batch": (token_mean, 8), "chunked": (chunked, 0),
          "z-loss": (with_z_loss, 0), "weight decay": (with_weight_decay, 0),
          "int aux": (with_int_aux, 0)}


def make_step(loss_fn, *, grads_out=False):
  has_aux = loss_fn is with_int_aux

  def step(state, batch):
    (loss, aux), grads = autopar.value_and_grad(
        lambda p: loss_fn(p, batch) if has_aux else (loss_fn(p, batch), {}),
        has_aux=True)(state.params)
    new = state.apply_gradients(grads=grads)
    if grads_out:
      return new, loss, jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    return new, loss, aux
  return step


TX = optax.sgd(0.1, momentum=0.9)     # one object: a new one is a new signature


def make_state(dtype=jnp.float32):
  return train_state.TrainState.create(apply_fn=None, params=init_params(dtype), tx=TX)


def mesh8():
  return jax.make_mesh((8,), ("data",))


def mesh24():
  return jax.make_mesh((2, 4), ("data", "model"))


METHODS = {
    "DataParallel n=1": lambda: autopar.DataParallel(mesh=mesh8()),
    "DataParallel n=2": lambda: autopar.DataParallel(mesh=mesh8(), num_micro_batches=2),
    # (Synced in the last micro-batch's stage, as on GPUs; the others on
    # these CPUs in a stage of their own: ParallelMethod.grad_sync.)
    "Zero2Parallel": lambda: autopar.Zero2Parallel(mesh=mesh8(), num_micro_batches=2,
                                                   grad_sync="last"),
    "Zero3Parallel": lambda: autopar.Zero3Parallel(mesh=mesh8(), num_micro_batches=2),
    "ShardParallel 2x4 n=2": lambda: autopar.ShardParallel(mesh=mesh24(),
                                                           num_micro_batches=2),
    "Pipeshard 1f1b": lambda: autopar.PipeshardParallel(
        mesh=mesh24(), num_micro_batches=2, num_stages=2, schedule="1f1b"),
    "Pipeshard gpipe": lambda: autopar.PipeshardParallel(
        mesh=mesh24(), num_micro_batches=4, num_stages=3, schedule="gpipe"),  # (3 stages)
    "Pipeshard zb-h1": lambda: autopar.PipeshardParallel(
        mesh=mesh24(), num_micro_batches=4, num_stages=2, schedule="zb-h1"),
}


def run(step, method, batch, dtype=jnp.float32):
  pf = autopar.parallelize(step, method=method, donate_argnums=(0,), batch_argnums=(1,))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    got = pf(make_state(dtype), batch)
  return got, single_device(step)(make_state(dtype), batch)


@pytest.mark.parametrize("method", list(METHODS))
def test_losses_equal_single_device_jit(method):
  for name, (loss_fn, empty) in LOSSES.items():
    batch = batch_of(empty_rows=empty)
    (state, loss, aux), (ref, ref_loss, ref_aux) = run(make_step(loss_fn),
                                                       METHODS[method](), batch)
    assert np.isfinite(float(loss)), name
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, err_msg=name)
    assert_trees_close(state.params, ref.params)
    assert jax.tree.structure(aux) == jax.tree.structure(ref_aux), name
    for a, r in zip(jax.tree.leaves(aux), jax.tree.leaves(ref_aux)):
      assert a.dtype == r.dtype and int(a) == int(r), name


@pytest.mark.parametrize("method", list(METHODS))
def test_bfloat16_gradients_equal_single_device_jit(method):
  """bf16 parameters (Gemma's dtype): every gradient within bf16's precision
  of single-device jit's, none zero where jit's is not (a pipeline's first
  stage got none at all)."""
  batch = batch_of()
  step = make_step(token_mean, grads_out=True)
  (_, loss, grads), (_, ref_loss, ref_grads) = run(step, METHODS[method](), batch,
                                                   dtype=jnp.bfloat16)
  np.testing.assert_allclose(np.float32(loss), np.float32(ref_loss), rtol=2e-2)
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    r = dict(jax.tree_util.tree_leaves_with_path(ref_grads))[path]
    scale = float(jnp.max(jnp.abs(r)))
    assert scale > 0 and float(jnp.max(jnp.abs(g))) > 0, path
    # bf16 has 8 bits of mantissa: the sums run in another order.
    np.testing.assert_allclose(g, r, rtol=0, atol=4e-2 * scale, err_msg=str(path))


def test_output_reductions_loss_is_the_escape_hatch():
  """A loss autopar cannot derive (a row's value) is an error that names the
  escape hatch; with it, each group's loss and gradient are averaged."""
  def first_row(p, b):
    return jnp.sum(nll_of(p, b["tokens"])[0])

  batch = batch_of()
  pf = autopar.parallelize(make_step(first_row), method=autopar.DataParallel(mesh=mesh8()),
                           batch_argnums=(1,), donate_argnums=())
  with pytest.raises(autopar.InputError, match="output_reductions"):
    pf(make_state(), batch)
  pf = autopar.parallelize(make_step(first_row), method=autopar.DataParallel(mesh=mesh8()),
                           batch_argnums=(1,), donate_argnums=(),
                           output_reductions={"loss": "mean"})
  state, loss, _ = pf(make_state(), batch)
  per_device = [first_row(make_state().params, jax.tree.map(lambda x: x[k:k + 2], batch))
                for k in range(0, B, 2)]
  np.testing.assert_allclose(loss, np.mean(per_device), rtol=1e-5)


def test_batch_statistics_in_the_loss_are_refused():
  def normalised(p, b):
    h = hidden_of(p, b["tokens"][:, :-1])
    h = (h - jnp.mean(h, axis=0)) / (jnp.std(h, axis=0) + 1e-5)     # over the rows
    return jnp.mean((h @ p["head"]) ** 2)

  for method in (autopar.DataParallel(mesh=mesh8()),
                 autopar.DataParallel(mesh=mesh8(), batch_axes=(), num_micro_batches=2)):
    pf = autopar.parallelize(make_step(normalised), method=method, batch_argnums=(1,),
                             donate_argnums=())
    with pytest.raises(autopar.InputError, match="mixes the batch's rows.*summarises"):
      pf(make_state(), batch_of())
  # One micro-batch on one device: the batch is whole, as on one device.
  pf = autopar.parallelize(make_step(normalised),
                           method=autopar.DataParallel(mesh=mesh8(), batch_axes=()),
                           batch_argnums=(1,), donate_argnums=())
  (_, loss, _), (_, ref_loss, _) = (pf(make_state(), batch_of()),
                                          single_device(make_step(normalised))(
                                              make_state(), batch_of()))
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)


def test_a_time_major_batch_is_refused():
  """A batch laid out [time, batch, feature] is split along time; the scan
  over time then reads another device's rows."""
  w = jnp.eye(4) * 0.5

  def step(w, x):
    def loss_fn(w):
      def cell(h, x_t):
        h = jnp.tanh(h @ w + x_t)
        return h, h
      _, hs = jax.lax.scan(cell, jnp.zeros(x.shape[1:]), x)
      return jnp.mean(hs ** 2)
    loss, g = autopar.value_and_grad(loss_fn)(w)
    return w - 0.1 * g, loss

  x = jnp.ones((16, 3, 4))                     # [time, batch, feature]
  pf = autopar.parallelize(step, method=autopar.DataParallel(mesh=mesh8()),
                           batch_argnums=(1,), donate_argnums=())
  with pytest.raises(autopar.InputError, match="time-major"):
    pf(w, x)


def test_in_batch_negatives_keep_the_batch_whole():
  """A contrastive loss over a batch x batch matrix pairs rows with rows:
  ShardParallel with one micro-batch keeps the batch whole (its dimensions
  planned like any other: exact), more micro-batches or a data-parallel
  split are an error."""
  def contrastive(p, b):
    z = jnp.tanh(hidden_of(p, b["tokens"][:, :-1]).mean(axis=1))
    logits = z @ z.T
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, jnp.arange(z.shape[0])).mean()

  batch = batch_of()
  (state, loss, _), (ref, ref_loss, _) = run(
      make_step(contrastive), autopar.ShardParallel(mesh=mesh24()), batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_trees_close(state.params, ref.params)
  pf = autopar.parallelize(make_step(contrastive), method=autopar.ShardParallel(
      mesh=mesh24()), batch_argnums=(1,))
  assert pf.get_executable(make_state(), batch).plan.batch_axes == ()
  for method in (autopar.ShardParallel(mesh=mesh24(), num_micro_batches=2),
                 autopar.DataParallel(mesh=mesh8())):
    pf = autopar.parallelize(make_step(contrastive), method=method, batch_argnums=(1,))
    with pytest.raises(autopar.InputError, match="pairs rows with rows"):
      pf(make_state(), batch)


def test_a_loss_nonlinear_in_parameter_sums_is_exact():
  """log(sum(exp(-nll))): its cotangent reads a sum that depends on the
  parameters. The SPMD methods compute it first (a warning says the forward
  pass runs twice), a pipeline in a first pass through its stages; exactly."""
  def log_sum(p, b):
    return -jnp.log(jnp.sum(jnp.exp(-nll_of(p, b["tokens"])) * b["mask"]))

  batch = batch_of()
  ref, ref_loss, _ = single_device(make_step(log_sum))(make_state(), batch)
  for method in ("DataParallel n=2", "Zero3Parallel", "ShardParallel 2x4 n=2",
                 "Pipeshard gpipe"):
    pf = autopar.parallelize(make_step(log_sum), method=METHODS[method](),
                             batch_argnums=(1,))
    with pytest.warns(UserWarning, match="forward pass(es)? once more"):
      state, loss, _ = pf(make_state(), batch)
    first = "first0@0" if method.startswith("Pipeshard") else "loss_sums"
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, err_msg=method)
    assert_trees_close(state.params, ref.params)
    assert pf.get_executable(make_state(), batch).schedule[0] == first


def test_index_arithmetic_with_row_positions_is_exact_and_values_from_them_refused():
  """lp[jnp.arange(B), labels] reads each group's own rows (JAX's index
  normalisation adds the batch's size: index arithmetic, exact); the rows'
  positions used as values restart at 0 on every device: refused."""
  def picked(p, b):
    lp = jax.nn.log_softmax(hidden_of(p, b["tokens"][:, :-1])[:, -1] @ p["head"])
    return -jnp.mean(lp[jnp.arange(lp.shape[0]), b["tokens"][:, -1]])

  def by_position(p, b):
    pe = jnp.mean(nll_of(p, b["tokens"]), axis=1)
    w = jnp.arange(pe.shape[0], dtype=jnp.float32) + 1
    return jnp.sum(pe * w) / jnp.sum(w)

  batch = batch_of()
  (state, loss, _), (ref, ref_loss, _) = run(make_step(picked), METHODS["DataParallel n=2"](),
                                             batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_trees_close(state.params, ref.params)
  pf = autopar.parallelize(make_step(by_position), method=METHODS["DataParallel n=2"](),
                           batch_argnums=(1,))
  with pytest.raises(autopar.InputError, match="rows' positions in the batch"):
    pf(make_state(), batch)


def test_a_sharding_hint_on_the_way_to_the_first_pass():
  """The first pass (the mask's sum) evaluates the user's hints as the
  gradient stages do."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))

  def hinted(p, b):
    b = jax.lax.with_sharding_constraint(b, jax.sharding.NamedSharding(mesh, P("data")))
    return token_mean(p, b)

  # (The reference on one device without the hint, which names all eight.)
  ref, ref_loss, _ = single_device(make_step(token_mean))(make_state(), batch_of())
  for method in (autopar.DataParallel(mesh=mesh, num_micro_batches=2),
                 autopar.ShardParallel(mesh=mesh, num_micro_batches=2)):
    pf = autopar.parallelize(make_step(hinted), method=method, batch_argnums=(1,))
    state, loss, _ = pf(make_state(), batch_of())
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_trees_close(state.params, ref.params)


def test_the_escape_hatch_does_not_run_mixed_rows():
  """output_reductions={"loss": "mean"} averages each group's loss; a loss
  whose rows mix is refused all the same."""
  def normalised(p, b):
    h = hidden_of(p, b["tokens"][:, :-1])
    h = (h - jnp.mean(h, axis=0)) / (jnp.std(h, axis=0) + 1e-5)
    return jnp.median(h @ p["head"])

  pf = autopar.parallelize(make_step(normalised), method=METHODS["DataParallel n=2"](),
                           batch_argnums=(1,), output_reductions={"loss": "mean"})
  with pytest.raises(autopar.InputError, match="mixes the batch's rows"):
    pf(make_state(), batch_of())


def test_a_pipeline_scales_its_loss_by_a_step_argument():
  """A loss times a value the step is given (not a parameter, not the
  batch): its cotangent reads it, a pipeline computes it before the
  schedule, every call."""
  def step(state, batch, alpha):
    loss, grads = autopar.value_and_grad(
        lambda p: token_mean(p, batch) * alpha)(state.params)
    return state.apply_gradients(grads=grads), loss

  pf = autopar.parallelize(step, method=METHODS["Pipeshard 1f1b"](), batch_argnums=(1,),
                           donate_argnums=())
  for alpha in (0.5, 2.0):
    state, loss = pf(make_state(), batch_of(), jnp.float32(alpha))
    ref, ref_loss = single_device(step)(make_state(), batch_of(), jnp.float32(alpha))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_trees_close(state.params, ref.params)


def test_an_output_whose_rows_mix_is_refused_or_kept_whole():
  """A per-example output minus the batch's mean: each group would subtract
  its own. An error with the batch split; ShardParallel with one micro-batch
  keeps the batch whole and returns jit's numbers."""
  def step(state, b):
    loss, g = autopar.value_and_grad(lambda p: token_mean(p, b))(state.params)
    per_example = jnp.mean(nll_of(state.params, b["tokens"]), axis=1)
    return state.apply_gradients(grads=g), loss, per_example - per_example.mean()

  pf = autopar.parallelize(step, method=METHODS["DataParallel n=2"](), batch_argnums=(1,))
  with pytest.raises(autopar.InputError, match=r"out\[2\].*its rows mix on the way"):
    pf(make_state(), batch_of())
  (_, _, got), (_, _, want) = run(step, autopar.ShardParallel(mesh=mesh24()), batch_of())
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)



def dense_state():
  w = jnp.arange(12.0, dtype=jnp.float32).reshape(4, 3) / 10
  return train_state.TrainState.create(apply_fn=None, params={"w": w, "b": jnp.ones(3)},
                                       tx=TX)


def dense_step(total):
  """A dense layer's squares summed by ``total`` and divided by the batch's
  size as a Python number (as penzai's named axes, whose sizes it checks
  are ints, need it): the step cannot be traced at a symbolic batch size,
  so autopar traces it at each size it runs."""
  def step(state, batch):
    def loss_fn(p):
      per = jnp.tanh(batch["x"] @ p["w"] + p["b"]) ** 2
      return total(per) / float(batch["x"].shape[0])
    loss, grads = autopar.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss
  return step


def dense_batch(rows):
  return {"x": np.random.RandomState(0).randn(rows, 4).astype(np.float32)}


def one_row_per_device(method: str):
  """``METHODS[method]``; ShardParallel's batch split over both axes (the
  ILP keeps this tiny step's batch whole)."""
  if method.startswith("ShardParallel"):
    return autopar.ShardParallel(mesh=mesh24(), num_micro_batches=2,
                                 option=autopar.AutoShardingOption(
                                     force_batch_dim_to_mesh_dim=("data", "model")))
  return METHODS[method]()


@pytest.mark.parametrize("method,rows", [
    ("DataParallel n=1", 8), ("DataParallel n=2", B), ("Zero3Parallel", B),
    ("ShardParallel 2x4 n=2", B)])
def test_a_step_traced_at_concrete_sizes_at_one_row_per_device(method, rows):
  """One row per device and micro-batch: there JAX writes the program with
  other equations than at another size (the transpose of the bias's
  implicit broadcast sums no rows: at one row there is none), and the row
  analysis pairs the two traces' values by aligning their equations
  (align.py). Two steps as single-device jit takes them (a crash inside
  JAX, or an IndexError in the planner, before)."""
  step, batch = dense_step(jnp.sum), dense_batch(rows)
  pf = autopar.parallelize(step, method=one_row_per_device(method), donate_argnums=(0,),
                           batch_argnums=(1,))
  state, ref = dense_state(), dense_state()
  for _ in range(2):
    state, loss = pf(state, batch)
    ref, ref_loss = single_device(step)(ref, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_trees_close(state.params, ref.params)


def test_a_program_that_changes_at_one_row_is_refused():
  """A branch on the batch size that writes another program at one row (the
  same numbers, another equation on the way to the loss: nothing pairs its
  values with another size's): the stages built from the step at several
  sizes would not line up, so an autopar error says so and how to fix it (a
  crash inside JAX, or an IndexError in the planner, before). ShardParallel
  plans another choice of batch axes; at two rows per device it runs as jit
  does."""
  def total(per):                                     # per >= 0
    return jnp.sum(per) if per.shape[0] > 1 else jnp.sum(jnp.abs(per))

  step = dense_step(total)
  for method in ("DataParallel n=2", "Zero3Parallel", "ShardParallel 2x4 n=2"):
    pf = autopar.parallelize(step, method=one_row_per_device(method), batch_argnums=(1,))
    with pytest.raises(autopar.InputError, match=r"programs at 1 and \d+ rows disagree: "
                       r"output out\[1\] is not combinable.*Fix: keep the batch size out"):
      pf(dense_state(), dense_batch(B))
  # The ILP plans the choices of batch axes the step can run at; two rows
  # per device run as jit does.
  for method, rows in ((autopar.ShardParallel(mesh=mesh24(), num_micro_batches=2, option=(
      autopar.AutoShardingOption(plan_cache=False))), B), (METHODS["DataParallel n=2"](), 2 * B)):
    pf = autopar.parallelize(step, method=method, batch_argnums=(1,))
    state, loss = pf(dense_state(), dense_batch(rows))
    ref, ref_loss = single_device(step)(dense_state(), dense_batch(rows))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_trees_close(state.params, ref.params)
