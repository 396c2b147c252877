"""Tensor parallelism inside pipeline stages: ``epl.split(k)`` task graphs as stages (mesh
data x stage x model), exact against single-device training, with the model-split weights
kept split in the compiled step."""

import re

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import epljax as epl
from epljax import hlo
from epljax.errors import PlanError
from helpers import TOL, classification_batch, linen_fns
from pipeline_helpers import BACKWARD, FORWARD, check_matches_reference, sgd_clipped


class MegatronBlock(nn.Module):
  """LayerNorm -> column-parallel Dense -> gelu -> row-parallel Dense, residual."""
  width: int

  @nn.compact
  def __call__(self, h):
    y = nn.Dense(4 * self.width)(nn.LayerNorm()(h))
    return h + nn.Dense(self.width)(nn.gelu(y))


class SplitScopes(nn.Module):
  """Stages from consecutive ``epl.split(2, name=...)`` scopes."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(16)(x)                      # before the first scope: joins stage_0
    for i in range(2):
      with epl.split(2, name=f"stage_{i}"):
        h = MegatronBlock(16)(h)
    return nn.Dense(10)(h)                   # after the last scope: joins stage_1


class SplitDefault(nn.Module):
  """Stages from ``epl.set_default_strategy(epl.split(2))`` between layers (identical stages
  share their parameter slots and one branch of the loop)."""
  stages: int = 4

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(16)(x)
    for _ in range(self.stages):
      epl.set_default_strategy(epl.split(2))
      h = MegatronBlock(16)(h)
    return nn.Dense(10)(h)


class ReplicateThenSplit1(nn.Module):
  """A replicate stage and a split(1) stage (nothing to split: packed buffers, as replicate)."""

  @nn.compact
  def __call__(self, x):
    with epl.replicate(1, name="body"):
      h = nn.Dense(8)(x)
    with epl.split(1, name="head"):
      return nn.Dense(10)(h)


def _split_weights(trainer):
  """Full shapes of the parameters the plan splits over ``model``."""
  return {leaf.shape for leaf in trainer.plan.leaves
          if leaf.trainable and "model" in str(leaf.spec)}


@pytest.fixture(scope="module")
def scopes_run():
  epl.init({**BACKWARD, "pipeline.num_micro_batch": 4})
  batch = classification_batch(32)
  # SGD, as the unpipelined split tests: Adam divides tiny gradients by their own size, which
  # turns the reassociated partial sums of model-split matmuls into visible differences.
  trainer, state = check_matches_reference(SplitScopes(), batch, sgd_clipped())
  return trainer, state, batch


def test_split_scopes_match_reference_on_data_stage_model_mesh(scopes_run):
  trainer, _, _ = scopes_run
  assert dict(trainer.plan.mesh.shape) == {"data": 2, "stage": 2, "model": 2}
  assert trainer.plan.num_stages == 2 and trainer.plan.num_replicas == 2
  kernels = {leaf.path: leaf.spec for leaf in trainer.plan.leaves}
  assert "model" in str(kernels["params/MegatronBlock_0/Dense_0/kernel"])   # column
  assert "model" in str(kernels["params/MegatronBlock_1/Dense_1/kernel"])   # row


def test_split_stage_weights_stay_split_in_the_compiled_step(scopes_run):
  trainer, state, batch = scopes_run
  text = trainer.lower(state, batch).compile().as_text()
  found = hlo.collectives(text)
  whole = _split_weights(trainer)
  assert len(whole) >= 3, whole
  gathered = [c for c in found if c.kind == "all-gather"]
  assert not [c for c in gathered if any(
      tuple(int(d) for d in s[s.index("[") + 1:-1].split(",") if d) in whole
      for s in c.shapes)], gathered
  # Megatron's row-parallel all-reduce of the activations, inside the stage's 2 devices.
  rows = 32 // (2 * 4)   # micro batch rows of one replica
  assert [c for c in found if c.kind == "all-reduce" and f"f32[{rows},16]" in c.shapes]


def test_split_stages_eval_step_is_the_forward_of_the_trained_variables(scopes_run):
  trainer, state, batch = scopes_run
  init_fn, loss_fn = linen_fns(SplitScopes())
  expected = jax.jit(loss_fn)(jax.device_get(trainer.variables(state)), batch)
  np.testing.assert_allclose(trainer.eval_step(state, batch)["loss"], expected, **TOL)


def test_split_plan_shows_the_model_split_of_each_stage(scopes_run):
  text = str(scopes_run[0].plan)
  assert ("split     stage 0 'stage_0': epl.split(2) over model; 3 of 8 parameters split, "
          "5.6 KiB of 9.8 KiB per device") in text
  assert ("split     stage 1 'stage_1': epl.split(2) over model; 5 of 8 parameters split, "
          "4.6 KiB of 9.1 KiB per device") in text
  assert re.search(r"stash     residuals: 2 micro batches x [\d.]+ KiB per "
                   r"device before the model split; 2 distinct stage functions", text), text


def test_split_stages_stash_their_residuals_split_over_model(scopes_run):
  """The stash keeps the column-parallel activations (32 // (2 * 4) rows, 4 * 16 features)
  at their ``model`` split, 32 features per device; nothing is gathered to stash it."""
  trainer, state, batch = scopes_run
  text = trainer.lower(state, batch).compile().as_text()
  slots = trainer.plan.pipeline.schedule.num_slots
  assert re.search(rf"f32\[{slots},4,32\]", text)
  assert not re.search(rf"f32\[{slots},4,64\]", text)
  assert not [c for c in hlo.collectives(text) if c.kind == "all-gather"]


def test_split_stages_with_gc_auto_match_reference_and_gather_nothing():
  """GC auto inside split stages: exact, a smaller stash, and no all-gather (the CPU
  recomputation's tie to the cotangent once raveled it, gathering model-split cotangents)."""
  epl.init({**BACKWARD, "pipeline.num_micro_batch": 4, "gradient_checkpoint.type": "auto"})
  batch = classification_batch(32)
  trainer, state = check_matches_reference(SplitScopes(), batch, sgd_clipped())
  assert any("gradient checkpointing (auto:" in f for f in trainer.plan.features)
  text = trainer.lower(state, batch).compile().as_text()
  assert not [c for c in hlo.collectives(text) if c.kind == "all-gather"]


@pytest.mark.slow
def test_split_default_strategy_4_stages_gpipe_match_reference():
  epl.init({**FORWARD, "pipeline.num_micro_batch": 4})
  trainer, _ = check_matches_reference(SplitDefault(), classification_batch(16),
                                       optax.sgd(0.1, momentum=0.9))
  assert dict(trainer.plan.mesh.shape) == {"data": 1, "stage": 4, "model": 2}
  pipe = trainer.plan.pipeline
  assert len(pipe.loop.branches) == 3             # the two middle stages share a branch
  # identical stages fill the same slots: a device holds about one stage's parameters
  assert pipe.store.bytes_inside() < 2 * max(pipe.stage_param_bytes(s) for s in pipe.stages)
  np.testing.assert_equal(pipe.split, (2, 2, 2, 2))


def test_replicate_and_split_1_stages_match_reference():
  epl.init({**BACKWARD, "pipeline.num_micro_batch": 2})
  trainer, _ = check_matches_reference(ReplicateThenSplit1(), classification_batch(16),
                                       optax.sgd(0.1))
  assert [tg.strategy for tg in trainer.plan.taskgraphs] == ["replicate", "split"]
  assert not trainer.plan.pipeline.slotted


def test_a_permute_inside_a_split_stage_is_refused_before_the_step_runs(scopes_run,
                                                                         monkeypatch):
  """GSPMD may move a model-split activation with a collective-permute; inside a stage's
  branch only that stage's devices would reach it (a hang, by what the platform waits for):
  the compiled step is checked before it first runs."""
  import test_hlo

  pipe = scopes_run[0].plan.pipeline
  pipe.check_compiled(scopes_run[0].plan.compiled.as_text())   # the real step passes
  with pytest.raises(PlanError, match=r"(?s)1 collective\(s\) \(collective-permute: f32\[4\]\) "
                     r"inside a\stensor-parallel\sstage's computation \('stage_0': split\(2\), "
                     r"'stage_1': split\(2\)\).*XLA:CPU's.* would hang"):
    pipe.check_compiled(test_hlo.LOOPED)
  # A step-wide conditional (outside the loop: the XLA:CPU skip of a non-finite update) is
  # taken by every device alike.
  pipe.check_compiled(test_hlo.BRANCHED)
  # Other collectives in a branch: fine within one stage's devices (mesh data 2 x stage 2 x
  # model 2: partitions 0, 1 are stage 0's model pair), refused across stages (0 and 2).
  within = test_hlo.LOOPED.replace(
      "collective-permute(%p), channel_id=1, source_target_pairs={{0,1},{1,0}}",
      "all-reduce(%p), channel_id=1, replica_groups=[4,2]<=[8], to_apply=%add")
  pipe.check_compiled(within)
  across = within.replace("replica_groups=[4,2]<=[8]", "replica_groups=[4,2]<=[2,2,2]T(0,2,1)")
  with pytest.raises(PlanError, match=r"1 collective\(s\) \(all-reduce: f32\[4\]\)"):
    pipe.check_compiled(across)
  # XLA:GPU (its async form, as compiled for H100s): the permute's clique is every device,
  # unless XLA_FLAGS makes it the devices its pairs connect; then pairs within a stage pass.
  gpu = test_hlo.LOOPED.replace("f32[4]{0} collective-permute(", "((f32[4]{0}), f32[4]{0}) "
                                "collective-permute-start(")
  with pytest.raises(PlanError, match=r"(?s)collective-permute: f32\[4\].*XLA:GPU's"):
    pipe.check_compiled(gpu, platform="gpu")
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_collective_permute_connected_components=true")
  pipe.check_compiled(gpu, platform="gpu")
  with pytest.raises(PlanError, match=r"collective-permute: f32\[4\]"):   # devices 0 and 2
    pipe.check_compiled(gpu.replace("{{0,1},{1,0}}", "{{0,2},{2,0}}"), platform="gpu")
  with pytest.raises(PlanError, match="not checked on tpu"):
    pipe.check_compiled(test_hlo.LOOPED, platform="tpu")
