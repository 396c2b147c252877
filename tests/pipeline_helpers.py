"""Pipelined models of the tests, the cases every pipeline must pass, and a session cache of
the trained cases (the plan tests read the trainers the equivalence tests built)."""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.core import meta

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
    # The same under ZeRO v1: each stage's optimizer state sharded over its 4 replicas.
    "scopes_2_stages_gpipe_zero_v1": ({**FORWARD, "pipeline.num_micro_batch": 4,
                                       "zero.level": "v1"}, TwoStages(), 64, (4, 2, 1), adamw,
                                      2),
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


class StepGrads(NamedTuple):
  """What ``keeping_grads`` adds to an optimizer's state: the gradient of the last step."""
  step_grads: Any


class WithStepGrads(NamedTuple):
  """``keeping_grads``'s state around an optimizer state that is not a plain tuple."""
  inner: Any
  record: StepGrads


def keeping_grads(optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
  """``optimizer`` whose state also keeps the gradient each update was given (``StepGrads``,
  last; after the optimizer's own states when they are a plain tuple, as optax's chains are,
  so that their indices are unchanged). The updates are the optimizer's: training is the same,
  and after the first step the state holds that step's gradient, which the tests read instead
  of compiling ``trainer.loss_and_grads`` as well."""
  def wrap(inner, grads):
    record = StepGrads(grads)
    return (*inner, record) if type(inner) is tuple else WithStepGrads(inner, record)

  def init(params):
    return wrap(optimizer.init(params), jax.tree.map(jnp.zeros_like, params))

  def update(updates, state, params=None):
    inner = state.inner if isinstance(state, WithStepGrads) else state[:-1]
    new_updates, inner = optimizer.update(updates, inner, params)
    return new_updates, wrap(inner, updates)

  return optax.GradientTransformation(init, update)


def step_grads(trainer, state):
  """The gradient of the step that made ``state`` (a ``keeping_grads`` optimizer's record), in
  the user's structure and order."""
  opt_state = trainer._require().to_user(state)["opt_state"]
  return meta.unbox(opt_state[-1].step_grads)


def check_matches_reference(model: nn.Module | None, batch, optimizer, *, steps: int = 2,
                            tol=TOL, fns=None):
  """Loss, gradients, parameters after ``steps`` equal single-device training; one compile of
  the step; shardings and dtypes kept. Returns the trainer and its final state. ``fns``:
  ``(init_fn, loss_fn)`` instead of a Linen classifier ``model``.

  The first step's gradient is read from the state (``keeping_grads``) rather than from
  ``trainer.loss_and_grads``, which would compile a second program as large as the step; the
  pipelines' ``loss_and_grads`` has tests of its own (test_pipeline.py, test_pipeline_plan.py,
  test_pipeline_state.py, test_pipeline_example.py)."""
  init_fn, loss_fn = fns or linen_fns(model)
  trainer = epl.Trainer(init_fn, loss_fn, keeping_grads(optimizer))
  state = trainer.init(jax.random.key(0), batch)
  shardings = jax.tree.map(lambda x: x.sharding, state)
  dtypes = jax.tree.map(lambda x: x.dtype, state)
  history, expected = reference_run(init_fn, loss_fn, optimizer, jax.random.key(0), batch, steps)
  with count_compiles() as compiles:
    for step in range(steps):
      state, metrics = trainer.train_step(state, batch)
      np.testing.assert_allclose(metrics["loss"], history[step][0], **tol)
      if step == 0:   # before the next step donates the state
        assert_trees_close(step_grads(trainer, state), history[0][1], tol)
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
