"""Two easy mistakes that used to change nothing without a word: ``epl.init(new_config)`` after
a Trainer was made, and strategy scopes written outside the traced computation."""

import warnings

import flax.linen as nn
import jax
import optax
import pytest

import epljax as epl
from helpers import MLP, classification_batch, linen_fns

BATCH = classification_batch(16)


def _trainer(model=None):
  init_fn, loss_fn = linen_fns(model or MLP())
  return epl.Trainer(init_fn, loss_fn, optax.sgd(0.1))


def test_init_with_a_new_config_after_a_trainer_was_made_warns_with_the_fix():
  trainer = _trainer()
  epl.init({"pipeline.num_micro_batch": 2})
  with pytest.warns(UserWarning, match=r"(?s)This Trainer was made before the last "
                    r"epl.init\(...\), which changed the configuration "
                    r"\(pipeline.num_micro_batch: 1 -> 2\).*Make a new\nTrainer after "
                    r"epl.init\(new_config\)") as caught:
    state = trainer.init(jax.random.key(0), BATCH)
  assert caught[0].filename == __file__                      # points at the user's call
  assert trainer.plan.num_replicas == 8                      # indeed the old config: 1 micro
  with warnings.catch_warnings():
    warnings.simplefilter("error")                           # once per epl.init
    state, _ = trainer.train_step(state, BATCH)
  epl.init({"pipeline.num_micro_batch": 4})
  with pytest.warns(UserWarning, match=r"pipeline.num_micro_batch: 1 -> 4"):
    trainer.train_step(state, BATCH)


def test_init_again_with_the_same_config_says_nothing():
  trainer = _trainer()
  state = trainer.init(jax.random.key(0), BATCH)
  epl.init()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    trainer.train_step(state, BATCH)


class _Scoped(nn.Module):
  @nn.compact
  def __call__(self, x):
    with epl.split(8):
      return nn.Dense(8)(nn.relu(nn.Dense(16)(x)))


OUTSIDE = (r"(?s)The strategy scope\(s\) epl.split\(8\) at test_no_silent_acceptance.py:\d+ "
           r"were entered outside the traced computation.*trains as plain data parallelism.*"
           r"in the model's __call__ or in loss_fn")


def test_a_scope_around_trainer_init_warns_where_scopes_go():
  trainer = _trainer()
  with pytest.warns(UserWarning, match=OUTSIDE) as caught:
    with epl.split(8):
      trainer.init(jax.random.key(0), BATCH)
  assert caught[0].filename == __file__
  assert [t.strategy for t in trainer.plan.taskgraphs] == ["replicate"]   # what it warned of


def test_a_scope_around_module_construction_warns_where_scopes_go():
  with epl.split(8):
    model = MLP()
  trainer = _trainer(model)
  with pytest.warns(UserWarning, match=OUTSIDE):
    trainer.init(jax.random.key(0), BATCH)


def test_scopes_in_the_forward_pass_say_nothing_even_after_an_eager_call():
  model = _Scoped()
  model.init(jax.random.key(0), BATCH["x"])        # eager: its scopes run outside a trace
  trainer = _trainer(model)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    trainer.init(jax.random.key(0), BATCH)
  assert [t.strategy for t in trainer.plan.taskgraphs] == ["split"]
