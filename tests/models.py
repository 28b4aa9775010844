"""Small models and helpers shared by the tests."""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import autopar


class MLP(nn.Module):
  hidden: int = 64
  out: int = 4
  layers: int = 2

  @nn.compact
  def __call__(self, x):
    for _ in range(self.layers - 1):
      x = nn.relu(nn.Dense(self.hidden)(x))
    return nn.Dense(self.out)(x)


class Block(nn.Module):
  d: int
  heads: int
  act: Callable = nn.gelu

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)
    h = nn.MultiHeadDotProductAttention(num_heads=self.heads, qkv_features=self.d)(
        h, h, mask=nn.make_causal_mask(jnp.ones(x.shape[:2])))
    x = x + h
    h = nn.LayerNorm()(x)
    h = nn.Dense(4 * self.d)(h)
    h = self.act(h)
    return x + nn.Dense(self.d)(h)


class Transformer(nn.Module):
  vocab: int = 32
  d: int = 32
  heads: int = 4
  layers: int = 2
  act: Callable = nn.gelu

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab, self.d)(tokens)
    x = x + self.param("pos", nn.initializers.normal(0.02), (tokens.shape[1], self.d))
    for _ in range(self.layers):
      x = Block(self.d, self.heads, self.act)(x)
    return nn.Dense(self.vocab)(nn.LayerNorm()(x))


class ReluTransformer(Transformer):
  act: Callable = nn.relu       # a custom_jvp function in every block


def mlp_setup(batch=32, din=16, hidden=64, dout=4, tx=None, seed=0, layers=2):
  model = MLP(hidden=hidden, out=dout, layers=layers)
  rng = np.random.RandomState(seed)
  x = rng.randn(batch, din).astype(np.float32)
  y = rng.randn(batch, dout).astype(np.float32)
  params = model.init(jax.random.PRNGKey(seed), x[:1])
  tx = tx or optax.adam(1e-2)

  def make_state():
    return train_state.TrainState.create(
        apply_fn=model.apply, params=jax.tree.map(jnp.array, params), tx=tx)

  def step(state, batch):
    def loss_fn(p):
      pred = state.apply_fn(p, batch["x"])
      return jnp.mean((pred - batch["y"]) ** 2)
    loss, grads = autopar.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  return make_state, step, {"x": x, "y": y}


def transformer_setup(batch=16, seq=8, vocab=32, d=32, heads=4, layers=2, seed=0,
                      tx=None):
  return lm_setup(Transformer(vocab=vocab, d=d, heads=heads, layers=layers),
                  batch=batch, seq=seq, seed=seed, tx=tx)


def assert_trees_close(actual, expected, rtol=1e-5, atol=1e-6):
  """Leafwise allclose.

  ``atol`` covers values near zero: a sum computed in another order differs
  by rounding relative to the summands' magnitude, not the result's.
  """
  a_leaves, a_tree = jax.tree.flatten(actual)
  e_leaves, e_tree = jax.tree.flatten(expected)
  assert a_tree == e_tree, (a_tree, e_tree)
  for a, e in zip(a_leaves, e_leaves, strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol)


def single_device(fn):
  """``jax.jit`` of ``fn`` on device 0 alone, the reference for every test."""
  dev = jax.devices()[0]

  def run(*args):
    args = jax.device_put(args, dev)
    return jax.jit(fn)(*args)
  return run


class _ScanBlock(nn.Module):
  d: int
  heads: int

  @nn.compact
  def __call__(self, x, _):
    return Block(self.d, self.heads)(x), None


class ScanTransformer(nn.Module):
  """The layers as one ``nn.scan`` over stacked weights (optionally remat)."""
  vocab: int = 32
  d: int = 32
  heads: int = 4
  layers: int = 2
  remat: bool = False

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab, self.d)(tokens)
    block = nn.remat(_ScanBlock) if self.remat else _ScanBlock
    x, _ = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                   length=self.layers)(self.d, self.heads)(x, None)
    return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def lm_setup(model, batch=16, seq=8, seed=0, tx=None):
  """A language-model step for any ``model(tokens) -> logits``."""
  rng = np.random.RandomState(seed)
  tokens = rng.randint(0, model.vocab, size=(batch, seq + 1)).astype(np.int32)
  params = model.init(jax.random.PRNGKey(seed), tokens[:1, :-1])
  tx = tx or optax.sgd(0.1, momentum=0.9)

  def make_state():
    return train_state.TrainState.create(
        apply_fn=model.apply, params=jax.tree.map(jnp.array, params), tx=tx)

  def step(state, batch):
    def loss_fn(p):
      logits = state.apply_fn(p, batch["tokens"][:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(
          logits, batch["tokens"][:, 1:]).mean()
    loss, grads = autopar.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  return make_state, step, {"tokens": tokens}


class DropoutMLP(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.relu(nn.Dense(32)(x))
    x = nn.Dropout(0.1, deterministic=not train)(x)
    x = nn.relu(nn.Dense(32)(x))
    x = nn.Dropout(0.1, deterministic=not train)(x)
    return nn.Dense(4)(x)


class KeyedState(train_state.TrainState):
  key: jax.Array


def dropout_setup(batch=32, tx=None):
  model = DropoutMLP()
  rng = np.random.RandomState(0)
  x = rng.randn(batch, 8).astype(np.float32)
  y = rng.randn(batch, 4).astype(np.float32)
  params = model.init(jax.random.key(0), x[:1], train=False)

  def make_state():
    return KeyedState.create(apply_fn=model.apply, params=jax.tree.map(jnp.array, params),
                             tx=tx or optax.sgd(0.1, momentum=0.9),
                             key=jax.random.key(1))

  def step(state, batch):
    dropout_key = jax.random.fold_in(state.key, state.step)

    def loss_fn(p):
      pred = state.apply_fn(p, batch["x"], rngs={"dropout": dropout_key})
      return jnp.mean((pred - batch["y"]) ** 2)
    loss, grads = autopar.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  return make_state, step, {"x": x, "y": y}


def boundary_mlp_setup(layers=4, batch=16, d=8, tx=None):
  """A plain-JAX MLP whose loss marks a pipeline boundary after every layer
  (``PipeshardParallel(layers="manual")``)."""
  tx = tx or optax.sgd(0.1, momentum=0.9)
  rng = np.random.RandomState(0)
  params = [{"w": jnp.asarray(rng.randn(d, d).astype(np.float32) / np.sqrt(d)),
             "b": jnp.zeros((d,), jnp.float32)} for _ in range(layers)]
  x = rng.randn(batch, d).astype(np.float32)
  y = rng.randn(batch, d).astype(np.float32)

  def make_state():
    p = jax.tree.map(jnp.array, params)
    return {"params": p, "opt": tx.init(p)}

  def step(state, batch):
    def loss_fn(p):
      h = batch["x"]
      for k, layer in enumerate(p):
        h = jnp.tanh(h @ layer["w"] + layer["b"])
        if k < len(p) - 1:
          autopar.mark_pipeline_boundary()
      return jnp.mean((h - batch["y"]) ** 2)
    loss, grads = autopar.value_and_grad(loss_fn)(state["params"])
    updates, opt = tx.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

  return make_state, step, {"x": x, "y": y}


class ConvNet(nn.Module):
  """ReLU convolutions, then a global average pool."""
  c1: int = 16
  c2: int = 32

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(self.c1, (3, 3))(x))
    x = nn.relu(nn.Conv(self.c2, (3, 3))(x))
    return nn.Dense(10)(x.mean(axis=(1, 2)))


def image_setup(model, batch=32, hw=8):
  """A classification step for any ``model(images) -> logits`` (Adam)."""
  rng = np.random.RandomState(0)
  x = rng.randn(batch, hw, hw, 3).astype(np.float32)
  y = rng.randint(0, 10, size=(batch,)).astype(np.int32)
  params = model.init(jax.random.PRNGKey(0), x[:1])

  def make_state():
    return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                         tx=optax.adam(1e-3))

  def step(state, batch):
    def loss_fn(p):
      logits = state.apply_fn(p, batch["x"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    loss, grads = autopar.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  return make_state, step, {"x": x, "y": y}


def partitioned(f):
  """Element-wise ``f`` as a ``custom_partitioning`` op whose result takes
  its operand's sharding: an op JAX partitions with the devices in hand, as
  cuDNN's fused attention is."""
  from jax.experimental.custom_partitioning import custom_partitioning
  op = custom_partitioning(f)
  op.def_partition(
      infer_sharding_from_operands=lambda mesh, args, result: args[0].sharding,
      partition=lambda mesh, args, result: (mesh, f, args[0].sharding,
                                            (args[0].sharding,)),
      sharding_rule="... -> ...")
  return op


def moe_setup(E=4, V=16, D=16, T=6, B=16, aux=0.1, factor=True, counted=False):
  """A token mean plus a Switch load-balancing loss ``E · Σ_e f_e · P_e``
  (each a mean over the valid tokens; ``aux=0``: none), with dropout drawn
  on the expert's output, and the whole loss scaled by a factor of the
  parameters (``factor=False``: not). Returns ``(step, params, optimizer
  state, batch)``; ``step(params, opt, batch) -> (params, opt, loss)``
  (``counted``: ``step(params, opt, batch, count)``, the dropout's key
  folded with the step's ``count`` and dropout also drawn on the router's
  input, so that the sums read the draw)."""
  k = jax.random.split(jax.random.PRNGKey(0), 8)
  n = lambda key, shape, s: jax.random.normal(key, shape) * s
  params = {"embed": n(k[0], (V, D), 1.0), "w0": n(k[1], (D, D), 0.4),
            "router": n(k[2], (D, E), 0.5), "experts": n(k[3], (E, D, D), 0.3),
            "w1": n(k[4], (D, D), 0.4), "head": n(k[5], (D, V), 0.4),
            "temperature": jnp.float32(0.3)}

  def loss_fn(p, b, key):
    h = p["embed"][b["tokens"][:, :-1]]
    h = h + jnp.tanh(h @ p["w0"])
    if counted:
      h = jnp.where(jax.random.bernoulli(jax.random.fold_in(key, 1), 0.9, h.shape),
                    h / 0.9, 0)
    probs = jax.nn.softmax(h @ p["router"], axis=-1)
    top = jax.nn.one_hot(jnp.argmax(probs, -1), E)
    expert = jnp.tanh(jnp.einsum("btd,edf,bte->btf", h, p["experts"], top))
    keep = jax.random.bernoulli(key, 0.8, expert.shape)
    h = h + jnp.sum(probs * top, -1, keepdims=True) * jnp.where(keep, expert / 0.8, 0)
    h = h + jnp.tanh(h @ p["w1"])
    nll = optax.softmax_cross_entropy_with_integer_labels(h @ p["head"],
                                                          b["tokens"][:, 1:])
    m = b["mask"]
    count = jnp.sum(m)
    f = jnp.sum(top * m[..., None], (0, 1)) / count
    P = jnp.sum(probs * m[..., None], (0, 1)) / count
    balance = aux * E * jnp.sum(f * P) if aux else 0.0
    loss = jnp.sum(nll * m) / count + balance
    return loss * jnp.exp(p["temperature"]) if factor else loss

  tx = optax.adam(1e-2)

  def step(params, opt, b, count=None):
    key = jax.random.key(7) if count is None else jax.random.fold_in(jax.random.key(7),
                                                                     count)
    loss, g = autopar.value_and_grad(lambda p: loss_fn(p, b, key))(params)
    updates, opt = tx.update(g, opt, params)
    return optax.apply_updates(params, updates), opt, loss

  rng = np.random.RandomState(0)
  batch = {"tokens": rng.randint(0, V, (B, T + 1)).astype(np.int32),
           "mask": (rng.rand(B, T) < 0.7).astype(np.float32)}
  return step, params, tx.init(params), batch


class StoredBatches:
  """A data set of several batches in memory, read as a DataSource's loader:
  batch number ``step % len`` and of it the rows ``shard.rows``."""

  def __init__(self, batches):
    self.batches = batches

  def __call__(self, shard):
    batch = self.batches[shard.step % len(self.batches)]
    return jax.tree.map(lambda a: a[shard.rows], batch)

  def like(self):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self.batches[0])


class RowsChecked(StoredBatches):
  """StoredBatches that raises unless each host asks for the rows
  ``rows[host]`` ((start, stop)) names."""

  def __init__(self, batches, rows):
    super().__init__(batches)
    self.rows = rows

  def __call__(self, shard):
    if (shard.rows.start, shard.rows.stop) != self.rows[shard.host]:
      raise ValueError(f"host {shard.host} asked for rows {shard.rows}, expected "
                       f"{self.rows[shard.host]}")
    return super().__call__(shard)


class FailsOnce(StoredBatches):
  """StoredBatches that raises on host ``host`` the first time it is called
  there (a file not there yet)."""

  def __init__(self, batches, host):
    super().__init__(batches)
    self.host, self.calls = host, 0

  def __call__(self, shard):
    self.calls += 1
    if shard.host == self.host and self.calls == 1:
      raise OSError(f"host {shard.host}: the data file is not there yet")
    return super().__call__(shard)


def wait_for_ray_start(node, what: str, timeout: float = 120.0) -> None:
  """Returns once ``node`` (a ``ray start ... --block`` process, its output
  piped as text) says "Ray runtime started."; kills it and fails the test,
  with its last lines, if it ends or says nothing so within ``timeout``."""
  import queue
  import threading
  import time

  import pytest
  lines: "queue.Queue[str | None]" = queue.Queue()
  threading.Thread(target=lambda: ([lines.put(l) for l in node.stdout], lines.put(None)),
                   daemon=True).start()
  seen, deadline = [], time.monotonic() + timeout
  while not seen or "runtime started" not in seen[-1]:   # "Ray runtime started."
    try:
      line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
    except queue.Empty:
      line = None
    if line is None:
      node.kill()
      pytest.fail(f"{what} did not start in {timeout:.0f} s:\n" + "".join(seen[-30:]))
    seen.append(line)
