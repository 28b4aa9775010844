"""A tiny Gemma 3 from DeepMind's ``gemma`` package, trained with autopar.

    python examples/train_gemma.py          (Python >= 3.12, with gemma installed;
                                             `make test` installs it in .venv)

Gemma's ``Transformer.__call__`` is wrapped in ``flax.linen.jit``: autopar
plans through the nested jit, and ``remat="layers"`` finds Gemma's repeated
blocks inside it (alternating sliding-window and global attention layers).
The step is the one a Gemma user writes: ``model.apply`` on the tokens,
cross-entropy against the next token, an optax update. It runs under
``ShardParallel`` on 8 simulated CPU devices (2 x 4, two micro-batches,
``remat="layers"``) and is compared with ``jax.jit`` on one device.
No weights are downloaded: the model is a random, 6-layer, width-64 Gemma 3.
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")    # gemma imports TensorFlow

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import autopar  # noqa: E402

try:
  from gemma import gm  # noqa: E402
except ImportError as e:
  print(f"examples/train_gemma.py: skipped, the gemma package cannot be imported ({e}). "
        f"It needs Python >= 3.12: `make test` installs it in .venv there "
        f"(see the Makefile for its requirements).")
  sys.exit(0)

VOCAB, SEQ, BATCH, STEPS = 128, 32, 16, 5


def make_model():
  config = gm.nn.config.TransformerConfig(
      num_embed=VOCAB, embed_dim=64, hidden_dim=256, num_heads=4, head_dim=16,
      num_kv_heads=2, final_logit_softcap=None, use_post_attn_norm=True,
      use_post_ffw_norm=True, use_qk_norm=True, sliding_window_size=8,
      transpose_gating_einsum=True,
      attention_types=gm.nn.config.make_attention_layers_types(
          (gm.nn.AttentionType.LOCAL_SLIDING,) * 2 + (gm.nn.AttentionType.GLOBAL,),
          num_layers=6))
  return gm.nn.Gemma3_1B(config=config, dtype=jnp.float32)


def main():
  model = make_model()
  tx = optax.sgd(0.1, momentum=0.9)   # (Adam would amplify float rounding in tiny gradients)
  rng = np.random.RandomState(0)
  batches = [rng.randint(1, VOCAB, size=(BATCH, SEQ + 1)).astype(np.int32)
             for _ in range(STEPS)]
  params = model.init(jax.random.PRNGKey(0), batches[0][:1, :-1])["params"]

  def train_step(params, opt_state, tokens):
    def loss_fn(p):
      logits = model.apply({"params": p}, tokens[:, :-1]).logits
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    loss, grads = autopar.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  mesh = jax.make_mesh((2, 4), ("data", "model"))
  method = autopar.ShardParallel(mesh=mesh, num_micro_batches=2, remat="layers")
  step = autopar.parallelize(train_step, method=method, batch_argnums=(2,),
                             donate_argnums=())
  reference = jax.jit(train_step)

  state, ref = (params, tx.init(params)), (params, tx.init(params))
  for k, tokens in enumerate(batches):
    *state, loss = step(*state, tokens)
    *ref, ref_loss = reference(*ref, tokens)
    print(f"step {k}: loss {float(loss):.5f}   jax.jit {float(ref_loss):.5f}")
  print(step.get_executable(*state, batches[0]).plan.summary())
  worst = max(float(jnp.max(jnp.abs(a - b)))
              for a, b in zip(jax.tree.leaves(state[0]), jax.tree.leaves(ref[0])))
  print(f"largest parameter difference from jax.jit after {STEPS} steps: {worst:.2e}")
  assert worst < 1e-5, worst


if __name__ == "__main__":
  main()
