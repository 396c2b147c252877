"""The one jaxpr walker (``sharding.program.walk``) and its two views: the capture's
``Program`` (every body entered) and the memory features' ``Steps`` (plain calls entered)."""

import jax
import jax.numpy as jnp

from epljax.sharding.program import REMAT, Program, steps_of


def nested(w, x):
  y = jax.jit(lambda a: jnp.sin(a @ w))(x)
  y = jax.lax.cond(y.sum() > 0, jnp.cos, jnp.tanh, y)
  y, _ = jax.lax.scan(lambda c, _: (c * 2.0, None), y, None, length=3)
  return jax.checkpoint(lambda v: jnp.exp(v).sum())(y)


def test_capture_enters_every_body_and_memory_only_plain_calls():
  closed = jax.make_jaxpr(nested)(jnp.ones((4, 4)), jnp.ones((2, 4)))
  capture = [n.primitive for n in Program(closed).nodes]
  steps = [s.primitive for s in steps_of(closed).steps]
  for prim in ("dot_general", "sin", "cos", "tanh", "mul", "exp"):
    assert prim in capture, (prim, capture)
  assert "dot_general" in steps and "sin" in steps                  # jit entered
  assert {"cond", "scan"} <= set(steps) and set(steps) & REMAT
  assert not {"cos", "tanh", "mul", "exp"} & set(steps)             # other bodies: one step


def test_capture_resolves_values_across_bodies():
  closed = jax.make_jaxpr(nested)(jnp.ones((4, 4)), jnp.ones((2, 4)))
  program = Program(closed)
  by_prim = {n.primitive: n for n in program.nodes}
  # Inside both branches of the cond, the operand is the jitted sin's output.
  for prim in ("cos", "tanh"):
    assert [p.primitive for p in program.node_producers(by_prim[prim])] == ["sin"]
  # The rematerialized exp reads what the scan body's multiply made.
  assert [p.primitive for p in program.node_producers(by_prim["exp"])] == ["mul"]
  # The weight (input 0) is read by the matmul inside the jit.
  assert [n.primitive for n, _ in program.uses_of_input(0)] == ["dot_general"]
