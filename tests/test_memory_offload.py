"""Host offload: state in ``pinned_host`` memory, the reference's numbers.

On CPU the host memory kinds exist (``pinned_host`` is addressable), so the shardings and
arrays report them; the CPU backend has one physical memory, and ``memory_analysis`` counts
host buffers as device bytes (its ``host_*`` fields stay 0).
"""

import jax
import numpy as np
import optax
import pytest

import epljax as epl
from epljax.memory import offload
from helpers import (DEEP_TOL, MLP, TOL, assert_trees_close, classification_batch, linen_fns,
                     reference_run)

MODEL = MLP(hidden=64, classes=16)


def kinds(tree):
  return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


@pytest.fixture(scope="module")
def reference():
  epl.init()
  init_fn, loss_fn = linen_fns(MODEL)
  return reference_run(init_fn, loss_fn, optax.adam(1e-2), jax.random.key(0),
                       classification_batch(64, classes=16), 2)


def run(config):
  epl.init(config)
  init_fn, loss_fn = linen_fns(MODEL)
  batch = classification_batch(64, classes=16)
  trainer = epl.Trainer(init_fn, loss_fn, optax.adam(1e-2))
  state = trainer.init(jax.random.key(0), batch)
  placed = kinds(state.params), kinds(state.opt_state)
  losses = []
  for _ in range(2):
    state, metrics = trainer.train_step(state, batch)
    losses.append(metrics["loss"])
  assert (kinds(state.params), kinds(state.opt_state)) == placed
  return trainer, state, losses, placed


@pytest.mark.parametrize("level", ["v0", "v1"])
def test_state_lives_in_host_memory_with_the_reference_numbers(level, reference):
  history, expected = reference
  trainer, state, losses, (param_kinds, opt_kinds) = run({"offload.level": level})
  for step in range(2):
    np.testing.assert_allclose(losses[step], history[step][0], **TOL)
  assert_trees_close(jax.tree.map(np.asarray, trainer.variables(state)), expected)
  assert param_kinds == {"pinned_host"}
  assert opt_kinds == ({"pinned_host"} if level == "v1" else {"device"})
  plan = trainer.plan
  assert plan.placement["parameters"] == "host (pinned_host)"
  assert plan.placement["optimizer state"] == ("host (pinned_host)" if level == "v1"
                                               else "device")
  assert any(f.startswith(f"offload {level}: ") and f.endswith(", copied in at each use")
             for f in plan.features), plan.features
  assert "parameters at each use: copied from host memory" in plan.features
  # What the CPU backend reports: one physical memory, host bytes counted as device bytes.
  assert plan.memory.host_argument_size_in_bytes == 0
  assert "(this backend counts host buffers as device)" in str(plan)


def test_without_a_host_memory_kind_it_says_so_and_runs_on_the_device(reference, monkeypatch):
  monkeypatch.setattr(offload, "host_memory_kind", lambda device: None)
  history, expected = reference
  with pytest.warns(UserWarning, match=r"offload.level='v0': the cpu backend has no "
                    r"'pinned_host' memory, so parameters and optimizer state stay in device"):
    trainer, state, losses, (param_kinds, opt_kinds) = run({"offload.level": "v0"})
  assert param_kinds == opt_kinds == {"device"}
  np.testing.assert_allclose(losses[1], history[1][0], **TOL)
  assert_trees_close(trainer.variables(state), expected)
  assert any("offload v0: not applied, the cpu backend has no 'pinned_host' memory" in f
             for f in trainer.plan.features)


def test_invalid_level_lists_the_valid_ones():
  with pytest.raises(epl.ConfigError, match=r"'offload.level' .* must be one of '', 'v0', "
                     r"'v1'; got 'v2'"):
    epl.Config({"offload.level": "v2"})


@pytest.mark.parametrize("strategy", ["PreferBackward", "PreferForward"])
def test_with_checkpointing_inside_pipeline_stages(strategy):
  """Offloaded stage parameters under rematerialized blocks: the numbers are the reference's,
  parameters and optimizer state stay in host memory between steps, and the plan says that
  the stages read packed device buffers (not a copy per use)."""
  from pipeline_helpers import Stack
  init_fn, loss_fn = linen_fns(Stack(stages=2, layers=2))
  batch = classification_batch(32, features=16)
  history, expected = reference_run(init_fn, loss_fn, optax.adam(1e-2), jax.random.key(0),
                                    batch, 2, micro_batches=4)
  epl.init({"pipeline.num_micro_batch": 4, "pipeline.strategy": strategy,
            "offload.level": "v1", "gradient_checkpoint.type": "auto"})
  trainer = epl.Trainer(init_fn, loss_fn, optax.adam(1e-2))
  state = trainer.init(jax.random.key(0), batch)
  for step in range(2):
    state, metrics = trainer.train_step(state, batch)
    np.testing.assert_allclose(metrics["loss"], history[step][0], **TOL)
  assert_trees_close(trainer.variables(state), expected, DEEP_TOL)
  assert kinds(state.params) == kinds(state.opt_state) == {"pinned_host"}
  assert trainer.plan.num_stages == 2
  assert any(f.startswith("gradient checkpointing (auto:") for f in trainer.plan.features)
  assert "offload v1: parameters and optimizer state (updated on the host) in host memory " \
      "(pinned_host) between steps; the 2 pipeline stages read theirs from device buffers " \
      "packed once per step, not copied in at each use" in trainer.plan.features
  assert not any("copied from host memory" in f for f in trainer.plan.features)


@pytest.mark.parametrize("config", [{"offload.level": "v0"},
                                    {"offload.level": "v1", "zero.level": "v2"}])
def test_with_gradient_accumulation(config):
  """The gradients of host parameters are host values; their sum over micro batches is kept
  in device memory, and the numbers are the big batch's."""
  init_fn, loss_fn = linen_fns(MODEL)
  batch = classification_batch(64, classes=16)
  history, expected = reference_run(init_fn, loss_fn, optax.adam(1e-2), jax.random.key(0),
                                    batch, 2, micro_batches=2)
  trainer, state, losses, (param_kinds, _) = run({"pipeline.num_micro_batch": 2, **config})
  for step in range(2):
    np.testing.assert_allclose(losses[step], history[step][0], **TOL)
  assert_trees_close(trainer.variables(state), expected)
  assert param_kinds == {"pinned_host"}
