"""Context parallelism (``context.parallel_degree``): the zoo's sequence models, their attention
through ``epl.nn.dot_product_attention``, trained with each sequence split over a ``context``
mesh axis against single-device training on the same global batch (the losses of both steps,
the first step's gradients, the parameters after both; the zoo's tolerances), alone and with
the other strategies; errors for what does not divide or combine.

Each cell runs on one of CI's two jax versions (``helpers.on_one_jax``, as the zoo's); the
single-device references are shared by the cells of a model.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from flax.core import meta

import epljax as epl
from epljax.mesh import CONTEXT
from helpers import DEEP_TOL, TOL, assert_trees_close, on_one_jax, reference_run
from models import common, llama

ROWS = 8
STEPS = 2


@dataclasses.dataclass(frozen=True)
class SeqModel:
  """A zoo model with its attention through ``epl.nn.dot_product_attention``."""
  name: str
  fns: tuple
  make_batch: object
  logical_rules: tuple | None = None
  tol: dict = dataclasses.field(default_factory=lambda: TOL)
  annotate: str = ""          # module path a user splits over ``model`` (heads)


def _models() -> dict[str, SeqModel]:
  size = dataclasses.replace(llama.SMALL, attention="epl")
  return {
      "llama": SeqModel("llama", llama.fns(size),
                        lambda rows: common.token_batch(rows, 16, llama.VOCAB),
                        llama.LOGICAL_RULES, DEEP_TOL, llama.ANNOTATE),
  }


MODELS = _models()

# (model, cell) -> its config; a cell's name says the mesh on 8 devices.
CELLS = {
    "context2": {"context.parallel_degree": 2},                        # data 4 x context 2
    "context4": {"context.parallel_degree": 4},                        # data 2 x context 4
    "context8": {"context.parallel_degree": 8},                        # context 8
    "split_context2": {"context.parallel_degree": 2},                  # + model 2 (heads)
    "zero_v3_context2": {"context.parallel_degree": 2, "zero.level": "v3"},
}


def cells():
  out = []
  for i, (name, cell) in enumerate((m, c) for m in MODELS for c in CELLS):
    out.append(pytest.param(name, cell, id=f"{name}-{cell}", marks=on_one_jax(i)))
  return out


def optimizer():
  return optax.sgd(0.1, momentum=0.9)


_REFERENCES: dict[str, tuple] = {}


def initial_and_reference(model: SeqModel):
  """The model's variables made on one device and single-device training from them, once."""
  if model.name not in _REFERENCES:
    init_fn, loss_fn = model.fns
    batch = model.make_batch(ROWS)
    variables = meta.unbox(jax.jit(init_fn)(jax.random.key(0), batch))
    _REFERENCES[model.name] = variables, reference_run(
        init_fn, loss_fn, optimizer(), jax.random.key(0), batch, STEPS, variables=variables)
  return _REFERENCES[model.name]


def rules(model: SeqModel):
  return nn.logical_axis_rules(model.logical_rules or ())


def train_cell(model: SeqModel, config: dict, annotate: dict | None = None):
  """Trains ``model`` 2 steps under ``config``; returns (trainer, [(loss, grads)], variables)."""
  variables, _ = initial_and_reference(model)
  batch = model.make_batch(ROWS)
  epl.init(config)
  if annotate:
    epl.annotate(annotate)
  init_fn, loss_fn = model.fns
  with rules(model):
    trainer = epl.Trainer(init_fn, loss_fn, optimizer())
    state = trainer.init(jax.random.key(0), batch, variables=variables)
    history = []
    for _ in range(STEPS):
      state, metrics = trainer.train_step(state, batch)
      opt_state = trainer._require().to_user(state)["opt_state"]
      grads = meta.unbox(optax.tree_utils.tree_get(opt_state, "trace"))
      history.append((float(metrics["loss"]), jax.tree.map(np.asarray, grads)))
    return trainer, history, meta.unbox(trainer.variables(state))


def check_against_reference(model: SeqModel, history, variables):
  _, (expected_history, expected) = initial_and_reference(model)
  for (loss, _), (ref_loss, _) in zip(history, expected_history):
    np.testing.assert_allclose(loss, ref_loss, **model.tol)
  # After the first step SGD's momentum trace is that step's gradient exactly.
  assert_trees_close(history[0][1], expected_history[0][1], model.tol)
  assert_trees_close(variables, expected, model.tol)


@pytest.mark.parametrize("name, cell", cells())
def test_context_parallel_training_equals_one_device(name, cell):
  model = MODELS[name]
  config = CELLS[cell]
  annotate = {model.annotate: epl.split(2)} if cell.startswith("split") else None
  trainer, history, variables = train_cell(model, config, annotate)
  shape = dict(trainer.plan.mesh.shape)
  assert shape[CONTEXT] == config["context.parallel_degree"]
  assert shape["model"] == (2 if annotate else 1)
  check_against_reference(model, history, variables)


def test_a_sequence_that_does_not_divide_is_refused_naming_the_leaf():
  model = MODELS["llama"]
  batch = common.token_batch(ROWS, 12, llama.VOCAB)
  epl.init({"context.parallel_degree": 8})
  with rules(model), pytest.raises(epl.EPLError, match=(
      r"Batch leaf 'x' \(8, 12\): its sequence \(dimension 1\) of 12 does not divide over "
      r"context.parallel_degree=8 devices.*multiple of 8 \(for example 16\)")):
    epl.Trainer(*model.fns, optimizer()).init(jax.random.key(0), batch)


def test_pipeline_stages_are_refused_saying_what_to_change():
  model = MODELS["llama"]
  epl.init({"context.parallel_degree": 2, "auto.auto_parallel": True,
            "pipeline.num_stages": 2, "pipeline.num_micro_batch": 2})
  with rules(model), pytest.raises(epl.EPLError, match=(
      r"context.parallel_degree=2 .* does not combine with pipeline stages \(2 here.*Set "
      r"context.parallel_degree=1, or run the model without pipeline stages")):
    epl.Trainer(*model.fns, optimizer()).init(jax.random.key(0), model.make_batch(ROWS))
