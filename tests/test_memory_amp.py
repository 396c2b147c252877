"""Mixed precision O1: bfloat16 compute, float32 master weights, loss scaling and skipped steps.

bfloat16 keeps 8 bits of mantissa (relative step 2**-8); a gradient goes through a few casts
and bfloat16 matmuls, so it is compared per leaf to 2**-5 of the leaf's largest magnitude, the
loss to 2**-8.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import epljax as epl
from epljax.memory import amp
from helpers import (MLP, classification_batch, cross_entropy, linen_fns, momentum_grads,
                     reference_run)

LOSS_RTOL = 2.0 ** -8
GRAD_RTOL = 2.0 ** -5
MODEL = MLP(hidden=64, classes=16)


def assert_close_in_bf16(actual, expected, rtol=GRAD_RTOL):
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    a, e = np.asarray(a, np.float32), np.asarray(e, np.float32)
    assert np.max(np.abs(a - e)) <= rtol * np.max(np.abs(e)) + 1e-7, (a, e)


def test_o1_matches_the_reference_within_bfloat16_precision():
  init_fn, loss_fn = linen_fns(MODEL)
  batch = classification_batch(64, classes=16)
  # SGD with momentum: its trace after the first step is that step's gradient, read below
  # instead of compiling loss_and_grads as well.
  optimizer = optax.sgd(0.1, momentum=0.9)
  history, expected = reference_run(init_fn, loss_fn, optimizer, jax.random.key(0), batch, 2)
  epl.init({"amp.level": "O1"})
  trainer = epl.Trainer(init_fn, loss_fn, optimizer)
  state = trainer.init(jax.random.key(0), batch)
  for step in range(2):
    state, metrics = trainer.train_step(state, batch)
    np.testing.assert_allclose(metrics["loss"], history[step][0], rtol=LOSS_RTOL)
    if step == 0:   # the first step's (float32) gradient, as loss_and_grads gives it
      assert_close_in_bf16(momentum_grads(trainer, state), history[0][1])
  assert_close_in_bf16(trainer.variables(state), expected)
  # Master weights stay float32; the matmuls run in bfloat16; no bfloat16 copy is state.
  assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
  text = trainer.lower(state, batch).as_text()
  assert "bf16" in text and "stablehlo.dot_general" in text
  assert int(metrics["amp_skipped_steps"]) == 0
  assert float(metrics["loss_scale"]) == 2.0 ** 15
  assert any("bfloat16 compute cast at use; dynamic loss scale" in f
             for f in trainer.plan.features)


def test_dynamic_loss_scale_skips_an_overflowing_step_and_recovers(caplog):
  init_fn, loss_fn = linen_fns(MODEL)
  batch = classification_batch(64, classes=16)
  poisoned = {**batch, "x": batch["x"].copy()}
  poisoned["x"][0, 0] = np.inf
  history, expected = reference_run(init_fn, loss_fn, optax.sgd(0.1), jax.random.key(0),
                                    batch, 2)
  epl.init({"amp.level": "O1", "amp.debug_log": True})
  trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(0.1))
  state = trainer.init(jax.random.key(0), batch)
  caplog.set_level(logging.INFO, logger="epljax.amp")
  state, m1 = trainer.train_step(state, batch)
  after_first = jax.tree.map(np.asarray, state.params)
  state, m2 = trainer.train_step(state, poisoned)
  jax.effects_barrier()
  assert int(m2["amp_skipped_steps"]) == 1 and float(m2["loss_scale"]) == 2.0 ** 14
  assert_close_in_bf16(state.params, after_first, rtol=0)     # the update was skipped
  assert any("non-finite gradients, step skipped; loss scale 32768 -> 16384" in r.getMessage()
             for r in caplog.records)
  state, m3 = trainer.train_step(state, batch)
  assert int(m3["amp_skipped_steps"]) == 1 and float(m3["loss_scale"]) == 2.0 ** 14
  np.testing.assert_allclose(m3["loss"], history[1][0], rtol=LOSS_RTOL)
  assert_close_in_bf16(trainer.variables(state), expected)


def test_dynamic_scale_doubles_after_2000_good_steps_and_halves_on_overflow():
  def run(n, scale, good):
    def body(_, carry):
      return amp.next_scale(*carry, True, True, amp.GROWTH_INTERVAL)
    return jax.lax.fori_loop(0, n, body, (scale, good))

  scale, good = jax.jit(run, static_argnums=0)(1999, jnp.float32(2.0 ** 15), jnp.int32(0))
  assert float(scale) == 2.0 ** 15 and int(good) == 1999
  scale, good = amp.next_scale(scale, good, True, True, amp.GROWTH_INTERVAL)
  assert float(scale) == 2.0 ** 16 and int(good) == 0
  scale, good = amp.next_scale(scale, jnp.int32(5), False, True, amp.GROWTH_INTERVAL)
  assert float(scale) == 2.0 ** 15 and int(good) == 0
  fixed, _ = amp.next_scale(jnp.float32(128), jnp.int32(0), False, False, amp.GROWTH_INTERVAL)
  assert float(fixed) == 128


def test_fixed_loss_scale():
  model = MLP(hidden=64, classes=16)

  def loss_fn(variables, b):
    return cross_entropy(model.apply(variables, b["x"]), b["y"])

  init_fn = linen_fns(model)[0]
  batch = classification_batch(64, classes=16)
  history, expected = reference_run(init_fn, loss_fn, optax.sgd(0.1), jax.random.key(0),
                                    batch, 1)
  epl.init({"amp.level": "O1", "amp.loss_scale": 128})
  trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(0.1))
  state = trainer.init(jax.random.key(0), batch)
  state, metrics = trainer.train_step(state, batch)
  assert float(metrics["loss_scale"]) == 128
  np.testing.assert_allclose(metrics["loss"], history[0][0], rtol=LOSS_RTOL)
  assert_close_in_bf16(trainer.variables(state), expected)
  assert any("fixed loss scale 128" in f for f in trainer.plan.features)


@pytest.mark.parametrize("key, value, message", [
    ("amp.level", "O2", r"'amp.level' .* must be one of '', 'O1'; got 'O2'"),
    ("amp.loss_scale", "auto", r"'amp.loss_scale' .* must be 'dynamic' or a positive number"),
    ("amp.loss_scale", -1, r"'amp.loss_scale' .* must be 'dynamic' or a positive number"),
])
def test_invalid_values_list_the_valid_ones(key, value, message):
  with pytest.raises(epl.ConfigError, match=message):
    epl.Config({key: value})
