"""An init_fn that returns something other than the variables is named where the Trainer first
calls it (epljax/init_result.py), instead of a TypeError from inside JAX's tracing."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import epljax as epl
from epljax import init_result

MODEL = nn.Dense(2)
BATCH = {"x": jnp.ones((8, 3)), "y": jnp.ones((8, 2))}


def _loss(variables, batch):
  return jnp.mean((MODEL.apply(variables, batch["x"]) - batch["y"]) ** 2)


def _init(init_fn):
  return epl.Trainer(init_fn, _loss, optax.sgd(0.1)).init(jax.random.key(0), BATCH)


def test_an_init_fn_that_returns_none_is_told_to_return_the_variables():
  def init_fn(key, batch):
    MODEL.init(key, batch["x"])           # no return

  with pytest.raises(epl.PlanError, match=r"(?s)init_fn returned None\. It must return the "
                     r"variables.*lambda key, batch: model\.init\(key, batch\['x'\]\)"):
    _init(init_fn)


def test_an_init_fn_that_returns_the_model_beside_its_variables_is_told_to_return_them_alone():
  with pytest.raises(epl.PlanError, match=r"(?s)init_fn returned a tuple \(Module Dense, dict\): "
                     r"return only the variables, e.g\..*model\.init\(key, batch\['x'\]\)"):
    _init(lambda key, batch: (MODEL, MODEL.init(key, batch["x"])))


def test_an_init_fn_that_returns_the_linen_module_or_a_non_array_leaf_is_named():
  with pytest.raises(epl.PlanError, match="the Flax module Dense itself, not its variables"):
    _init(lambda key, batch: MODEL)
  with pytest.raises(epl.PlanError, match=r"returned a str at \['params'\]\['name'\]"):
    _init(lambda key, batch: {"params": {**MODEL.init(key, batch["x"])["params"], "name": "a"}})


def test_what_init_fn_may_return_passes_the_check():
  variables = MODEL.init(jax.random.key(0), BATCH["x"])
  assert init_result.mistake_in(variables) is None
  assert init_result.mistake_in(nnx.Linear(3, 2, rngs=nnx.Rngs(0))) is None
  assert init_result.mistake_in((jnp.ones(2), {"b": 1.0})) is None     # a plain pytree
  state = _init(lambda key, batch: MODEL.init(key, batch["x"]))          # the wrapper passes
  assert jax.tree.map(jnp.shape, state.params) == jax.tree.map(jnp.shape, variables["params"])
