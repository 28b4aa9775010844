"""autopar.calibrate: α and β per mesh axis and seconds per flop, measured on
the 8 simulated CPU devices, kept on disk, and planned with."""

import jax
import optax
import pytest

import autopar
from models import mlp_setup

SIZES = 4          # 1, 4, 16, 64 KiB


@pytest.fixture()
def cache_dir(tmp_path, monkeypatch):
  monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
  return tmp_path


def test_calibrate_fits_every_axis_and_is_kept(cache_dir):
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  cal = autopar.calibrate(mesh, max_bytes=64 * 1024, repeats=3)
  assert not cal.cached and cal.device_kind == jax.devices()[0].device_kind
  assert set(cal.alpha) == set(cal.beta) == {"data", "model"}
  assert all(a >= 0 for a in cal.alpha.values()) and all(b > 0 for b in cal.beta.values())
  assert set(cal.seconds_per_flop) == {"float32", "bfloat16"}
  assert all(0 < s < 1e-6 for s in cal.seconds_per_flop.values())
  assert len(cal.samples) == 2 * 4 * SIZES
  assert {k for _, k, _, _ in cal.samples} == {"all-reduce", "all-gather",
                                               "reduce-scatter", "all-to-all"}
  again = autopar.calibrate(mesh)              # from the disk, not measured again
  assert again.cached and again.alpha == cal.alpha and again.beta == cal.beta
  assert list((cache_dir / "calibration").iterdir())


def test_measured_costs_are_planned_with(cache_dir):
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  cal = autopar.calibrate(mesh, max_bytes=16 * 1024, repeats=3)
  make_state, step, batch = mlp_setup(tx=optax.sgd(0.1))
  option = autopar.AutoShardingOption(costs="measured", mesh_beta={"data": 1e-9})
  plan = autopar.parallelize(step, method=autopar.ShardParallel(
      mesh=mesh, option=option)).plan(make_state(), batch)
  assert plan.costs["alpha"] == pytest.approx(cal.alpha)
  assert plan.costs["beta"]["model"] == pytest.approx(cal.beta["model"])
  assert plan.costs["beta"]["data"] == 1e-9                 # given by hand: kept
  assert plan.costs["seconds_per_flop"] == pytest.approx(cal.seconds_per_flop["float32"])
  assert "device kind" in plan.summary()
  # An abstract mesh: the calibration kept for its device kind.
  abstract = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
  option = autopar.AutoShardingOption(costs="measured", device_kind=cal.device_kind)
  plan = autopar.parallelize(step, method=autopar.ShardParallel(
      mesh=abstract, option=option)).plan(jax.eval_shape(make_state), batch)
  assert plan.costs["beta"] == pytest.approx(cal.beta)
  option = autopar.AutoShardingOption(costs="measured", device_kind="NVIDIA H100")
  with pytest.raises(autopar.PlanError, match="no calibration on disk"):
    autopar.parallelize(step, method=autopar.ShardParallel(
        mesh=abstract, option=option)).plan(jax.eval_shape(make_state), batch)
  with pytest.raises(autopar.InputError, match="costs="):
    autopar.AutoShardingOption(costs="fast")
  with pytest.raises(autopar.InputError, match="AbstractMesh"):
    autopar.calibrate(abstract)


def test_costs_from_the_device_kind():
  """An AbstractMesh told its device kind and hosts: each axis costs the
  links it crosses; what the user gives is kept; a real CPU mesh keeps the
  former defaults."""
  from autopar.costs.devices import axes_crossing_hosts, device_kind
  make_state, step, batch = mlp_setup(tx=optax.sgd(0.1))
  abstract = jax.sharding.AbstractMesh((2, 4), ("data", "model"))

  def costs(mesh, **kw):
    option = autopar.AutoShardingOption(**kw)
    args = (jax.eval_shape(make_state), batch)
    return autopar.parallelize(step, method=autopar.ShardParallel(
        mesh=mesh, option=option)).plan(*args)

  plan = costs(abstract, device_kind="H100", devices_per_host=4)
  c = plan.costs
  assert c["device_kind"] == "H100"
  assert c["beta"]["data"] == pytest.approx(1 / 50e9)       # crosses hosts: the NIC
  assert c["beta"]["model"] == pytest.approx(1 / 450e9)     # inside a node: NVLink
  assert c["alpha"]["data"] > c["alpha"]["model"]
  assert c["seconds_per_flop"] == pytest.approx(1 / 67e12)  # a float32 step
  assert "device kind H100" in plan.summary()
  c = costs(abstract, device_kind="NVIDIA A100-SXM4-80GB", mesh_beta={"data": 1e-8},
            seconds_per_flop=1e-13).costs
  assert c["device_kind"] == "A100" and c["beta"]["data"] == 1e-8
  assert c["beta"]["model"] == pytest.approx(1 / 300e9) and c["seconds_per_flop"] == 1e-13
  assert costs(abstract).costs["device_kind"] is None        # nothing named: defaults
  real = costs(jax.make_mesh((2, 4), ("data", "model"))).costs
  assert real["device_kind"] == "CPU" and real["beta"]["data"] == pytest.approx(1e-10)
  with pytest.raises(autopar.InputError, match="not a device kind"):
    costs(abstract, device_kind="Abacus")
  assert axes_crossing_hosts(jax.sharding.AbstractMesh((4, 2), ("x", "y")), 2) == ("x",)
  assert axes_crossing_hosts(jax.sharding.AbstractMesh((2, 4), ("x", "y")), 2) == ("x", "y")
  assert axes_crossing_hosts(abstract, None) == ()
  assert device_kind("TPU v5 lite").name == "TPU v5e" and device_kind("cpu").name == "CPU"
