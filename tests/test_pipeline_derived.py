"""Residuals that are functions of a stage's parameters alone (``pipeline/derived.py``): found
in the traced forward, and recomputed to the same bits. Pure jaxpr tests (nothing compiles);
the loop that uses them is exact in every pipeline test whose stages hold a LayerNorm."""

import jax
import jax.numpy as jnp
import numpy as np

from epljax.pipeline import derived


def _forward(w, stack, x):
  """A stage's forward shape: a weight cast (inside a call and a remat), a product with the
  activation, a scan over stacked weights carrying the activation, and a remat (``remat2`` on
  jax 0.10/0.11) making one value of the weight alone and one of the activation."""
  w16 = jax.jit(lambda w: w.astype(jnp.bfloat16))(w)
  wt = jax.checkpoint(lambda w: w.T * 2.0)(w)
  h = x.astype(jnp.bfloat16) @ w16

  def layer(c, s):
    return c * s, (s + 1.0, c * s)     # per layer: one of its weight alone, one of the carry

  _, (own, mixed) = jax.lax.scan(layer, h[0].astype(jnp.float32), stack)
  w3, xw = jax.checkpoint(lambda w, x: (w * 3.0, x @ w))(w, x)
  return w16, wt, h, own, mixed, w3, xw


def test_values_of_the_parameters_alone_are_recomputed_and_the_rest_is_stashed():
  w, stack, x = jnp.arange(12.0).reshape(3, 4) / 7, jnp.ones((5, 4)) / 3, jnp.ones((2, 3))
  closed = jax.make_jaxpr(_forward)(w, stack, x)
  fixed, program = derived.split(closed, 2, [0, 1, 2, 3, 4, 5, 6])
  assert fixed == [0, 1, 3, 5], fixed
  assert program.inputs == (0, 1)
  got = program([w, stack])
  want = [v for k, v in enumerate(_forward(w, stack, x)) if k in fixed]
  for g, e in zip(got, want, strict=True):
    assert g.dtype == e.dtype
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(e, np.float32))


def test_nothing_is_recomputed_when_every_residual_reads_the_activations():
  closed = jax.make_jaxpr(lambda w, x: (w * x, jnp.sin(x)))(jnp.ones(3), jnp.ones(3))
  assert derived.split(closed, 1, [0, 1]) == ([], None)
