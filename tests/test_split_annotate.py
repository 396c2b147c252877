"""Annotations that compose: several rules sharing one strategy (or equal strategies), a
parameter owned by the task graph whose own code uses it, module-path rules under lifted
transforms; and the split rules' errors for ambiguous or disagreeing weights."""

import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import epljax as epl
from helpers import TOL, assert_trees_close, cross_entropy, reference_run
from models import ZOO

COLOCATE = {"cluster.colocate_split_and_replicate": True}


def init_trainer(init_fn, loss_fn, batch, optimizer=None):
  trainer = epl.Trainer(init_fn, loss_fn, optimizer or optax.sgd(0.1))
  return trainer, trainer.init(jax.random.key(0), batch)


def layer_specs(trainer):
  return {leaf.path: leaf.spec for leaf in trainer.plan.leaves if "/layer_" in leaf.path}


@pytest.fixture(scope="module")
def gemma_one_rule_specs():
  zoo = ZOO["gemma"]
  epl.init()
  epl.annotate(zoo.annotate_rules(2))
  trainer, _ = init_trainer(zoo.init_fn, zoo.loss_fn, zoo.make_batch(8))
  return layer_specs(trainer)


@pytest.mark.parametrize("shared", [True, False], ids=["one strategy", "equal strategies"])
def test_rules_with_equal_strategies_are_one_task_graph(gemma_one_rule_specs, shared):
  """The issue's rules: attention and MLP each matched by its own rule; the embedding, used
  outside both, no longer belongs to "two task graphs"."""
  zoo = ZOO["gemma"]
  strategy = epl.split(2)
  epl.annotate({r"Gemma/layer_\d+/attn": strategy,
                r"Gemma/layer_\d+/mlp": strategy if shared else epl.split(2)})
  trainer, _ = init_trainer(zoo.init_fn, zoo.loss_fn, zoo.make_batch(8))
  assert [(t.strategy, t.device_count) for t in trainer.plan.taskgraphs] == [("split", 2)]
  assert layer_specs(trainer) == gemma_one_rule_specs
  assert {leaf.path: leaf.spec for leaf in trainer.plan.leaves}[
      "params/embedder/input_embedding"] == P()   # outside every rule: not split


class Tied(nn.Module):
  """``w`` is used inside the annotated encoder and again, transposed, by code outside every
  rule that joins the decoder's task graph by data flow."""

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.normal(0.3), (16, 32))
    with epl.split(2, name="enc"):
      h = nn.relu(x @ w)
    with epl.replicate(2, name="dec"):
      h = nn.relu(nn.Dense(32)(h))
    return h @ w.T


def test_a_parameter_belongs_to_the_task_graph_whose_own_code_uses_it():
  epl.init(COLOCATE)
  model = Tied()
  batch = {"x": np.random.default_rng(0).normal(size=(16, 16)).astype(np.float32)}
  loss = lambda v, b: jnp.mean((model.apply(v, b["x"]) - b["x"]) ** 2)  # noqa: E731
  trainer, _ = init_trainer(lambda r, b: model.init(r, b["x"]), loss, batch)
  owner = {leaf.path: leaf.taskgraph for leaf in trainer.plan.leaves}
  assert owner["params/w"] == "enc" and owner["params/Dense_0/kernel"] == "dec"


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    h = nn.gelu(nn.Dense(32, name="wi")(x))
    return x + nn.Dense(16, name="wo")(h), None


class Lifted(nn.Module):
  """Layers under ``nn.scan`` (rematerialized) and two heads under ``nn.vmap``."""

  @nn.compact
  def __call__(self, x):
    scan = nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True},
                   length=3)
    x, _ = scan(name="layers")(x, None)
    heads = nn.vmap(nn.Dense, in_axes=None, out_axes=0, variable_axes={"params": 0},
                    split_rngs={"params": True}, axis_size=2)
    return nn.Dense(10, name="out")(nn.relu(heads(32, name="heads")(x).mean(0)))


def test_module_rules_reach_modules_under_scan_remat_and_vmap():
  model = Lifted()
  rng = np.random.default_rng(0)
  batch = {"x": rng.normal(size=(16, 16)).astype(np.float32),
           "y": rng.integers(0, 10, 16).astype(np.int32)}
  init_fn = lambda r, b: model.init(r, b["x"])  # noqa: E731
  loss_fn = lambda v, b: cross_entropy(model.apply(v, b["x"]), b["y"])  # noqa: E731
  history, expected = reference_run(init_fn, loss_fn, optax.sgd(0.1), jax.random.key(0),
                                    batch, 1)
  epl.annotate({"Lifted/layers/(wi|wo)": epl.split(2), "Lifted/hedas": epl.split(2)})
  with pytest.warns(UserWarning, match=r"'Lifted/hedas' matches no module path .* look like "
                    r"'Lifted', 'Lifted/heads', 'Lifted/layers', 'Lifted/out'"):
    trainer, state = init_trainer(init_fn, loss_fn, batch)
  specs = trainer.plan.param_specs["params"]
  assert specs["layers"]["wi"]["kernel"] == P(None, None, "model")   # (layers, in, hidden)
  assert specs["layers"]["wi"]["bias"] == P(None, "model")
  assert specs["layers"]["wo"]["kernel"] == P(None, "model", None)   # row
  state, metrics = trainer.train_step(state, batch)
  np.testing.assert_allclose(metrics["loss"], history[0][0], **TOL)
  assert_trees_close(trainer.variables(state), expected, TOL)

  epl.init()
  epl.annotate({"Lifted/heads": epl.split(2)})   # the path without vmap's transform entry
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    trainer, state = init_trainer(init_fn, loss_fn, batch)
  specs = trainer.plan.param_specs["params"]
  assert specs["heads"]["kernel"] == P(None, None, "model")   # (heads, in, features): column
  assert specs["out"]["kernel"] == P()
  state, metrics = trainer.train_step(state, batch)
  np.testing.assert_allclose(metrics["loss"], history[0][0], **TOL)
  assert_trees_close(trainer.variables(state), expected, TOL)


class TwoWays(nn.Module):
  """A kernel whose two output dimensions both reach the next weight whole."""

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.normal(0.3), (16, 4, 8))
    v = self.param("v", nn.initializers.normal(0.3), (4, 8, 10))
    with epl.split(2):
      return jnp.einsum("bxy,xyo->bo", nn.relu(jnp.einsum("bd,dxy->bxy", x, w)), v)


class Disagree(nn.Module):
  """One square weight used twice: first column-split, then against its own split output."""

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.normal(0.3), (16, 16))
    with epl.split(2):
      return nn.relu(nn.relu(x @ w) @ w)[:, :10]


@pytest.mark.parametrize("model, message", [
    (TwoWays(), r"Parameter 'params/w' \(shape \(16, 4, 8\)\) of a split\(2\) task graph is "
                r"used at equation \d+ \(dot_general in .*\) against an unsplit activation, "
                r"and several of its dimensions could carry the split, followed through the "
                r"program:\n  dimension 1 \(size 4\): 1 path\(s\) end at a weight \(row "
                r"split\)\n  dimension 2 \(size 8\): 1 path\(s\) end at a weight.*\nGive it "
                r"an explicit PartitionSpec with epl.annotate\(\{'params/w': P\(...\)\}\)"),
    (Disagree(), r"Parameter 'params/w' \(shape \(16, 16\)\) of a split\(2\) task graph is "
                 r"split on dimension 1 \(column\) by its first use, but a later use "
                 r"\(equation \d+, dot_general in .*\) contracts it against an activation "
                 r"split on what is its dimension 0\. The uses disagree"),
], ids=["ambiguous", "disagreeing uses"])
def test_weights_the_split_rules_cannot_decide_are_errors(model, message):
  rng = np.random.default_rng(0)
  batch = {"x": rng.normal(size=(8, 16)).astype(np.float32),
           "y": rng.integers(0, 10, 8).astype(np.int32)}
  trainer = epl.Trainer(lambda r, b: model.init(r, b["x"]),
                        lambda v, b: cross_entropy(model.apply(v, b["x"]), b["y"]),
                        optax.sgd(0.1))
  with pytest.raises(epl.PlanError, match=re.compile(message, re.S)):
    trainer.init(jax.random.key(0), batch)
