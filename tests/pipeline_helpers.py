"""Pipelined models of the tests, the cases every pipeline must pass, and a session cache of
the trained cases (the plan tests read the trainers the equivalence tests built)."""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings

import flax.linen as nn
import jax
import numpy as np
import optax

import epljax as epl
from epljax.pipeline import PipelineWarning
from helpers import TOL, assert_trees_close, classification_batch, linen_fns, reference_run


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


def adamw():
  return optax.adamw(1e-2, weight_decay=1e-2)


def sgd_clipped():
  return optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.1, momentum=0.9))


BACKWARD = {"pipeline.strategy": "PreferBackward"}
FORWARD = {"pipeline.strategy": "PreferForward"}

# name: (config, model, rows, (replicas, stages, model axis), optimizer, distinct stage functions)
CASES = {
    # Heterogeneous stages from named scopes, 4 nested data-parallel replicas.
    "scopes_2_stages_1f1b": ({**BACKWARD, "pipeline.num_micro_batch": 4}, TwoStages(), 64,
                             (4, 2, 1), adamw, 2),
    "scopes_2_stages_gpipe": ({**FORWARD, "pipeline.num_micro_batch": 4}, TwoStages(), 64,
                              (4, 2, 1), adamw, 2),
    # Identical stages from set_default_strategy calls (EPL's BERT example): the two middle
    # stages share one branch of the switch. Global-norm clipping is exact on packed buffers.
    "stack_4_stages_1f1b": ({**BACKWARD, "pipeline.num_micro_batch": 8}, Stack(stages=4), 64,
                            (2, 4, 1), adamw, 3),
    "stack_4_stages_gpipe": ({**FORWARD, "pipeline.num_micro_batch": 6},
                             Stack(stages=4, layers=2), 48, (2, 4, 1), sgd_clipped, 3),
    # replicate(2) stages: each micro batch split over the stage's 2 devices.
    "replicate_2_per_stage": ({**BACKWARD, "pipeline.num_micro_batch": 4},
                              Stack(stages=2, device_count=2), 32, (2, 2, 2), adamw, 2),
}


class _Compiles(logging.Handler):
  def __init__(self):
    super().__init__(logging.WARNING)
    self.seen: list[str] = []

  def emit(self, record):
    if record.getMessage().startswith("Compiling"):
      self.seen.append(record.getMessage())


@contextlib.contextmanager
def count_compiles():
  handler = _Compiles()
  logger = logging.getLogger("jax")
  logger.addHandler(handler)
  try:
    with jax.log_compiles():
      yield handler.seen
  finally:
    logger.removeHandler(handler)


def check_matches_reference(model: nn.Module | None, batch, optimizer, *, steps: int = 2,
                            tol=TOL, fns=None):
  """Loss, gradients, parameters after ``steps`` equal single-device training; one compile of
  the step; shardings and dtypes kept. Returns the trainer and its final state. ``fns``:
  ``(init_fn, loss_fn)`` instead of a Linen classifier ``model``."""
  init_fn, loss_fn = fns or linen_fns(model)
  trainer = epl.Trainer(init_fn, loss_fn, optimizer)
  state = trainer.init(jax.random.key(0), batch)
  shardings = jax.tree.map(lambda x: x.sharding, state)
  dtypes = jax.tree.map(lambda x: x.dtype, state)
  history, expected = reference_run(init_fn, loss_fn, optimizer, jax.random.key(0), batch, steps)
  loss0, grads0 = trainer.loss_and_grads(state, batch)
  np.testing.assert_allclose(loss0, history[0][0], **tol)
  assert_trees_close(grads0, history[0][1], tol)
  with count_compiles() as compiles:
    for step in range(steps):
      state, metrics = trainer.train_step(state, batch)
      np.testing.assert_allclose(metrics["loss"], history[step][0], **tol)
  steps_compiled = [c for c in compiles if "epl_step" in c]
  assert len(steps_compiled) == 1, steps_compiled
  assert_trees_close(trainer.variables(state), expected, tol)
  assert jax.tree.map(lambda x: x.sharding, state) == shardings
  assert jax.tree.map(lambda x: x.dtype, state) == dtypes
  return trainer, state


@functools.cache
def run_case(name: str):
  """Trains case ``name`` against the reference once per session: (trainer, final state)."""
  config, model, rows, _, optimizer, _ = CASES[name]
  epl.init(config)
  with warnings.catch_warnings():
    warnings.simplefilter("error", PipelineWarning)   # enough micro batches: no warning
    return check_matches_reference(model, classification_batch(rows), optimizer())
