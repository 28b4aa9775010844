"""Same results as one device on the steps people write: random draws,
outputs that depend on the batch's shape, saved plans tied to their program,
the user's sharding hints, accumulation precision."""

import json
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import autopar
from models import (assert_trees_close, dropout_setup, lm_setup, mlp_setup,
                    single_device)

SGD = optax.sgd(0.1, momentum=0.9)


def mesh_of(shape, names=("data", "model")):
  return jax.make_mesh(shape, names[:len(shape)])


# -- saved plans ---------------------------------------------------------------

def test_a_saved_plan_is_tied_to_its_program():
  make_state, step, batch = mlp_setup(tx=SGD)
  mesh = mesh_of((2, 4))
  saved = autopar.parallelize(step, method=autopar.ShardParallel(
      mesh=mesh, num_micro_batches=2)).plan(make_state(), batch).to_json()

  def other(state, batch):            # the same arguments, another loss
    def loss_fn(p):
      return jnp.mean(jnp.abs(state.apply_fn(p, batch["x"]) - batch["y"]))
    loss, grads = autopar.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  def method(text):
    return autopar.ShardParallel(mesh=mesh, num_micro_batches=2,
                                 plan=autopar.Plan.from_json(text))

  with pytest.raises(autopar.PlanError, match="made for another program"):
    autopar.parallelize(other, method=method(saved))(make_state(), batch)
  d = json.loads(saved)
  d["fingerprint"]["autopar"] = "0.0.1"
  with pytest.raises(autopar.PlanError, match="made by autopar 0.0.1"):
    autopar.parallelize(step, method=method(json.dumps(d)))(make_state(), batch)
  # Its own program takes it.
  state, _ = autopar.parallelize(step, method=method(saved))(make_state(), batch)
  ref_state, _ = single_device(step)(make_state(), batch)
  assert_trees_close(state.params, ref_state.params)


def test_a_corrupt_plan_is_a_plan_error():
  with pytest.raises(autopar.PlanError, match="not valid JSON"):
    autopar.Plan.from_json("{")
  with pytest.raises(autopar.PlanError, match="format"):
    autopar.Plan.from_json('{"format": 1}')
  make_state, step, batch = mlp_setup(tx=SGD)
  d = json.loads(autopar.parallelize(step, method=autopar.DataParallel(
      mesh=mesh_of((8,)))).plan(make_state(), batch).to_json())
  del d["inputs"]
  with pytest.raises(autopar.PlanError, match="incomplete or corrupt"):
    autopar.Plan.from_json(json.dumps(d))


# -- random draws --------------------------------------------------------------

METHODS = {"dp": autopar.DataParallel, "zero3": autopar.Zero3Parallel,
           "shard": autopar.ShardParallel}


@pytest.mark.parametrize("shape", [(8,), (2, 4)])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_dropout_equals_one_device(method, shape):
  make_state, step, batch = dropout_setup()
  ref = single_device(step)
  ref_state, ref_losses = make_state(), []
  for _ in range(2):
    ref_state, loss = ref(ref_state, batch)
    ref_losses.append(float(loss))
  for n in (1, 2, 4):
    # (n=4 syncs in the last micro-batch's stage, as on GPUs; n=2 apart.)
    p = autopar.parallelize(step, method=METHODS[method](
        mesh=mesh_of(shape), num_micro_batches=n, grad_sync="last" if n == 4 else None))
    state, losses = make_state(), []
    for _ in range(2):
      state, loss = p(state, batch)
      losses.append(float(loss))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=f"n={n}")
    assert_trees_close(state.params, ref_state.params)


class DropoutBlock(nn.Module):
  d: int

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(4 * self.d)(nn.LayerNorm()(x))
    h = nn.Dropout(0.1, deterministic=False)(nn.gelu(h))
    return x + nn.Dense(self.d)(h)


class DropoutLM(nn.Module):
  vocab: int = 32
  d: int = 32
  layers: int = 4

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab, self.d)(tokens)
    for _ in range(self.layers):
      x = DropoutBlock(self.d)(x)
    return nn.Dense(self.vocab)(x)


def test_dropout_in_layers_rolled_by_remat():
  """The backward pass recomputes each layer's mask (remat="layers" rolls
  the blocks into a checkpointed scan): the same rows as the forward's."""
  make_state, step, batch = lm_setup(DropoutLM(), tx=SGD)
  key = jax.random.key(5)

  def keyed(state, batch, key):
    def loss_fn(p):
      logits = state.apply_fn(p, batch["tokens"][:, :-1],
                              rngs={"dropout": jax.random.fold_in(key, state.step)})
      return optax.softmax_cross_entropy_with_integer_labels(
          logits, batch["tokens"][:, 1:]).mean()
    loss, grads = autopar.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  ref_state, ref_loss = single_device(keyed)(make_state(), batch, key)
  p = autopar.parallelize(keyed, method=autopar.DataParallel(
      mesh=mesh_of((2, 4)), num_micro_batches=2, remat="layers"))
  state, loss = p(make_state(), batch, key)
  assert " while(" in p.get_executable(make_state(), batch, key).as_text()["accumulate_grad"]
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_trees_close(state.params, ref_state.params)


def test_every_row_gets_its_row_of_the_whole_batch_draw():
  """Masks, per-example keys, and draws with the rows in another dimension
  or flattened with other dimensions: all as on one device."""
  def step(w, batch, key):
    def loss_fn(w):
      x = batch
      mask = jax.random.bernoulli(key, 0.5, x.shape)                    # rows first
      noise = jax.random.normal(jax.random.fold_in(key, 1), (3, x.shape[0]))
      flat = jax.random.uniform(jax.random.fold_in(key, 2), (x.shape[0] * 4,))
      keys = jax.random.split(jax.random.fold_in(key, 3), x.shape[0])   # per example
      per = jax.vmap(lambda k: jax.random.normal(k, (2,)))(keys)
      h = jnp.where(mask, x, 0.0) @ w
      loss = (jnp.mean(h ** 2) + jnp.mean(noise) + jnp.mean(flat) + jnp.mean(per))
      return loss, (mask, noise.T, flat.reshape(-1, 4), per)
    (loss, draws), g = autopar.value_and_grad(loss_fn, has_aux=True)(w)
    return w - 0.1 * g, loss, draws

  x = np.random.RandomState(0).randn(16, 4).astype(np.float32)
  w, key = jnp.ones((4, 3)), jax.random.key(3)
  ref = single_device(step)(w, x, key)
  for shape, n in (((8,), 2), ((2, 4), 1), ((4,), 4)):
    mesh = jax.make_mesh(shape, ("data", "model")[:len(shape)],
                         devices=jax.devices()[:int(np.prod(shape))])
    out = autopar.parallelize(step, method=autopar.DataParallel(
        mesh=mesh, num_micro_batches=n))(w, x, key)
    assert_trees_close(out, ref)


def test_a_draw_that_cannot_be_cut_into_rows_is_independent_and_warned():
  def step(w, batch, key):
    def loss_fn(w):
      mask = jax.random.bernoulli(key, 0.5, batch.shape)
      return jnp.mean((jnp.where(mask, batch, 0.0) @ w) ** 2), mask
    (loss, mask), g = autopar.value_and_grad(loss_fn, has_aux=True)(w)
    return w - 0.1 * g, mask

  x = np.ones((16, 4), np.float32)
  p = autopar.parallelize(step, method=autopar.DataParallel(
      mesh=mesh_of((8,)), num_micro_batches=2))
  with pytest.warns(UserWarning, match="random draw random_bits.*'rbg'"):
    _, mask = p(jnp.ones((4, 3)), x, jax.random.key(0, impl="rbg"))
  rows = {np.asarray(mask[i]).tobytes() for i in range(0, 16, 2)}
  assert len(rows) > 1             # not one mask for every device and micro-batch


# -- outputs ---------------------------------------------------------------------

def test_outputs_are_classified_by_what_they_depend_on():
  """A per-example output, a batch-shaped output that reads no batch value
  (whole batch's length), and a per-feature mean whose width equals the
  micro-batch's rows (averaged, not concatenated)."""
  def step(w, batch):
    def loss_fn(w):
      h = batch @ w
      return jnp.mean(h ** 2), (jnp.sum(h ** 2, axis=1), jnp.mean(h, axis=0))
    (loss, (per_example, feature_mean)), g = autopar.value_and_grad(
        loss_fn, has_aux=True)(w)
    return w - 0.1 * g, loss, per_example, feature_mean, jnp.arange(batch.shape[0])

  x = np.random.RandomState(0).randn(32, 6).astype(np.float32)
  w = jnp.ones((6, 8)) / 8
  ref = single_device(step)(w, x)
  for shape, n in (((8,), 4), ((4,), 1), ((2, 4), 2)):
    mesh = jax.make_mesh(shape, ("data", "model")[:len(shape)],
                         devices=jax.devices()[:int(np.prod(shape))])
    for method in (autopar.DataParallel, autopar.ShardParallel):
      out = autopar.parallelize(step, method=method(mesh=mesh, num_micro_batches=n))(w, x)
      assert [o.shape for o in out] == [r.shape for r in ref]
      assert_trees_close(out, ref)


def test_effects_run_once_per_micro_batch_where_written():
  calls = {"forward": 0, "update": 0}

  def count(name):
    return lambda: calls.__setitem__(name, calls[name] + 1)

  def step(w, batch):
    def loss_fn(w):
      jax.debug.callback(count("forward"))
      return jnp.mean((batch @ w) ** 2)
    loss, g = autopar.value_and_grad(loss_fn)(w)
    jax.debug.callback(count("update"))
    return w - 0.1 * g, loss

  x = np.ones((32, 4), np.float32)
  for n in (1, 2, 4):
    calls.update(forward=0, update=0)
    p = autopar.parallelize(step, method=autopar.DataParallel(
        mesh=mesh_of((8,)), num_micro_batches=n))
    jax.block_until_ready(p(jnp.ones((4, 2)), x))
    jax.effects_barrier()
    assert calls == {"forward": n, "update": 1}, (n, calls)


# -- sharding hints and pins ----------------------------------------------------------

def _hinted_step(hint):
  """A two-layer step whose hidden activation carries ``hint`` (or none)."""
  def step(w, x):
    def loss_fn(w):
      h = hint(x @ w["a"])
      return jnp.mean((jnp.tanh(h) @ w["b"]) ** 2)
    loss, g = autopar.value_and_grad(loss_fn)(w)
    return jax.tree.map(lambda a, b: a - 0.1 * b, w, g), loss
  return step


def _hinted_args():
  rng = np.random.RandomState(0)
  w = {"a": jnp.asarray(rng.randn(8, 16), jnp.float32),
       "b": jnp.asarray(rng.randn(16, 4), jnp.float32)}
  return w, rng.randn(32, 8).astype(np.float32)


def auto_mesh():
  """Auto axes: the kind of mesh with_sharding_constraint takes bare specs on."""
  return Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))


@pytest.mark.parametrize("kind", ["with_sharding_constraint", "nested jit"])
@pytest.mark.parametrize("method", ["dp", "shard"])
def test_sharding_hints_are_kept(kind, method):
  mesh = auto_mesh()
  hinted = NamedSharding(mesh, P("data", "model"))
  if kind == "with_sharding_constraint":
    hint = lambda h: jax.lax.with_sharding_constraint(h, P("data", "model"))
  else:
    hint = jax.jit(lambda h: h, in_shardings=hinted,
                   out_shardings=NamedSharding(mesh, P(None, "model")))
  w, x = _hinted_args()
  ref = single_device(_hinted_step(lambda h: h))(w, x)
  for n in (1, 2):
    p = autopar.parallelize(_hinted_step(hint), method=METHODS[method](
        mesh=mesh, num_micro_batches=n), donate_argnums=())
    with jax.set_mesh(mesh):        # bare specs in the step need a mesh in context
      out = p(w, x)
      exe = p.get_executable(w, x)
    assert_trees_close(out, ref)
    # "model" splits the hidden units, as the hint says (each device's tanh
    # sees a quarter of them). "data" is the batch axis, or under
    # ShardParallel may be planned (2-D, found cheaper at this size); then
    # the tanh's rows are as the hint leaves them: split over "data" by
    # with_sharding_constraint, whole by the nested jit's out_shardings.
    assert exe.plan.batch_axes == ("data",) or (method == "shard"
                                                and exe.plan.batch_axes == ())
    assert P("data", "model") in {v.spec for v in exe.plan.hints}
    assert "sharding hints kept" in exe.plan.summary()
    split_rows = exe.plan.batch_axes == ("data",) or kind == "with_sharding_constraint"
    rows = 32 // n // (2 if split_rows else 1)
    text = exe.as_text()["accumulate_grad" if n > 1 else exe.schedule[0]]   # (the gradient's)
    assert re.search(rf"f32\[{rows},4\]\S* tanh\(", text), text


def test_a_bare_spec_hint_refers_to_the_methods_mesh():
  """No mesh in context (jax.jit would refuse a bare PartitionSpec): the
  hint is on the method's mesh, here jax.make_mesh's Explicit one."""
  w, x = _hinted_args()
  ref = single_device(_hinted_step(lambda h: h))(w, x)
  step = _hinted_step(lambda h: jax.lax.with_sharding_constraint(h, P("data", "model")))
  for method in (autopar.DataParallel, autopar.ShardParallel):
    p = autopar.parallelize(step, method=method(mesh=mesh_of((2, 4)), num_micro_batches=2),
                            donate_argnums=())
    assert_trees_close(p(w, x), ref)
    assert p.get_executable(w, x).plan.batch_axes == ("data",)


def test_a_hint_on_a_batch_axis_or_an_unknown_axis_is_an_input_error():
  mesh = auto_mesh()
  w, x = _hinted_args()
  step = _hinted_step(lambda h: jax.lax.with_sharding_constraint(h, P("data", "model")))
  with pytest.raises(autopar.InputError, match="splits dimension 1 over mesh axis "
                     "'model'.*batch_axes"):
    with jax.set_mesh(mesh):
      autopar.parallelize(step, method=autopar.DataParallel(
          mesh=mesh, batch_axes=("data", "model")), donate_argnums=())(w, x)
  other = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "tensor"))
  step = _hinted_step(lambda h: jax.lax.with_sharding_constraint(
      h, NamedSharding(other, P("data", "tensor"))))
  with pytest.raises(autopar.InputError, match="names mesh axis 'tensor'"):
    autopar.parallelize(step, method=autopar.ShardParallel(mesh=mesh),
                        donate_argnums=())(w, x)


def test_user_pins_by_path():
  make_state, step, batch = mlp_setup(tx=SGD)
  kernel = "state.params['params']['Dense_0']['kernel']"
  ref_state, _ = single_device(step)(make_state(), batch)
  for pin in (P(None, "model"), P(("data", "model"), None)):
    option = autopar.AutoShardingOption(pins={kernel: pin})
    p = autopar.parallelize(step, method=autopar.ShardParallel(
        mesh=auto_mesh(), num_micro_batches=2, option=option))
    state, _ = p(make_state(), batch)
    assert_trees_close(state.params, ref_state.params)
    plan = p.get_executable(make_state(), batch).plan
    assert {v.name: v.spec for v in plan.inputs}[kernel] == pin
    assert {v.name: v.spec for v in plan.outputs}[
        "out[0].params['params']['Dense_0']['kernel']"] == pin
  option = autopar.AutoShardingOption(pins={kernel.replace("kernel", "kernal"): P()})
  with pytest.raises(autopar.InputError, match="names no argument leaf.*Did you mean"):
    autopar.parallelize(step, method=autopar.ShardParallel(
        mesh=auto_mesh(), option=option))(make_state(), batch)
  option = autopar.AutoShardingOption(pins={kernel: P("tensor")})
  with pytest.raises(autopar.InputError, match="names mesh axis 'tensor'"):
    autopar.parallelize(step, method=autopar.ShardParallel(
        mesh=auto_mesh(), option=option))(make_state(), batch)


# -- accumulation precision -------------------------------------------------------------

def test_bfloat16_gradients_are_accumulated_in_float32():
  """Summed over 8 micro-batches x 8 devices in float32 (the buffers say so),
  the mean of the 64 bfloat16 gradients is off by one bfloat16 rounding at
  most; summed in bfloat16 (grad_accumulation_dtype=None) it is further off."""
  rng = np.random.RandomState(0)
  w = jnp.asarray(rng.randn(16, 8), jnp.bfloat16)
  x = rng.randn(256, 16).astype(np.float32)

  def step(w, x):
    g = autopar.grad(lambda w: jnp.mean(jnp.tanh(x.astype(w.dtype) @ w) ** 2))(w)
    return g

  # Each device's gradient on each micro-batch (4 rows), averaged exactly.
  chunks = [np.asarray(jax.jit(step)(w, x[i:i + 4]), np.float64) for i in range(0, 256, 4)]
  exact = np.mean(chunks, axis=0)
  errors = {}
  for setting in ("float32", None):
    p = autopar.parallelize(step, method=autopar.DataParallel(
        mesh=mesh_of((8,)), num_micro_batches=8, grad_accumulation_dtype=setting))
    g = p(w, x)
    assert g.dtype == jnp.bfloat16
    errors[setting] = np.abs(np.asarray(g, np.float64) - exact)
    text = p.get_executable(w, x).as_text()["accumulate_grad"]
    layout = re.search(r"entry_computation_layout=\{\((.*?)\)->", text).group(1)
    # The partial sums the stage takes in (and updates in place): one per device.
    assert ("f32[1,16,8]" if setting else "bf16[1,16,8]") in layout.split(", ")[-1:][0]
  assert errors["float32"].max() < errors[None].max()
  assert np.all(errors["float32"] <= np.abs(exact) * 2 ** -8 * 1.01 + 1e-12)


# -- steps that read their batch size ---------------------------------------------

BATCH = 16


def _branching_step(spelling):
  """A step whose Python reads its batch size: on the whole batch of
  ``BATCH`` rows ``jax.jit`` takes the first branch (a mean); a trace at any
  other size the other (a sum, 16x the loss)."""
  def step(w, x, y):
    def loss_fn(w):
      per = jnp.sum((jnp.tanh(x @ w) - y) ** 2, axis=-1)
      n = x.shape[0]
      take_mean = {"==": lambda: n == BATCH,
                   "!=": lambda: not (n != BATCH),
                   "in": lambda: n in (BATCH, 2 * BATCH),
                   "shape ==": lambda: x.shape == (BATCH, x.shape[1]),
                   "% ==": lambda: n % BATCH == 0}[spelling]()
      return jnp.mean(per) if take_mean else jnp.sum(per)
    loss, g = autopar.value_and_grad(loss_fn)(w)
    return w - 0.1 * g, loss
  return step


def _branching_args():
  k = jax.random.split(jax.random.PRNGKey(3), 3)
  return (0.3 * jax.random.normal(k[0], (8, 8)), jax.random.normal(k[1], (BATCH, 8)),
          jax.random.normal(k[2], (BATCH, 8)))


BRANCH_METHODS = {
    "dp n=1": lambda: autopar.DataParallel(mesh=mesh_of((8,))),
    "dp n=2": lambda: autopar.DataParallel(mesh=mesh_of((8,)), num_micro_batches=2),
    "zero3 n=2": lambda: autopar.Zero3Parallel(mesh=mesh_of((4,)), num_micro_batches=2),
    "shard n=2": lambda: autopar.ShardParallel(mesh=mesh_of((2, 4)), num_micro_batches=2),
    "pipeshard": lambda: autopar.PipeshardParallel(mesh=mesh_of((2, 4)), num_micro_batches=2,
                                                   num_stages=2),
}


@pytest.mark.parametrize("spelling,method", [
    *[(s, "dp n=2") for s in ("==", "!=", "in", "shape ==", "% ==")],
    *[("==", m) for m in BRANCH_METHODS if m != "dp n=2"]])
def test_a_step_reading_its_batch_size_takes_jits_branch(spelling, method):
  """Traced once at a symbolic batch size, ``x.shape[0] == 16`` is a
  comparison JAX cannot decide (it answered unequal): autopar answers it for
  the whole batch, as jax.jit sees it, whatever each device's and
  micro-batch's share of the rows."""
  step, args = _branching_step(spelling), _branching_args()
  ref_w, ref_loss = single_device(step)(*args)
  pf = autopar.parallelize(step, method=BRANCH_METHODS[method](), batch_argnums=(1, 2))
  w, loss = pf(*args)
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
  assert_trees_close(w, ref_w)


def test_a_step_needing_a_concrete_batch_size_that_branches_on_it_is_refused():
  """``float(x.shape[0])`` cannot be traced at a symbolic size, so the step is
  traced at each device's share of the rows, where its branch on the batch
  size goes the other way than jax.jit's: an InputError, not other numbers."""
  def step(w, x, y):
    def loss_fn(w):
      per = jnp.sum((jnp.tanh(x @ w) - y) ** 2, axis=-1)
      scale = 1.0 / float(x.shape[0])
      return jnp.sum(per) * scale if x.shape[0] == BATCH else jnp.sum(per)
    loss, g = autopar.value_and_grad(loss_fn)(w)
    return w - 0.1 * g, loss
  pf = autopar.parallelize(step, method=BRANCH_METHODS["dp n=2"](), batch_argnums=(1, 2))
  with pytest.raises(autopar.InputError, match="disagree") as e:
    pf(*_branching_args())
  line = step.__code__.co_firstlineno + 4      # the branch
  assert f"first differ at {__file__}:{line}" in str(e.value), str(e.value)


def test_a_set_lookup_of_the_batch_size_is_traced_at_each_size():
  """``x.shape[0] in {16, 32}`` compares hashes, and a symbolic size hashes
  unlike any integer: such a step is not traced at a symbolic size (it would
  take the other branch), but at each size it runs, where its program
  differs from the whole batch's: an InputError, not other numbers."""
  def step(w, x, y):
    def loss_fn(w):
      per = jnp.sum((jnp.tanh(x @ w) - y) ** 2, axis=-1)
      return jnp.mean(per) if x.shape[0] in {BATCH, 2 * BATCH} else jnp.sum(per)
    loss, g = autopar.value_and_grad(loss_fn)(w)
    return w - 0.1 * g, loss
  args = _branching_args()
  one = autopar.parallelize(step, method=autopar.DataParallel(mesh=mesh_of((1,))),
                            batch_argnums=(1, 2))
  ref_w, ref_loss = single_device(step)(*args)
  w, loss = one(*args)                      # (one device, one micro-batch: jit's)
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
  pf = autopar.parallelize(step, method=BRANCH_METHODS["dp n=2"](), batch_argnums=(1, 2))
  with pytest.raises(autopar.InputError, match="disagree"):
    pf(*args)


def test_a_bare_spec_hint_through_a_libraries_shim(monkeypatch):
  """MaxText, once imported, replaces jax.lax.with_sharding_constraint with
  a shim that reshards where JAX raises, and says a bare PartitionSpec needs
  a mesh with a ValueError: the hint is still on the method's mesh."""
  jax_wsc = jax.lax.with_sharding_constraint

  def shim(x, shardings):                    # maxtext/integration/tunix/tunix_adapter.py
    try:
      return jax_wsc(x, shardings)
    except Exception:  # noqa: BLE001 - as the library does
      return jax.sharding.reshard(x, shardings)

  monkeypatch.setattr(jax.lax, "with_sharding_constraint", shim)
  w, x = _hinted_args()
  ref = single_device(_hinted_step(lambda h: h))(w, x)
  step = _hinted_step(lambda h: jax.lax.with_sharding_constraint(h, P("data", "model")))
  p = autopar.parallelize(step, method=autopar.DataParallel(
      mesh=mesh_of((2, 4)), num_micro_batches=2), donate_argnums=())
  assert_trees_close(p(w, x), ref)


def test_repeated_layers_differentiated_once_give_each_layer_its_own():
  """The loss function's repeated layers are differentiated once and the
  derivative bound per layer (``remat.called_eval``): each layer keeps its
  own weights, its own literal (the index it folds into its dropout key),
  its own draws over the rows, and the integer values it hands on."""
  layers = 4

  def step(params, batch, key):
    def loss_fn(params):
      h, steps = batch["x"], jnp.zeros(batch["x"].shape[:1], jnp.int32)
      for i, w in enumerate(params["layers"]):
        keep = jax.random.bernoulli(jax.random.fold_in(key, i), 0.8, h.shape)
        h = jnp.where(keep, jax.nn.relu(h @ w) / 0.8, 0.0) + h * (steps[:, None] + 1)
        steps = steps + (h[:, 0] > 0)
      return jnp.mean((h @ params["out"] - batch["y"]) ** 2) + jnp.mean(steps)
    loss, g = autopar.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda p, d: p - 0.01 * d, params, g), loss

  rng = np.random.RandomState(0)
  params = {"layers": [jnp.asarray(rng.randn(8, 8).astype(np.float32) * 0.3)
                       for _ in range(layers)],
            "out": jnp.asarray(rng.randn(8, 2).astype(np.float32))}
  batch = {"x": rng.randn(16, 8).astype(np.float32), "y": rng.randn(16, 2).astype(np.float32)}
  key = jax.random.key(1)
  ref = single_device(step)(params, batch, key)
  for method in (autopar.DataParallel(mesh=mesh_of((8,)), num_micro_batches=2),
                 autopar.ShardParallel(mesh=mesh_of((2, 4)), num_micro_batches=2)):
    assert_trees_close(autopar.parallelize(step, method=method)(params, batch, key), ref)
