"""Grouped apply: the same update in N groups, one after another, with a lower peak."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import epljax as epl
from epljax.memory.grouped import balanced_groups
from helpers import MLP, TOL, assert_trees_close, classification_batch, linen_fns, reference_run

LEAVES, ROWS, COLS = 8, 256, 64


def precondition():
  """A toy preconditioner with a (rows, rows) temporary per parameter, as Shampoo-like
  optimizers have."""
  def update(g, state, params=None):
    return jax.tree.map(lambda x: (x @ x.T) @ x * 1e-3, g), state
  return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def init_fn(rng, batch):
  keys = jax.random.split(rng, LEAVES)
  return {f"w{i}": jax.random.normal(k, (ROWS, COLS)) * 0.05 for i, k in enumerate(keys)}


def loss_fn(params, batch):
  x = batch["x"] @ jnp.full((20, ROWS), 0.1)
  for i in range(LEAVES):
    x = jnp.tanh(x @ params[f"w{i}"]) @ jnp.full((COLS, ROWS), 0.1)
  return jnp.mean(x ** 2)


def test_balanced_groups():
  assert balanced_groups([10, 1, 1, 8, 2], 2) == [0, 0, 1, 1, 1]     # 11 and 11 bytes
  assert balanced_groups([4, 4, 4, 4], 4) == [0, 1, 2, 3]
  assert balanced_groups([5, 5], 8) == [0, 1]


def test_groups_give_the_same_result_with_a_lower_peak():
  batch = classification_batch(64)
  optimizer = optax.chain(precondition(), optax.adam(1e-2))
  params = init_fn(jax.random.key(0), batch)
  opt_state = optimizer.init(params)
  for _ in range(2):
    grads = jax.grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  temps = {}
  for groups in (1, 4):
    epl.init({"optimizer.num_apply_group": groups})
    trainer = epl.Trainer(init_fn, loss_fn, optimizer)
    state = trainer.init(jax.random.key(0), batch)
    for _ in range(2):
      state, _ = trainer.train_step(state, batch)
    assert_trees_close(trainer.variables(state), params)
    temps[groups] = trainer.plan.memory.temp_size_in_bytes
  assert temps[4] < 0.6 * temps[1], temps
  assert any("optimizer update applied in 4 size-balanced groups" in f
             for f in trainer.plan.features)


def test_what_couples_all_parameters_still_sees_them_all():
  """A global-norm clip and Adam's step count feed every group: they run once, first."""
  init, loss = linen_fns(MLP(hidden=64, classes=16))
  batch = classification_batch(64, classes=16)
  optimizer = lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-2))  # noqa
  history, expected = reference_run(init, loss, optimizer(), jax.random.key(0), batch, 2)
  epl.init({"optimizer.num_apply_group": 3})
  trainer = epl.Trainer(init, loss, optimizer())
  state = trainer.init(jax.random.key(0), batch)
  for step in range(2):
    state, metrics = trainer.train_step(state, batch)
    np.testing.assert_allclose(metrics["loss"], history[step][0], **TOL)
  assert_trees_close(trainer.variables(state), expected)


def test_invalid_group_count():
  with pytest.raises(epl.ConfigError, match=r"'optimizer.num_apply_group' .* must be >= 1"):
    epl.Config({"optimizer.num_apply_group": 0})
