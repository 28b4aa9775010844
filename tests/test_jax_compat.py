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


def test_undecided_dim_equalities_are_answered_by_the_caller():
  """JAX answers an equality of a symbolic dimension it cannot decide with
  "unequal"; inside undecided_dim_equalities the caller answers it, told
  which frame compared (the step's, or JAX's own code), and only there."""
  from jax import export
  n, = export.symbolic_shape("n")
  asked = []

  def decide(a, b, frame):
    asked.append((str(a), b, frame.f_code.co_filename))
    return jax_compat.evaluate_dim(a - b, {"n": 16}) == 0

  assert not n == 16                       # JAX's guess
  with jax_compat.undecided_dim_equalities(decide):
    assert n == 16 and not n != 16 and n in (8, 16) and not n == 8
    assert n == n and not n == n + 1       # decided by JAX: not asked
    jax.eval_shape(lambda x: x + jnp.ones((16,)), jax.ShapeDtypeStruct((n,), jnp.float32))
  assert not n == 16                       # JAX's again
  mine = [a for a in asked if a[2] == __file__]
  assert [(a, b) for a, b, _ in mine] == [("n", 16), ("n", 16), ("n", 8), ("n", 16), ("n", 8)]
  # (broadcasting (n,) with (16,): JAX's own comparison, from its own code)
  assert any(f.startswith(jax_compat.JAX_SOURCE_DIR) for _, _, f in asked), asked


def test_undecided_dim_equalities_nest_and_refuse_hashing_outside_jax():
  """An inner context's ``decide`` that leaves a question (None) passes it to
  the outer one; hashing a symbolic dimension from outside JAX (a set
  lookup: no hash of it equals an integer's) is refused while one is active."""
  from jax import export
  from jax._src.core import InconclusiveDimensionOperation
  n, = export.symbolic_shape("n")
  m, = export.symbolic_shape("m")
  outer = lambda a, b, frame: jax_compat.evaluate_dim(a - b, {"n": 16}) == 0  # noqa: E731
  inner = lambda a, b, frame: None if "n" in str(a) else str(a - b) == "0"   # noqa: E731
  with jax_compat.undecided_dim_equalities(outer):
    with jax_compat.undecided_dim_equalities(inner):
      assert n == 16 and not m == 16
      try:
        16 in {n}
      except InconclusiveDimensionOperation:
        pass
      else:
        raise AssertionError("a set lookup of a symbolic dimension was answered")
  assert hash(n) == hash(n) and not n == 16


def test_equalities_compared_by_compiled_code_are_jaxs():
  """Compiled code comparing a symbolic dimension (a cache of JAX's looking
  up a key that holds the size: its hash table compares keys of unequal
  hashes too) is no branch of the step's: it keeps JAX's "unequal", or the
  lookup would hand back a trace cached at another size. A comparison in
  Python code, also of a dataclass holding the size, is asked."""
  import dataclasses
  import operator
  from jax import export
  n, = export.symbolic_shape("n")

  @dataclasses.dataclass(frozen=True)
  class Axis:
    size: object

  asked = []

  def decide(a, b, frame):
    asked.append(frame.f_code.co_filename)
    return True

  with jax_compat.undecided_dim_equalities(decide):
    assert not operator.eq(n, 16) and not operator.eq(Axis(n), Axis(16))
    assert not [Axis(16)].count(Axis(n))
    assert not asked
    assert n == 16 and Axis(n) == Axis(16) and Axis(n) in (Axis(16),)
  assert asked == [__file__] * 3


def test_a_primitive_lowered_outside_jax_keeps_a_step_out_of_the_stage_store():
  """A lowering rule of another package's is Python the stage store's key
  does not read (a kernel edited under the same name): such a step is
  compiled each time, not loaded (saved_stages)."""
  from jax.extend.core import Primitive
  from jax.interpreters import mlir

  double = Primitive("test_double")
  double.def_abstract_eval(lambda x: x)
  mlir.register_lowering(double, mlir.lower_fun(lambda x: x * 2, multiple_results=False))
  plain = jax.make_jaxpr(lambda x: jnp.sin(x) @ x.T)(jnp.ones((3, 3)))
  assert jax_compat.lowered_by_jax(plain)
  inner = jax.make_jaxpr(jax.jit(lambda x: double.bind(jnp.cos(x))))(jnp.ones(3))
  assert not jax_compat.lowered_by_jax(inner)
