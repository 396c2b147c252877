"""Single-device references and small models shared by the tests."""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
import optax
from flax.core import meta

import epljax as epl

TOL = dict(rtol=1e-5, atol=1e-5)       # float32, shallow models
DEEP_TOL = dict(rtol=1e-4, atol=1e-4)  # float32, deep models


def assert_trees_close(actual, expected, tol=TOL):
  a_leaves, a_def = jax.tree.flatten(actual)
  e_leaves, e_def = jax.tree.flatten(expected)
  assert a_def == e_def, f"structures differ:\n{a_def}\n{e_def}"
  for path_leaf, a, e in zip(jax.tree_util.tree_flatten_with_path(expected)[0], a_leaves,
                             e_leaves):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), err_msg=jax.tree_util.keystr(
        path_leaf[0]), **tol)


def classification_batch(rows: int, features: int = 20, classes: int = 10, seed: int = 0):
  rng = np.random.default_rng(seed)
  return {"x": rng.normal(size=(rows, features)).astype(np.float32),
          "y": rng.integers(0, classes, rows).astype(np.int32)}


class MLP(nn.Module):
  """EPL's quick-start model (Dense 2 -> Dense 10), widened so gradients are not tiny."""
  hidden: int = 16
  classes: int = 10
  scope: str | None = None   # None, "replicate" (a scope inside the module)

  @nn.compact
  def __call__(self, x):
    if self.scope == "replicate":
      with epl.replicate(1):
        h = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(self.classes)(h)
    h = nn.relu(nn.Dense(self.hidden)(x))
    return nn.Dense(self.classes)(h)


def cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def linen_fns(model: nn.Module):
  def init_fn(rng, batch):
    return model.init(rng, batch["x"])

  def loss_fn(variables, batch):
    return cross_entropy(model.apply(variables, batch["x"]), batch["y"])

  return init_fn, loss_fn


def reference_run(init_fn, loss_fn, optimizer, rng, batch, steps, *, micro_batches=1):
  """Plain single-device training on the whole batch: [(loss, grads)], final variables.

  With ``micro_batches`` > 1 the gradient is averaged over equal contiguous chunks, which for a
  mean loss equals the big-batch gradient.
  """
  first = jax.tree.map(lambda x: x[: len(x) // micro_batches], batch)
  variables = meta.unbox(jax.jit(init_fn)(rng, first))   # Flax partitioning boxes removed
  params = variables["params"]
  opt_state = optimizer.init(params)

  @jax.jit
  def step(params, opt_state):
    loss, grads = jax.value_and_grad(lambda p: loss_fn({**variables, "params": p}, batch))(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return loss, grads, optax.apply_updates(params, updates), opt_state

  history = []
  for _ in range(steps):
    loss, grads, params, opt_state = step(params, opt_state)
    history.append((loss, grads))
  return history, {**variables, "params": params}
