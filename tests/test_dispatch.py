"""A steady-state call's host work (issue 34): arguments prepared once per
kind, placement checked once per sharding, gradient stages given only the
leaves they read, a pipeline's step without per-task statistics or
recompiles. Timings are benchmark/dispatch.py's and benchmark/pipeline.py's;
these check the behaviour those figures rest on."""

import jax
import numpy as np
import optax
import pytest

import autopar
from models import assert_trees_close, boundary_mlp_setup, mlp_setup, single_device


def _mesh8():
  return jax.make_mesh((8,), ("data",))


def test_calls_reuse_the_preparation_of_their_kind_of_arguments():
  make_state, step, batch = mlp_setup(batch=32, din=8, hidden=16, dout=4)
  pf = autopar.parallelize(step, method=autopar.DataParallel(mesh=_mesh8()))
  state = make_state()
  first = pf._prepare((state, batch))
  again = pf._prepare((state, batch))
  assert again.key == first.key and again.leaves is first.leaves
  assert all(a is b for a, b in zip(again.values, first.values))
  # Another shape, or another static value, is another kind of arguments.
  half = {k: v[:16] for k, v in batch.items()}
  assert pf._prepare((state, half)).key != first.key
  # The fast path gives what preparing afresh gives.
  fresh = pf._prepare_new((state, batch))
  assert fresh.key == again.key and fresh.flags == again.flags
  assert [l.path for l in fresh.leaves] == [l.path for l in again.leaves]
  assert all(a is b for a, b in zip(fresh.values, again.values))


def test_steady_state_calls_equal_one_device_and_skip_placed_leaves():
  make_state, step, batch = mlp_setup(batch=32, din=8, hidden=16, dout=4)
  pf = autopar.parallelize(step, method=autopar.DataParallel(mesh=_mesh8(),
                                                             num_micro_batches=2))
  ref = single_device(step)
  state, want = make_state(), make_state()
  for _ in range(3):
    state, loss = pf(state, batch)
    want, want_loss = ref(want, batch)
  assert_trees_close(state.params, want.params)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  exe = pf.get_executable(state, batch)
  placed = exe.place(pf._prepare((state, batch)).values)
  params = jax.tree.leaves(state.params)
  assert any(p is x for p in params for x in placed)   # no copy of a placed leaf
  # The gradient stages take the leaves the gradient reads and the batch,
  # not the optimizer state.
  lw = exe.lowered
  assert 0 < len(lw.grad_leaves) < len(lw.in_shardings)


def test_pipeline_step_keeps_no_statistics_unless_asked_and_compiles_once():
  make_state, step, batch = boundary_mlp_setup(batch=16, d=8, tx=optax.sgd(0.1))
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  pf = autopar.parallelize(step, method=autopar.PipeshardParallel(
      mesh=mesh, num_micro_batches=4, num_stages=2, layers="manual"))
  state = make_state()
  state, _ = pf(state, batch)
  exe = pf.get_executable(state, batch)
  assert exe.step.stats == {}                  # training: nothing measured
  first = exe.stages
  assert all(first[k] is v for k, v in exe.stages.items())   # compiled once
  exe.step.recording = True
  state, _ = pf(state, batch)
  assert len(exe.step.stats["held_bytes_peak"]) == 2
  exe.step.recording = False
  # Its results equal one device's.
  ref = single_device(step)
  s1, s2 = make_state(), make_state()
  for _ in range(2):
    s1, l1 = pf(s1, batch)
    s2, l2 = ref(s2, batch)
  assert_trees_close(s1["params"], s2["params"])
  np.testing.assert_allclose(l1, l2, rtol=1e-5)


def test_a_remote_array_handle_is_not_kept_by_the_arguments_cache():
  """A Ray RemoteArray frees its value on the workers when the handle goes:
  the preparation cache must not keep handles (it keeps none of their calls)."""
  import gc

  from autopar.runtime.cluster import RemoteArray

  class Cluster:                      # what a RemoteArray tells when it goes
    forgotten: list = []

    def _forget(self, i):
      self.forgotten.append(i)
  cluster = Cluster()
  pf = autopar.parallelize(lambda w, x: w, donate_argnums=(), batch_argnums=(1,),
                           static_argnums=())
  for i in range(3):
    w = RemoteArray(cluster, i, (4,), np.float32)
    pf.check_donation((w, np.ones((8, 4), np.float32)))
    del w
    gc.collect()
  assert cluster.forgotten == [0, 1, 2]


def _record_direct_runs(monkeypatch) -> list:
  """What each direct call (api._Direct.run) returns, from now on: its
  outputs, or None where the call took the full path."""
  from autopar import api
  runs = []
  real = api._Direct.run
  monkeypatch.setattr(api._Direct, "run",
                      lambda self, flat: runs.append(real(self, flat)) or runs[-1])
  return runs


@pytest.mark.parametrize("method", [
    dict(), dict(num_micro_batches=2), dict(one_executable=False)])
def test_a_step_calls_its_executables_on_the_leaves_as_they_come(monkeypatch, method):
  """A steady-state call hands the step's executables (one with one
  micro-batch, the default; else the gradient stages and the update) the
  argument leaves as they come, and they check their types and shardings
  themselves (api._Direct). Each batch size keeps its own, and host
  batches run directly too (placed once for all the stages). An argument on
  another sharding, a donated state passed again and tied donated leaves
  take the full path, which places them or says what is wrong (an
  executable crashes the process on a donated array)."""
  runs = _record_direct_runs(monkeypatch)
  make_state, step, batch = mlp_setup(batch=32, din=8, hidden=16, dout=4)
  mesh = _mesh8()
  pf = autopar.parallelize(step, method=autopar.DataParallel(mesh=mesh, **method))
  n_exes = len(pf.get_executable(make_state(), batch).schedule)
  # (Two micro-batches: zero_grad, accumulate_grad twice, sync_grad, apply_grad.)
  assert n_exes == (1 if not method else 5 if "num_micro_batches" in method else 2)
  ref = single_device(step)
  state, want = make_state(), make_state()
  half = {k: v[:16] for k, v in batch.items()}
  for b in (batch, batch, half, batch, half, half):
    state, loss = pf(state, b)                     # host (numpy) batches
    want, want_loss = ref(want, b)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  assert_trees_close(state.params, want.params)
  assert_trees_close(state.opt_state, want.opt_state)
  # Every call after each batch size's first ran directly.
  assert len(runs) == 4 and all(r is not None for r in runs), runs
  # A state on one device (another sharding): placed by the full path.
  moved = jax.device_put(state, jax.devices()[3])
  state, loss = pf(moved, batch)
  want, want_loss = ref(want, batch)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  assert runs[-1] is None
  # The state donated to the last call, passed again: autopar's error.
  old = state
  state, _ = pf(state, batch)
  with pytest.raises(autopar.InputError, match="was donated to an earlier call"):
    pf(old, batch)
  # Tied donated leaves.
  leaves, tree = jax.tree.flatten(state)
  params = [k for k, x in enumerate(leaves) if x.ndim == 2]
  leaves[params[1]] = leaves[params[0]]
  with pytest.raises(autopar.InputError, match="are the same array"):
    pf(jax.tree.unflatten(tree, leaves), batch)
  assert runs[-2:] == [None, None]


def test_an_error_from_a_direct_call_that_ran_is_raised_as_it_is():
  """A step that fails once it has run (a NaN under jax_debug_nans) raises
  that error, and is not run again by the full path."""
  make_state, step, batch = mlp_setup(batch=32, din=8, hidden=16, dout=4)
  pf = autopar.parallelize(step, method=autopar.DataParallel(mesh=_mesh8()))
  state = make_state()
  for _ in range(2):
    state, _ = pf(state, batch)
  bad = {k: np.full_like(v, np.nan) if k == "x" else v for k, v in batch.items()}
  # (JAX's own error from a compiled program, which it does not run again op
  # by op as jax.jit does; the full path would take the state it used up for
  # one donated to an earlier call)
  with jax.debug_nans(True), pytest.raises(Exception, match="nan") as raised:
    pf(state, bad)
  assert not isinstance(raised.value, autopar.InputError)


def test_update_leaves_refused_after_the_gradient_ran_are_placed_not_recomputed(monkeypatch):
  """With several executables, a direct call whose optimizer state is not
  where the plan puts it (here on one device) is refused by the update
  after the gradient stages ran: those leaves are placed and the update
  called again, and the gradient is computed once."""
  make_state, step, batch = mlp_setup(batch=32, din=8, hidden=16, dout=4)
  pf = autopar.parallelize(step, method=autopar.DataParallel(
      mesh=_mesh8(), num_micro_batches=2, grad_sync="apart"))
  ref = single_device(step)
  state, want = make_state(), make_state()
  for _ in range(2):
    state, _ = pf(state, batch)
    want, _ = ref(want, batch)
  exe = pf.get_executable(state, batch)
  first = "accumulate_grad"            # (each micro-batch's gradient)
  calls = []
  real_stage = exe.lowered.stages[first]
  monkeypatch.setitem(exe.lowered.stages, first,
                      lambda *a: calls.append(first) or real_stage(*a))
  runs = _record_direct_runs(monkeypatch)
  moved = state.replace(opt_state=jax.device_put(state.opt_state, jax.devices()[3]))
  state, loss = pf(moved, batch)
  want, want_loss = ref(want, batch)
  assert calls == [first] * 2 and runs[-1] is not None, (calls, runs)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  assert_trees_close(state.params, want.params)
  assert_trees_close(state.opt_state, want.opt_state)
