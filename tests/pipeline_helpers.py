"""Pipelined models of the tests, and the check every pipeline case must pass."""

from __future__ import annotations

import logging

import flax.linen as nn
import jax
import numpy as np
import optax

import epljax as epl
from helpers import TOL, assert_trees_close, cross_entropy, linen_fns, reference_run


class TwoStages(nn.Module):
  """Heterogeneous stages cut by named scopes (EPL's pipeline example): different layers,
  different parameter and activation shapes; the input scaling before the first scope joins
  stage_0 and the loss after the last joins stage_1."""

  @nn.compact
  def __call__(self, x):
    x = x * 0.5
    with epl.replicate(1, name="stage_0"):
      h = nn.relu(nn.Dense(32)(x))
    with epl.replicate(1, name="stage_1"):
      h = nn.tanh(nn.Dense(24)(h))
      return nn.Dense(10)(h)


class Block(nn.Module):
  width: int

  @nn.compact
  def __call__(self, h):
    y = nn.Dense(self.width)(nn.LayerNorm()(h))
    return h + nn.Dense(self.width)(nn.gelu(y))


class Stack(nn.Module):
  """Identical stages cut by ``set_default_strategy`` between layers (EPL's BERT example)."""
  stages: int = 4
  layers: int = 1
  width: int = 16
  device_count: int = 1

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(self.width)(x)                   # before the first call: joins stage 0
    for _ in range(self.stages):
      epl.set_default_strategy(epl.replicate(self.device_count))
      for _ in range(self.layers):
        h = Block(self.width)(h)
    return nn.Dense(10)(h)                        # after the last call: the last stage


def check_matches_reference(model: nn.Module, batch, optimizer, *, steps: int = 2, tol=TOL,
                            caplog=None):
  """Loss, gradients, parameters after ``steps`` equal single-device training; one compile of
  the step; shardings and dtypes kept. Returns the trainer and its final state."""
  init_fn, loss_fn = linen_fns(model)
  trainer = epl.Trainer(init_fn, loss_fn, optimizer)
  state = trainer.init(jax.random.key(0), batch)
  shardings = jax.tree.map(lambda x: x.sharding, state)
  dtypes = jax.tree.map(lambda x: x.dtype, state)
  history, expected = reference_run(init_fn, loss_fn, optimizer, jax.random.key(0), batch, steps)
  loss0, grads0 = trainer.loss_and_grads(state, batch)
  np.testing.assert_allclose(loss0, history[0][0], **tol)
  assert_trees_close(grads0, history[0][1], tol)
  if caplog is not None:
    caplog.set_level(logging.WARNING)
  with jax.log_compiles():
    for step in range(steps):
      state, metrics = trainer.train_step(state, batch)
      np.testing.assert_allclose(metrics["loss"], history[step][0], **tol)
  if caplog is not None:
    compiles = [r for r in caplog.records if "Compiling" in r.getMessage()
                and "epl_step" in r.getMessage()]
    assert len(compiles) == 1, [r.getMessage()[:80] for r in compiles]
  assert_trees_close(trainer.variables(state), expected, tol)
  assert jax.tree.map(lambda x: x.sharding, state) == shardings
  assert jax.tree.map(lambda x: x.dtype, state) == dtypes
  return trainer, state


def adamw():
  return optax.adamw(1e-2, weight_decay=1e-2)


__all__ = ["Block", "Stack", "TwoStages", "adamw", "check_matches_reference", "cross_entropy"]
