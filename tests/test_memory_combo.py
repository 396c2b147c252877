"""The memory features together: GC + ZeRO + AMP (EPL's T5 recipe), and everything at once."""

import jax
import numpy as np
import optax
import pytest

import epljax as epl
from epljax import hlo
from helpers import MLP, classification_batch, linen_fns, momentum_grads, reference_run
from memory_models import deep_reference, deep_run
from test_memory_amp import LOSS_RTOL, assert_close_in_bf16

GC_ZERO_AMP = {"gradient_checkpoint.type": "auto", "zero.level": "v1", "amp.level": "O1"}


def optimizer():
  return optax.sgd(0.1, momentum=0.9)


def train(config, init_fn, loss_fn, batch, steps=2):
  epl.init(config)
  trainer = epl.Trainer(init_fn, loss_fn, optimizer())
  state = trainer.init(jax.random.key(0), batch)
  losses = []
  for step in range(steps):
    state, metrics = trainer.train_step(state, batch)
    losses.append(metrics["loss"])
    if step == 0:   # (loss, gradient) of the first step, from SGD's momentum trace
      grads = metrics["loss"], jax.device_get(momentum_grads(trainer, state))
  return trainer, state, grads, losses


@pytest.fixture(scope="module")
def deep():
  """The reference and the plain run are memory_models' session cache (shared with
  test_memory_remat)."""
  return deep_reference(), {"none": deep_run("none", {}),
                            "combo": deep_run("gc_zero_amp", GC_ZERO_AMP)}


def check(run, reference):
  (history, expected), (trainer, state, (loss0, grads0), losses) = reference, run
  np.testing.assert_allclose(loss0, history[0][0], rtol=LOSS_RTOL)
  assert_close_in_bf16(grads0, history[0][1])
  for step in range(2):
    np.testing.assert_allclose(losses[step], history[step][0], rtol=LOSS_RTOL)
  assert_close_in_bf16(jax.tree.map(np.asarray, trainer.variables(state)), expected)


@pytest.mark.slow
def test_gc_zero_amp_matches_the_reference_with_far_less_memory(deep):
  reference, runs = deep
  check(runs["combo"], reference)
  plain, combo = runs["none"][0].plan, runs["combo"][0].plan
  total = lambda plan: (plan.memory.argument_size_in_bytes  # noqa: E731
                        + plan.memory.temp_size_in_bytes)
  assert total(combo) < 0.5 * total(plain)          # EPL reports 2.6x on T5
  assert combo.memory.argument_size_in_bytes < 0.75 * plain.memory.argument_size_in_bytes
  assert combo.activation_bytes < 0.5 * plain.activation_bytes
  assert "reduce-scatter" in hlo.summarize(combo.collectives)
  text = str(combo)
  for part in ["parameters", "gradients", "optimizer state", "activations",
               "ZeRO v1", "mixed precision O1",
               "gradient checkpointing (auto: 13 segments cut where little is live"]:
    assert part in text, part


def test_every_memory_feature_at_once():
  init_fn, loss_fn = linen_fns(MLP(hidden=64, classes=16))
  batch = classification_batch(64, classes=16)
  reference = reference_run(init_fn, loss_fn, optimizer(), jax.random.key(0), batch, 2)
  config = {"gradient_checkpoint.type": "auto", "zero.level": "v3", "amp.level": "O1",
            "offload.level": "v1", "optimizer.num_apply_group": 2}
  run = train(config, init_fn, loss_fn, batch)
  check(run, reference)
  trainer, state = run[0], run[1]
  assert {x.sharding.memory_kind for x in jax.tree.leaves(state.params)} == {"pinned_host"}
  plan = trainer.plan
  full = sum(int(np.prod(leaf.shape)) * 4 for leaf in plan.leaves)
  assert plan.param_bytes * 8 == full                       # ZeRO v3: 1/8 of each leaf
  assert plan.placement == {"parameters": "host (pinned_host)",
                            "gradients": "host (pinned_host)",
                            "optimizer state": "host (pinned_host)", "model state": "device"}


def test_memory_features_inside_the_per_replica_gradient_of_communication_fp16():
  """communication.fp16 computes each replica's gradient in a shard_map over data: the
  forward hooks run there, and ZeRO leaves the reduction to it (then keeps its shard)."""
  init_fn, loss_fn = linen_fns(MLP(hidden=64, classes=16))
  batch = classification_batch(64, classes=16)
  history, expected = reference_run(init_fn, loss_fn, optimizer(), jax.random.key(0), batch, 2)
  config = {"communication.fp16": True, "gradient_checkpoint.type": "auto", "zero.level": "v1",
            "offload.level": "v0"}
  trainer, state, (loss0, grads0), losses = train(config, init_fn, loss_fn, batch)
  tol = dict(rtol=1e-3, atol=1e-4)      # float16 all-reduce
  np.testing.assert_allclose(loss0, history[0][0], **tol)
  for step in range(2):
    np.testing.assert_allclose(losses[step], history[step][0], **tol)
  for a, e in zip(jax.tree.leaves(trainer.variables(state)), jax.tree.leaves(expected)):
    np.testing.assert_allclose(np.asarray(a), e, **tol)
