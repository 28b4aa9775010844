"""autopar's use of JAX internals goes through autopar/jax_compat.py."""

import pathlib
import re

import jax
import jax.numpy as jnp

from autopar import jax_compat

ROOT = pathlib.Path(__file__).resolve().parents[1]
PRIVATE = re.compile(r"^\s*(from|import)\s+jax\.(_src|interpreters)\b|\bjax\.core\.\w", re.M)


def test_no_module_but_jax_compat_imports_jax_internals():
  offenders = []
  for path in sorted((ROOT / "autopar").rglob("*.py")):
    if path.name == "jax_compat.py":
      continue
    for m in PRIVATE.finditer(path.read_text()):
      line = path.read_text()[:m.start()].count("\n") + 1
      offenders.append(f"{path.relative_to(ROOT)}:{line}")
  assert not offenders, ("import JAX internals through autopar/jax_compat.py: "
                         + ", ".join(offenders))


def test_dce_rule_takes_used_outputs_and_equation():
  """On every supported JAX, the adapted rule of a scan drops an unused
  loop output."""
  def fn(x):
    def body(c, xs):
      return c + xs, (jnp.sin(xs), xs * 2)
    c, (a, b) = jax.lax.scan(body, 0.0, x)
    return c, a, b
  eqn = jax.make_jaxpr(fn)(jnp.ones(3)).jaxpr.eqns[0]
  rule = jax_compat.dce_rule(eqn.primitive)
  used_inputs, new = rule([True, False, True], eqn)
  assert len(used_inputs) == len(eqn.invars)
  assert len(new.outvars) == 2
