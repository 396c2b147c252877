"""The pipeline loop: schedules, memory from the compiled program, features inside stages."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import epljax as epl
from epljax import build as build_lib
from epljax.features import LOSS_SCALE, Feature
from epljax.pipeline import make_schedule
from epljax.pipeline.partition import Stage
from epljax.pipeline.render import render_schedule, schedule_text
from epljax.pipeline.schedules import check_schedule
from helpers import assert_trees_close, classification_batch, linen_fns, reference_run
from pipeline_helpers import Stack, TwoStages, check_matches_reference


@pytest.mark.parametrize("strategy", ["PreferBackward", "PreferForward"])
@pytest.mark.parametrize("stages, micro", [(2, 1), (2, 4), (4, 2), (4, 4), (4, 16), (3, 7)])
def test_schedules_respect_every_dependency(strategy, stages, micro):
  sched = make_schedule(strategy, stages, micro)
  check_schedule(sched)
  assert sched.bubble_fraction == pytest.approx((stages - 1) / (micro + stages - 1))
  f_busy, b_busy = (sched.forward >= 0).any(1), (sched.backward >= 0).any(1)
  assert (f_busy | b_busy).all()
  if strategy == "PreferBackward":
    # Textbook 1F1B: a forward or a backward per stage and tick, S - s micro batches kept.
    assert sched.num_ticks == 2 * micro + 2 * stages - 2
    assert sched.kept_per_stage == [min(micro, stages - s) for s in range(stages)]
    assert not ((sched.forward >= 0) & (sched.backward >= 0)).any()
  else:
    # Only forwards for S-1 ticks, only backwards for S-1, both for M: (M+S-1)(f+b) in all.
    assert sched.num_ticks == 2 * micro + 2 * stages - 3
    assert sched.kept_per_stage == [micro] * stages
    assert (f_busy & b_busy).sum() >= 1


def test_one_f_one_b_starts_each_backward_as_soon_as_its_forward_left_the_last_stage():
  sched = make_schedule("PreferBackward", 4, 8)
  for m in range(8):
    t_last = int(np.argmax(sched.forward[:, 3] == m))
    assert sched.backward[t_last + 1, 3] == m
  assert sched.num_slots == 4          # S, whatever M: 16 micro batches keep 4 too
  assert make_schedule("PreferBackward", 4, 16).num_slots == 4
  assert make_schedule("PreferForward", 4, 16).num_slots == 16


def test_schedule_as_text_and_picture(tmp_path):
  sched = make_schedule("PreferBackward", 2, 3)
  assert schedule_text(sched) == [
      "stage 0  F0 .  F1 B0 F2 B1 .  B2",
      "stage 1  .  F0 B0 F1 B1 F2 B2 .",
  ]
  pytest.importorskip("matplotlib")
  path = render_schedule([make_schedule("PreferForward", 4, 8), make_schedule(
      "PreferBackward", 4, 8)], str(tmp_path / "schedule.png"))
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def _temp_bytes(strategy, micro):
  epl.init({"pipeline.num_micro_batch": micro, "pipeline.strategy": strategy})
  init_fn, loss_fn = linen_fns(Stack(stages=2, layers=1, width=64))
  trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(0.1))
  trainer.init(jax.random.key(0), classification_batch(4 * micro * 64))  # 64 rows per replica
  return trainer.plan.memory.temp_size_in_bytes


@pytest.mark.slow
def test_one_f_one_b_memory_does_not_grow_with_micro_batches():
  """Per-device temp bytes of the compiled step: 1F1B keeps at most S micro batches, GPipe
  all of them. GPipe at M=16 needing over twice 1F1B shows activations dominate."""
  one_f_4 = _temp_bytes("PreferBackward", 4)
  one_f_16 = _temp_bytes("PreferBackward", 16)
  gpipe_16 = _temp_bytes("PreferForward", 16)
  assert one_f_16 < 1.5 * one_f_4
  assert gpipe_16 > 2 * one_f_16


class FixedLossScale(Feature):
  """A loss-scaling feature: the pipeline must seed every backward with the scale."""
  name = LOSS_SCALE

  def init_state(self, ctx):
    return jnp.float32(1024.0)

  def gradients(self, fn, ctx):
    def unscaled(params, model_state, micro, fstate):
      loss, aux, grads, state = fn(params, model_state, micro, fstate)
      return loss, aux, jax.tree.map(lambda g: g / fstate[LOSS_SCALE], grads), state
    return unscaled


class RematStages(Feature):
  """A gradient-checkpointing feature: wraps each stage's forward in ``jax.checkpoint``."""
  name = "remat_stages"

  def __init__(self):
    self.wrapped = []

  def forward(self, fn, ctx):
    self.wrapped.append(fn)
    return jax.checkpoint(fn)


def test_features_wrap_each_stage_and_scale_its_backward(monkeypatch):
  remat = RematStages()
  monkeypatch.setattr(build_lib, "features_for",
                      lambda config, clip_norm=None: [FixedLossScale(), remat])
  epl.init({"pipeline.num_micro_batch": 4})
  trainer, state = check_matches_reference(TwoStages(), classification_batch(32),
                                           optax.adamw(1e-2))
  # Each stage's forward is wrapped (and the whole loss once, for trainer.lower_loss).
  assert sum(isinstance(fn, Stage) for fn in remat.wrapped) == 2
  assert len(remat.wrapped) == 3
  assert state.feature_state[LOSS_SCALE] == 1024.0
  # Rematerialized stages keep only their inputs: no residuals are stashed.
  assert trainer.plan.pipeline.loop.buffers.residuals == {}


def test_trainer_clipping_after_the_all_reduce_and_lower_loss_work_with_stages():
  """Trainer(clip_norm=...) with communication.clip_after_allreduce clips the reduced
  gradients: optax.clip_by_global_norm ahead of the optimizer on one device."""
  epl.init({"pipeline.num_micro_batch": 2, "communication.clip_after_allreduce": True})
  init_fn, loss_fn = linen_fns(TwoStages())
  batch = classification_batch(32)
  trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(0.5), clip_norm=0.05)
  state = trainer.init(jax.random.key(0), batch)
  state, _ = trainer.train_step(state, batch)
  _, expected = reference_run(init_fn, loss_fn, optax.chain(optax.clip_by_global_norm(0.05),
                                                            optax.sgd(0.5)),
                              jax.random.key(0), batch, 1)
  assert_trees_close(trainer.variables(state), expected)
  assert trainer.lower_loss(state, batch).compile() is not None
