"""auto.auto_parallel with pipeline.num_stages: stages cut automatically, balanced by FLOPs."""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import epljax as epl
from epljax.pipeline.auto import StageBalanceWarning, auto_stage_cuts, node_flops, stage_balance
from helpers import classification_batch, linen_fns
from pipeline_helpers import Block, check_matches_reference

AUTO = {"auto.auto_parallel": True, "pipeline.num_micro_batch": 4}


class Plain(nn.Module):
  """No annotation at all: a stem, four identical blocks and a head."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(16)(x)
    for _ in range(4):
      h = Block(16)(h)
    return nn.Dense(10)(h)


def test_an_unannotated_model_is_cut_into_balanced_stages_and_matches_single_device():
  epl.init({**AUTO, "pipeline.num_stages": 2})
  trainer, _ = check_matches_reference(Plain(), classification_batch(32), optax.adamw(1e-2))
  plan = trainer.plan
  assert (plan.num_stages, plan.num_replicas) == (2, 4)
  assert [(t.name, t.strategy, t.device_count) for t in plan.taskgraphs] == [
      ("stage_0", "replicate", 1), ("stage_1", "replicate", 1)]
  stage_of = {leaf.path: leaf.taskgraph for leaf in plan.leaves}
  # Parameters are owned in model order: the stem in the first stage, the head in the last.
  assert stage_of["params/Dense_0/kernel"] == "stage_0"
  assert stage_of["params/Dense_1/kernel"] == "stage_1"
  blocks = [stage_of[f"params/Block_{i}/Dense_0/kernel"] for i in range(4)]
  assert blocks == sorted(blocks) and set(blocks) == {"stage_0", "stage_1"}


def test_cuts_balance_the_estimated_flops():
  epl.init({**AUTO, "pipeline.num_stages": 4})
  init_fn, loss_fn = linen_fns(Plain())
  trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(0.1))
  trainer.init(jax.random.key(0), classification_batch(32))
  cap = trainer._built.capture
  nodes = cap.program.nodes
  cost = np.zeros(len(cap.taskgraphs))
  for n in nodes:
    if cap.node_taskgraph[n.index] >= 0:
      cost[cap.node_taskgraph[n.index]] += node_flops(n)
  assert cost.max() < 1.6 * cost.mean(), cost
  assert trainer.plan.num_stages == 4


@pytest.mark.parametrize("config, model, message", [
    ({**AUTO, "pipeline.num_stages": 2}, None,
     r"auto.auto_parallel cuts a model into stages by itself, but this model already has task "
     r"graphs \['stage_0', 'stage_1'\]"),
    ({"pipeline.num_stages": 3}, Plain(),
     r"pipeline.num_stages=3, but the model's task graphs make 1 stage\(s\)"),
    ({**AUTO, "pipeline.num_stages": 500}, Plain(), r"only \d+ equations to divide"),
])
def test_auto_parallel_errors(config, model, message):
  from pipeline_helpers import TwoStages
  epl.init(config)
  init_fn, loss_fn = linen_fns(model or TwoStages())
  trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(0.1))
  with pytest.raises(epl.PlanError, match=message):
    trainer.init(jax.random.key(0), classification_batch(32))


def test_no_cut_splits_a_loop_and_a_weight_tied_across_the_model_is_held_by_both_stages():
  class Tied(nn.Module):
    @nn.compact
    def __call__(self, x):
      w = self.param("w", nn.initializers.lecun_normal(), (20, 20))
      h = jax.nn.relu(x @ w)
      h = jax.lax.fori_loop(0, 3, lambda i, v: jax.nn.tanh(v) * 0.9, h)
      h = Block(20)(Block(20)(h))
      return nn.Dense(10)(h @ w)       # w used at both ends: tied

  epl.init({**AUTO, "pipeline.num_stages": 2})
  trainer, _ = check_matches_reference(Tied(), classification_batch(32), optax.adam(1e-2))
  cap = trainer._built.capture
  cuts = auto_stage_cuts(cap, 2)
  loop = [n.index for n in cap.program.nodes if {"while", "scan"} & set(n.enclosing)]
  assert not loop[0] < cuts[0] <= loop[-1]
  pipe = trainer.plan.pipeline
  w = pipe.param_paths.index("params/w")
  assert pipe.shared == {w: (0, 1)}
  # Balanced: FLOPs within 1.5x of the mean (no StageBalanceWarning), parameters both sides.
  flops, params = stage_balance(cap, trainer._built.layout.stage_of, 2)
  assert max(flops) < 1.5 * sum(flops) / 2 and min(params) > 0


class Heavy(nn.Module):
  @nn.compact
  def __call__(self, x):
    with epl.replicate(1, name="light"):
      h = nn.Dense(8)(x)
    with epl.replicate(1, name="heavy"):
      for _ in range(4):
        h = nn.Dense(64)(h)
      return nn.Dense(10)(h)


def test_an_unbalanced_stage_plan_says_so():
  epl.init({"pipeline.num_micro_batch": 2})
  init_fn, loss_fn = linen_fns(Heavy())
  trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(0.1))
  with pytest.warns(StageBalanceWarning, match=r"Unbalanced pipeline: stage\(s\) \['heavy'\] "
                    r"have more than 1.5x the mean FLOPs; .*light .* FLOPs \(0.\d\dx mean\)"):
    trainer.init(jax.random.key(0), classification_batch(16))
  assert any(line.startswith("balance   heavy") for line in trainer.plan.pipeline.describe())


class Loop(nn.Module):
  """A stem, ``layers`` equal blocks written as a Python loop, and a head."""
  layers: int

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(16)(x)
    for _ in range(self.layers):
      h = Block(16)(h)
    return nn.Dense(10)(h)


def _cut_through(model: nn.Module, batch: dict, stages: int, layer: str, layers: int,
                 loss_fn=None) -> list[int]:
  """The layers ``{layer}_{i}`` of ``model`` whose parameters the automatic cut puts in two
  stages (planned, nothing compiled)."""
  epl.init({**AUTO, "pipeline.num_stages": stages})
  init_fn, default_loss = linen_fns(model)
  trainer = epl.Trainer(init_fn, loss_fn or default_loss, optax.sgd(0.1))
  stage_of = {leaf.path: leaf.taskgraph for leaf in
              trainer._build(jax.random.key(0), batch).plan.leaves}
  return [i for i in range(layers)
          if len({s for path, s in stage_of.items() if f"/{layer}_{i}/" in path}) > 1]


def _blocks_cut_through(layers: int, stages: int) -> list[int]:
  return _cut_through(Loop(layers), classification_batch(16), stages, "Block", layers)


def test_deep_repeated_layers_are_cut_between_layers_when_balance_allows(monkeypatch):
  # 20 blocks on 2 stages: the balanced place is inside block 9; half a block is 5% of a
  # stage's share, within LAYER_SLACK, so the cut falls between two blocks.
  from epljax.pipeline import auto
  assert _blocks_cut_through(20, 2) == []
  monkeypatch.setattr(auto, "LAYER_SLACK", 0.0)
  assert _blocks_cut_through(20, 2) == [9]


def test_few_layers_per_stage_keep_the_balanced_cut_inside_a_layer():
  # 7 blocks on 2 stages: the balanced place is in the middle of block 3, half a block (a
  # seventh of a stage's share) from either boundary: more than LAYER_SLACK.
  assert _blocks_cut_through(7, 2) == [3]


def test_the_cuts_move_between_layers_all_together_or_not_at_all():
  # bench/pipelines/memory.py's GPT of 4 layers (width 256) on 4 stages: the first two cuts could
  # move between two layers within LAYER_SLACK, the last (before the heavy head) could not;
  # moving two alone would leave the third stage a layer and the next one's head (a program
  # of its own), so every cut stays at its balanced place.
  from test_cost import _bench_on_path
  _bench_on_path()
  from pipelines import memory as pm
  model = pm.GPT(4, 256)
  batch = {k: np.zeros(v.shape, v.dtype) for k, v in pm.batch_shapes(4).items()}
  assert _cut_through(model, batch, 4, "Layer", 4,
                      lambda v, b: pm.ce(model.apply(v, b["x"]), b["y"])) == [1, 2, 3]
