"""Split rules on real weight layouts (the zoo's Gemma-, GPT-2- and Llama-style models split
with one ``epl.annotate`` rule): Megatron's specs, equality with the single-device reference,
and the collectives of the compiled step against Megatron's minimum (``bench/comm.py``)."""

import os
import sys

import jax
import numpy as np
import optax
import pytest

from epljax import hlo
from helpers import (DEEP_TOL, TOL, assert_trees_close, each_on_one_jax, momentum_grads,
                     reference_run)
from models import ZOO

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import comm  # noqa: E402

STEPS = 2


@pytest.fixture(scope="module", params=each_on_one_jax(["gemma", "gpt2", "llama"]))
def split_run(request):
  """A zoo model split over 2 devices (4 replicas) by its one annotate rule, trained two steps
  beside the single-device reference; its forward and step HLO collectives."""
  name = request.param
  zoo = ZOO[name]
  # SGD's momentum: its trace after the first step is that step's gradient, checked here
  # without compiling loss_and_grads as well.
  optimizer = optax.sgd(0.1, momentum=0.9)
  trainer, state, batch = comm.zoo_split(name, optimizer=optimizer)
  tol = DEEP_TOL if zoo.deep else TOL
  history, expected = reference_run(zoo.init_fn, zoo.loss_fn, optimizer, jax.random.key(0),
                                    batch, STEPS)
  # Collectives inside loops (Llama's nn.scan) count once per iteration.
  forward = hlo.executed_collectives(trainer.lower_loss(state, batch).compile().as_text())
  step = hlo.executed_collectives(trainer.lower(state, batch).compile().as_text())
  losses = []
  for i in range(STEPS):
    state, metrics = trainer.train_step(state, batch)
    losses.append(metrics["loss"])
    if i == 0:   # the loss and gradient loss_and_grads would give before the step
      np.testing.assert_allclose(metrics["loss"], history[0][0], **tol)
      assert_trees_close(momentum_grads(trainer, state), history[0][1], tol)
  return dict(name=name, trainer=trainer, state=state, history=history, expected=expected,
              losses=losses, forward=forward, step=step, tol=tol, zoo=zoo)


def test_one_annotate_rule_gives_megatron_specs(split_run):
  trainer, zoo = split_run["trainer"], split_run["zoo"]
  expected = zoo.expected_specs(trainer.variables(split_run["state"]))
  got = {leaf.path: leaf.spec for leaf in trainer.plan.leaves}
  wrong = {p: (got[p], s) for p, s in expected.items()
           if tuple(got[p]) + (None,) * (len(s) - len(got[p])) != tuple(s) + (None,) * (
               len(got[p]) - len(s))}
  assert not wrong, wrong
  assert [(t.strategy, t.device_count) for t in trainer.plan.taskgraphs] == [("split", 2)]


def test_split_step_equals_the_single_device_reference(split_run):
  run = split_run
  for step in range(STEPS):
    np.testing.assert_allclose(run["losses"][step], run["history"][step][0], **run["tol"])
  assert_trees_close(run["trainer"].variables(run["state"]), run["expected"], run["tol"])


def test_forward_communicates_exactly_megatrons_minimum(split_run):
  run = split_run
  plan = run["trainer"].plan
  rows = comm.ZOO_ROWS // plan.num_replicas
  minimum = comm.megatron_minimum(run["name"], rows, plan.param_bytes, forward_only=True)
  assert {c.kind for c in run["forward"]} == {"all-reduce"}
  assert comm.activation_arrays(run["forward"], f"f32[{rows},16,32]") == minimum[
      "activation arrays"]
  assert comm.tensor_bytes(run["forward"]) == minimum["bytes"]


def test_step_communicates_exactly_megatrons_minimum(split_run):
  """The whole step moves Megatron's minimum: the input gradients of the column matmuls that
  read one activation (q and kv; q, k and v) are added before their one all-reduce, and so are
  the tied embedding's two gradients (lookup and logits) before their one reduction over
  replicas (``sharding.reductions``). Nothing is gathered."""
  run = split_run
  plan = run["trainer"].plan
  rows = comm.ZOO_ROWS // plan.num_replicas
  minimum = comm.megatron_minimum(run["name"], rows, plan.param_bytes)
  assert {c.kind for c in run["step"]} == {"all-reduce"}
  assert comm.activation_arrays(run["step"], f"f32[{rows},16,32]") == minimum[
      "activation arrays"]
  assert comm.tensor_bytes(run["step"]) == minimum["bytes"]


def test_plan_says_which_gradient_sums_are_fused(split_run):
  """Each layer's attention input feeds q and kv (Gemma) or q, k and v (GPT-2), and Llama's
  MLP input its gate and up too (inside its scan, counted per layer); the tied embedding of
  Gemma and GPT-2 is read by the lookup and the logits."""
  import models
  run = split_run
  layers = getattr(models, run["name"]).LAYERS
  inputs, matmuls = {"gemma": (1, 2), "gpt2": (1, 3), "llama": (2, 5)}[run["name"]]
  expected = (f"gradient sums: {layers * inputs} activations read by {layers * matmuls} "
              "column matmuls, one all-reduce over model each")
  if run["name"] != "llama":
    expected += "; 1 parameters read by 2 row-wise uses (tied), one reduction over data each"
  (line,) = [f for f in run["trainer"].plan.features if f.startswith("gradient sums")]
  assert line == expected
