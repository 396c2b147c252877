"""Pipeline plans and what pipelines refuse, with the texts users read."""

import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import epljax as epl
from epljax.pipeline import PipelineWarning
from helpers import (TOL, assert_trees_close, classification_batch, linen_fns,
                     reference_run)
from epljax.build import UserFns, pipeline_plan
from pipeline_helpers import TwoStages, run_case


def trainer_for(model, optimizer=None, **kwargs):
  init_fn, loss_fn = linen_fns(model)
  return epl.Trainer(init_fn, loss_fn, optimizer or optax.sgd(0.1), **kwargs)


def test_plan_shows_stages_schedule_and_bubble():
  trainer, _ = run_case("scopes_2_stages_1f1b")
  plan = trainer.plan
  assert (plan.num_stages, plan.num_replicas) == (2, 4)
  assert [tg.name for tg in plan.taskgraphs] == ["stage_0", "stage_1"]
  assert plan.batch_axes == ("data",)
  assert plan.micro_batch_per_replica == 4
  text = str(plan)
  assert "schedule PreferBackward" in text
  assert "PreferBackward (1F1B): 10 ticks, bubble (S-1)/(M+S-1) = 1/5 = 20%" in text
  assert "keeps at most 2 micro batches per stage" in text
  lines = text.splitlines()
  table = lines[lines.index("pipeline stages") + 1:][:3]
  assert table[0].split() == ["stage", "task", "graph", "params", "bytes/device",
                              "activations", "in", "kept/micro", "batch", "loop"]
  assert [row.split()[:4] for row in table[1:]] == [["0", "stage_0", "2", "2.6"],
                                                     ["1", "stage_1", "4", "4.1"]]
  # Nothing repeats in either stage (one, then two different layers): nothing is rolled.
  assert [row.split()[-1] for row in table[1:]] == ["-", "-"]
  # The stored parameters are the user's leaves, each sharded over the 2 stages: half of them.
  total = (20 * 32 + 32 + 32 * 24 + 24 + 24 * 10 + 10) * 4
  assert plan.param_bytes == total // 2
  assert plan.pipeline.store.bytes_inside() == (32 * 24 + 24 + 24 * 10 + 10) * 4
  # The user's structure, whatever the packing.
  assert jax.tree.structure(plan.param_specs) == jax.tree.structure(
      jax.eval_shape(linen_fns(TwoStages())[0], jax.random.key(0), classification_batch(16)))


class _StepCompiles(logging.Handler):
  """Counts XLA compilations of the train step (``jax.log_compiles``)."""

  def __init__(self):
    super().__init__(logging.WARNING)
    self.steps = 0

  def emit(self, record):
    text = record.getMessage()
    self.steps += "Finished XLA compilation" in text and "epl_step" in text


def test_the_pipeline_plan_prints_without_compiling_the_step():
  """Stages, schedule and parameter store are one plan built before anything compiles: the
  pipeline's section of ``print(trainer.plan)`` and its bytes per device are read from it
  (``build.pipeline_plan`` gives it for a configuration without a Trainer), and the step it
  prints compiles only when first run."""
  epl.init({"pipeline.strategy": "PreferBackward", "pipeline.num_micro_batch": 4})
  batch = classification_batch(64)
  trainer = trainer_for(TwoStages(), optax.adamw(1e-2))
  handler = _StepCompiles()
  logger = logging.getLogger("jax")
  logger.addHandler(handler)
  try:
    with jax.log_compiles():
      fns = UserFns(trainer.init_fn, trainer.loss_fn, trainer.optimizer, trainer.has_aux,
                    trainer.mutable, trainer.clip_norm)
      pipe = pipeline_plan(fns, trainer._config, trainer._cluster, jax.random.key(0), batch)
      state = trainer.init(jax.random.key(0), batch)
      text = trainer.plan.pipeline.text()
      assert handler.steps == 0, handler.steps
      trainer.train_step(state, batch)
  finally:
    logger.removeHandler(handler)
  assert handler.steps == 1    # the handler sees compiles: the first step is the first
  assert pipe.text() == text, (pipe.text(), text)
  lines = text.splitlines()
  assert lines[0] == "pipeline stages"
  assert [row.split()[:4] for row in lines[2:4]] == [["0", "stage_0", "2", "2.6"],
                                                      ["1", "stage_1", "4", "4.1"]]
  assert "  schedule  PreferBackward (1F1B): 10 ticks, bubble (S-1)/(M+S-1) = 1/5 = 20%" in text
  assert "  stash     residuals: 2 micro batches x " in text
  assert "packed for the largest stage inside the step" in text
  total = (20 * 32 + 32 + 32 * 24 + 24 + 24 * 10 + 10) * 4
  assert pipe.param_bytes_per_device == trainer.plan.param_bytes == total // 2
  assert text in str(trainer.plan)


def test_bert_style_default_strategy_calls_name_stages_in_order():
  trainer, _ = run_case("stack_4_stages_1f1b")
  assert [tg.name for tg in trainer.plan.taskgraphs] == [f"taskgraph_{i}" for i in range(4)]
  by_layer = {leaf.path.split("/")[1]: leaf.taskgraph for leaf in trainer.plan.leaves}
  assert by_layer == {"Dense_0": "taskgraph_0", "Block_0": "taskgraph_0",
                      "Block_1": "taskgraph_1", "Block_2": "taskgraph_2",
                      "Block_3": "taskgraph_3", "Dense_1": "taskgraph_3"}


def test_fewer_micro_batches_than_stages_warns_and_stays_exact():
  epl.init({"pipeline.num_micro_batch": 1})
  trainer = trainer_for(TwoStages())
  batch = classification_batch(16)
  with pytest.warns(PipelineWarning, match=r"pipeline.num_micro_batch=1 is smaller than the 2 "
                    r"pipeline stages: at most 1 stages work at any time, and 50% of each step "
                    r"is pipeline bubble\. Use num_micro_batch >= 2"):
    state = trainer.init(jax.random.key(0), batch)
  init_fn, loss_fn = linen_fns(TwoStages())
  history, _ = reference_run(init_fn, loss_fn, optax.sgd(0.1), jax.random.key(0), batch, 1)
  loss, grads = trainer.loss_and_grads(state, batch)
  np.testing.assert_allclose(loss, history[0][0], **TOL)
  assert_trees_close(grads, history[0][1])


def test_batch_that_does_not_divide_into_replicas_and_micro_batches():
  epl.init({"pipeline.num_micro_batch": 4})
  trainer = trainer_for(TwoStages())
  with pytest.raises(epl.PlanError, match=r"The global batch of 40 rows does not divide into 4 "
                     r"replicas x 4 micro batches \(= 16\)\. Use a global batch that is a "
                     r"multiple of 16, for example 32 or 48"):
    trainer.init(jax.random.key(0), classification_batch(40))


def test_a_batch_of_another_size_than_at_init_is_refused():
  epl.init({"pipeline.num_micro_batch": 2})
  trainer = trainer_for(TwoStages())
  state = trainer.init(jax.random.key(0), classification_batch(32))
  with pytest.raises(epl.PlanError, match=r"The pipeline was built for the global batch of "
                     r"trainer.init \(32 rows\); this batch has 64. .* use batches of 32 rows, "
                     r"or a new Trainer for the other size"):
    trainer.train_step(state, classification_batch(64))


class Mixed(nn.Module):
  counts: tuple = (1, 2)

  @nn.compact
  def __call__(self, x):
    with epl.replicate(self.counts[0], name="stage_0"):
      h = nn.Dense(8)(x)
    with epl.replicate(self.counts[1], name="stage_1"):
      return nn.Dense(10)(h)


def test_stages_with_different_device_counts():
  trainer = trainer_for(Mixed())
  with pytest.raises(epl.PlanError, match=r"Task graphs 'stage_0' replicate\(1\), 'stage_1' "
                     r"replicate\(2\) use different device counts, but task graphs that are not "
                     r"colocated are pipeline stages, and every stage must use the same number "
                     r"of devices\. Give them the same device_count"):
    trainer.init(jax.random.key(0), classification_batch(16))


def test_a_loop_across_stages_is_refused():
  def init_fn(rng, batch):
    return {"w": jnp.ones((20, 20)) * 0.1}

  def loss_fn(params, batch):
    def body(h, _):
      with epl.replicate(1, name="stage_0"):
        h = jnp.tanh(h @ params["w"])
      with epl.replicate(1, name="stage_1"):
        h = h * 2.0
      return h, None
    h, _ = jax.lax.scan(body, batch["x"], None, length=2)
    return jnp.mean(h)

  trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(0.1))
  with pytest.raises(epl.PlanError, match=r"The operation `scan` at .* contains work of pipeline "
                     r"stages 'stage_0', 'stage_1'; a stage\s+boundary cannot fall inside a loop"):
    trainer.init(jax.random.key(0), classification_batch(16))


def test_a_value_flowing_back_to_an_earlier_stage_is_refused():
  def init_fn(rng, batch):
    return {"w0": jnp.ones((20, 8)), "w1": jnp.ones((8, 8)), "w2": jnp.ones((8, 10))}

  def loss_fn(p, batch):
    with epl.replicate(1, name="stage_0"):
      h = batch["x"] @ p["w0"]
    with epl.replicate(1, name="stage_1"):
      g = jnp.tanh(h @ p["w1"])
    with epl.replicate(1, name="stage_0"):
      out = g @ p["w2"]
    return jnp.mean(out ** 2)

  trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(0.1))
  with pytest.raises(epl.PlanError, match=r"(?s)Pipeline stage 'stage_0' uses a value computed in "
                     r"stage 'stage_1', which runs after it.*reads the result of `tanh`"):
    trainer.init(jax.random.key(0), classification_batch(16))
