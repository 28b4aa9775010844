"""The grad marker primitive and the split of a step at it."""

import jax
import jax.numpy as jnp
import numpy as np

import autopar
from autopar.frontend.marker import grad_marker_p
from autopar.frontend.split import OutputKind, split_step
from autopar.frontend.trace import abstract_leaves, arg_names, classify_args, trace_step


def f(w, x):
  return jnp.sum(jnp.tanh(x @ w) ** 2)


W = jnp.arange(6.0).reshape(3, 2) / 10
X = jnp.arange(12.0).reshape(4, 3) / 10


def test_marker_is_invisible_to_jax_transformations():
  g = jax.grad(f)(W, X)
  np.testing.assert_allclose(autopar.grad(f)(W, X), g, rtol=1e-6)
  np.testing.assert_allclose(jax.jit(autopar.grad(f))(W, X), g, rtol=1e-6)
  v, g2 = autopar.value_and_grad(f)(W, X)
  np.testing.assert_allclose(v, f(W, X), rtol=1e-6)
  np.testing.assert_allclose(g2, g, rtol=1e-6)
  per_row = jax.vmap(autopar.grad(f), in_axes=(None, 0))(W, X[:, None])
  np.testing.assert_allclose(per_row, jax.vmap(jax.grad(f), in_axes=(None, 0))(
      W, X[:, None]), rtol=1e-6)
  np.testing.assert_allclose(jax.jacfwd(autopar.grad(f))(W, X),
                             jax.hessian(f)(W, X), rtol=1e-5)
  np.testing.assert_allclose(jax.jacrev(autopar.grad(f))(W, X),
                             jax.hessian(f)(W, X), rtol=1e-5)
  t = jax.linear_transpose(autopar.frontend.marker.mark_gradients, W)(W)
  np.testing.assert_allclose(t[0], W)


def test_marker_names_gradients_by_pytree_path():
  params = {"a": W, "b": {"c": jnp.ones(2)}}
  loss = lambda p: f(p["a"], X) + jnp.sum(p["b"]["c"] ** 2)
  jaxpr = jax.make_jaxpr(autopar.grad(loss))(params)
  (eqn,) = [e for e in jaxpr.eqns if e.primitive is grad_marker_p]
  assert eqn.params["names"] == ("grad['a']", "grad['b']['c']")


def _split(step, *args, batch_argnums=(1,)):
  flags = classify_args(args, static_argnums="auto", batch_argnums=batch_argnums,
                        donate_argnums=(), fn_name="step")
  leaves, tree, _ = abstract_leaves(args, flags, arg_names(step, len(args)))
  # Two sizes tell which dimensions hold rows (as for a step that cannot be
  # traced at a symbolic batch size).
  at = lambda rows: trace_step(step, args, flags, leaves, tree, micro_batch_size=rows)
  return split_step(at(2), reference=at(4))


def test_split_puts_forward_backward_in_compute_and_update_in_apply():
  def step(w, x):
    loss, g = autopar.value_and_grad(f)(w, x)
    return w - 0.1 * g, loss, x.sum(axis=1), w.sum()

  s = _split(step, W, X)
  assert s.has_marker and s.num_grads == 1
  # The loss (a sum over the rows) is accumulated beside the gradient and
  # handed to apply_grad; the per-example sums are concatenated.
  assert s.out_kinds == (OutputKind.APPLY, OutputKind.APPLY, OutputKind.CONCAT,
                         OutputKind.APPLY)
  assert s.reduced == ("sum",)
  compute_prims = {e.primitive.name for e in s.compute.jaxpr.eqns}
  apply_prims = {e.primitive.name for e in s.apply.jaxpr.eqns}
  assert "dot_general" in compute_prims and "tanh" in compute_prims
  assert "dot_general" not in apply_prims and "tanh" not in apply_prims
  assert grad_marker_p.name not in compute_prims | apply_prims
  # compute_grad returns the gradient first, then the reductions, then the
  # per-micro-batch outputs.
  assert len(s.compute.jaxpr.outvars) == 1 + 1 + 1


def test_marker_inside_jit_is_inlined():
  @jax.jit
  def inner(w, x):
    return autopar.value_and_grad(f)(w, x)

  def step(w, x):
    loss, g = inner(w, x)
    return w - g, loss

  s = _split(step, W, X)
  assert s.has_marker and s.out_kinds == (OutputKind.APPLY, OutputKind.APPLY)
  assert s.reduced == ("sum",)


def test_step_without_marker_is_one_apply_part():
  s = _split(lambda w, x: (w - jax.grad(f)(w, x),), W, X)
  assert not s.has_marker and s.out_kinds == (OutputKind.APPLY,)


def test_dead_code_elimination_matches_jax():
  """split.dce (a fast path for equations without a DCE rule) removes what
  JAX's dce_jaxpr removes: dead equations, unused loop outputs and carries
  inside scan / while / cond, and nothing with an effect."""
  from autopar.jax_compat import dce_jaxpr
  from autopar.frontend.split import dce

  def fn(w, x):
    dead = jnp.sin(x) * 3.0                          # unused
    def body(c, xs):
      return (c[0] + xs @ w, c[1] * 2.0), (jnp.tanh(xs), xs.sum())
    (c0, _), (ys, _) = jax.lax.scan(body, (jnp.zeros(2), jnp.ones(())), x)
    out = jax.lax.cond(x.sum() > 0, lambda a: (a * 2, a + 1), lambda a: (a, a), c0)[0]
    n, _ = jax.lax.while_loop(lambda s: s[0] < 3, lambda s: (s[0] + 1, s[1] * 2),
                              (0, dead.sum()))
    jax.debug.callback(lambda v: None, x.sum())      # an effect: kept
    return out + n + ys.sum(), dead.mean()

  jaxpr = jax.make_jaxpr(fn)(W, X).jaxpr
  for keep in ([0], [1], [0, 1]):
    j = jaxpr.replace(outvars=[jaxpr.outvars[i] for i in keep])
    ref, _ = dce_jaxpr(j, [True] * len(keep), instantiate=True)
    new = dce(j)
    assert str(new) == str(ref)
    assert new.effects == ref.effects
    assert str(new) != str(j)          # the scan's unused outputs at least
  assert len(dce(jaxpr.replace(outvars=jaxpr.outvars[:1])).eqns) < len(jaxpr.eqns)


def test_traces_at_two_sizes_are_paired_where_their_equations_differ():
  """At one row the transpose of the bias's implicit broadcast sums no rows
  (no reduce_sum, no reshape): the row analysis pairs the two programs'
  values by a diff of their equations kept where the data flows alike
  (align.py), so the rows are known past the difference."""
  from autopar.frontend.align import paired_eqns
  from autopar.frontend.rows import RowDim, RowOracle

  def loss(b, x):
    return jnp.sum(jnp.tanh(x @ W + b) ** 2)

  def program(rows):
    return jax.make_jaxpr(jax.value_and_grad(loss))(jnp.ones(2), X[:1].repeat(rows, 0)).jaxpr

  one, four = program(1), program(4)
  assert len(one.eqns) < len(four.eqns)
  pairs, partner = paired_eqns(one, four)
  assert len(pairs) == len(one.eqns)                  # every equation of one's
  value, grad = one.outvars
  assert partner[value] is four.outvars[0]
  # four's gradient is the paired reduce_sum's result reshaped and summed.
  assert grad in partner and partner[grad].aval.shape == (2,)
  oracle = RowOracle.paired(one, four, 1, 4)
  tanh = next(e for e in one.eqns if e.primitive.name == "tanh")
  assert oracle.dims(tanh.outvars[0]) == [RowDim(0, 1)]
