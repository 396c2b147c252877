"""epl.Checkpointer: exact continuation, restore into other strategies, refused checkpoints,
and resume after kill -9 of a process that saved."""

from __future__ import annotations

import contextlib
import os
import warnings

import flax.linen as nn
from flax import nnx
import jax
import numpy as np
import optax
import pytest

import epljax as epl
from helpers import (TOL, assert_trees_close, classification_batch, cross_entropy,
                     each_on_one_jax, kill_9_and_resume, printed, share_compiles)

ROWS, STEPS, SAVED = 64, 4, 2
BATCHES = [classification_batch(ROWS, seed=i) for i in range(STEPS)]


class Net(nn.Module):
  """The same parameter tree whatever ``mode`` places it with: plain data parallelism,
  tensor parallelism (``split``) or two pipeline stages (``pipe``)."""
  mode: str = "dp"
  hidden: int = 32

  @nn.compact
  def __call__(self, x):
    if self.mode == "split":
      with epl.split(4, name="mlp"):
        h = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(10)(h)
    first = epl.replicate(1, name="stage_0") if self.mode == "pipe" else contextlib.nullcontext()
    second = epl.replicate(1, name="stage_1") if self.mode == "pipe" else contextlib.nullcontext()
    with first:
      h = nn.relu(nn.Dense(self.hidden)(x))
    with second:
      return nn.Dense(10)(h)


CONFIGS = {"dp": {}, "split": {}, "zero": {"zero.level": "v1"},
           "pipe": {"pipeline.num_micro_batch": 4},
           # The train state as the loop's slots: checkpoints hold the user's trees all the same.
           "pipe_stage": {"pipeline.num_micro_batch": 4, "pipeline.param_layout": "stage"}}


def make_trainer(kind: str, hidden: int = 32):
  epl.init(CONFIGS[kind])
  if kind in ("dp", "zero"):
    epl.set_default_strategy(epl.replicate(1))
  model = Net({"zero": "dp", "pipe_stage": "pipe"}.get(kind, kind), hidden)
  trainer = epl.Trainer(lambda rng, b: model.init(rng, b["x"]),
                        lambda v, b: cross_entropy(model.apply(v, b["x"]), b["y"]),
                        optax.adam(1e-2))
  return trainer, trainer.init(jax.random.key(0), BATCHES[0])


def numpy_tree(tree):
  return jax.tree.map(lambda x: np.array(x), tree)


def run(trainer, state, steps, ckpt=None, keep=True):
  """Trains ``steps`` (indices into BATCHES); saves after step SAVED when ``ckpt`` is given."""
  losses, saved = [], None
  for i in steps:
    state, metrics = trainer.train_step(state, BATCHES[i])
    losses.append(float(metrics["loss"]))
    if ckpt is not None and i + 1 == SAVED:
      ckpt.save(SAVED, state)
      saved = numpy_tree(trainer.variables(state)) if keep else None
  return state, losses, saved


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Every run of the module, trained here (a jitted step traces on first use, under the
  strategy scopes of the moment): {name: (losses, ...)}."""
  root = tmp_path_factory.mktemp("ckpt")
  out = {}
  sources = {}
  kept = {}
  for kind in ("dp", "pipe", "zero", "pipe_stage"):
    trainer, state = make_trainer(kind)
    ckpt = epl.Checkpointer(root / kind, max_to_keep=2)
    _, losses, saved = run(trainer, state, range(STEPS), ckpt)
    ckpt.wait()
    sources[kind] = (ckpt, losses, saved)
    out[f"{kind}_ref"] = losses
    if kind in ("dp", "pipe_stage"):   # (their steps are compiled: restored into below)
      kept[kind] = trainer
  # Restores: (source checkpoint, restoring trainer kind)
  targets = dict(kept)
  for source, kind in [("dp", "dp"), ("dp", "split"), ("pipe", "dp"), ("dp", "pipe"),
                       ("zero", "dp"), ("pipe_stage", "dp"), ("dp", "pipe_stage")]:
    if kind not in targets:
      targets[kind] = make_trainer(kind)[0]
    trainer = targets[kind]
    ckpt, losses, saved = sources[source]
    with warnings.catch_warnings():
      # Trainers made under earlier epl.init configs are reused on purpose (each keeps its own
      # configuration); the library's warning about that is tested elsewhere.
      warnings.filterwarnings("ignore", "This Trainer was made before", UserWarning)
      state = ckpt.restore(trainer)
      restored = numpy_tree(trainer.variables(state))
      assert int(state.step) == SAVED
      _, after, _ = run(trainer, state, range(SAVED, STEPS))
    out[f"{source}->{kind}"] = (after, losses[SAVED:], restored, saved)
  out["sources"] = sources
  out["trainers"] = targets
  return out


def test_restore_continues_exactly_as_the_uninterrupted_run(runs):
  after, expected, restored, saved = runs["dp->dp"]
  assert after == expected                        # bit for bit
  assert_trees_close(restored, saved, dict(rtol=0, atol=0))


@pytest.mark.parametrize("case", ["dp->split", "pipe->dp", "dp->pipe", "zero->dp",
                                  "pipe_stage->dp", "dp->pipe_stage"])
def test_restore_into_another_strategy_continues_the_run(runs, case):
  after, expected, restored, saved = runs[case]
  assert_trees_close(restored, saved, dict(rtol=0, atol=0))   # the saved values, exactly
  np.testing.assert_allclose(after, expected, **TOL)
  # ... and all the runs are the same training (the strategies match the plain reference).
  np.testing.assert_allclose(runs["pipe_ref"], runs["dp_ref"], **TOL)
  np.testing.assert_allclose(runs["zero_ref"], runs["dp_ref"], **TOL)
  np.testing.assert_allclose(runs["pipe_stage_ref"], runs["dp_ref"], **TOL)


def test_restored_state_has_the_trainer_shardings(runs):
  trainer = runs["trainers"]["pipe"]
  ckpt = runs["sources"]["dp"][0]
  state = ckpt.restore(trainer)
  built = trainer._require()
  for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(
      built.state_shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))):
    assert x.sharding.is_equivalent_to(s, x.ndim)
  # A pipeline's checkpoint holds the user's tree, not the packed buffers.
  meta = runs["sources"]["pipe"][0]._manager.item_metadata(SAVED)["default"].tree
  assert set(meta["params"]) == {"Dense_0", "Dense_1"}
  assert tuple(meta["params"]["Dense_0"]["kernel"].shape) == (20, 32)
  assert tuple(meta["opt_state"][0]["mu"]["Dense_1"]["kernel"].shape) == (32, 10)


def test_latest_step_max_to_keep_and_refusals(runs, tmp_path):
  trainer = runs["trainers"]["dp"]
  ckpt = epl.Checkpointer(tmp_path / "keep", max_to_keep=2)
  assert ckpt.latest_step() is None
  with pytest.raises(epl.CheckpointError, match="No checkpoint in .*nothing to restore"):
    ckpt.restore(trainer)
  state = runs["sources"]["dp"][0].restore(trainer)
  for step in (1, 2, 3):
    ckpt.save(step, state)
  ckpt.wait()
  assert ckpt.latest_step() == 3 and ckpt.all_steps() == [2, 3]
  with pytest.raises(epl.CheckpointError, match="Step 3 is already saved"):
    ckpt.save(3, state)
  with pytest.raises(epl.CheckpointError, match=r"No checkpoint of step 1 .* steps \[2, 3\]"):
    ckpt.restore(trainer, step=1)


def test_checkpoint_of_another_model_names_the_first_mismatch(runs):
  trainer, _ = make_trainer("dp", hidden=16)
  ckpt = runs["sources"]["dp"][0]
  with pytest.raises(epl.CheckpointError,
                     match=r"at 'params/Dense_0/bias' it holds shape \(32,\), the "
                           r"trainer has shape \(16,\)"):
    ckpt.restore(trainer)


# -- kill -9 of a process that saved, then resume ------------------------------------------

WORKER = os.path.join(os.path.dirname(__file__), "launch_scripts", "ckpt_worker.py")


@pytest.mark.slow
def test_resume_after_kill_9_gives_the_uninterrupted_losses(tmp_path, monkeypatch):
  share_compiles(monkeypatch, tmp_path / "compiled")
  steps = 8
  reference, killed, resumed, start = kill_9_and_resume(WORKER, tmp_path, steps)
  expected = printed(reference, "LOSS")
  assert sorted(expected) == list(range(1, steps + 1))
  first, second = printed(killed, "LOSS"), printed(resumed, "LOSS")
  assert sorted(second) == list(range(start + 1, steps + 1))
  for step, loss in {**first, **second}.items():
    assert loss == expected[step], f"step {step}: {loss} != {expected[step]}"


class NNXNet(nnx.Module):
  """Parameters, BatchNorm statistics and dropout RNG state (typed keys) in one module."""

  def __init__(self, rngs: nnx.Rngs):
    self.dense1 = nnx.Linear(20, 16, rngs=rngs)
    self.bn = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
    self.dropout = nnx.Dropout(0.25, rngs=rngs)
    self.dense2 = nnx.Linear(16, 10, rngs=rngs)

  def __call__(self, x):
    return self.dense2(self.dropout(nnx.relu(self.bn(self.dense1(x)))))


def test_nnx_model_state_and_rng_resume_exactly(tmp_path):
  epl.init()
  epl.set_default_strategy(epl.replicate(1))
  trainer = epl.Trainer(
      lambda rng, b: NNXNet(nnx.Rngs(params=rng, dropout=jax.random.fold_in(rng, 1))),
      lambda model, b: cross_entropy(model(b["x"]), b["y"]), optax.adamw(1e-2))
  state = trainer.init(jax.random.key(0), BATCHES[0])
  ckpt = epl.Checkpointer(tmp_path)
  state, losses, _ = run(trainer, state, range(STEPS), ckpt, keep=False)
  ckpt.wait()
  state, after, _ = run(trainer, ckpt.restore(trainer), range(SAVED, STEPS), keep=False)
  assert after == losses[SAVED:]   # dropout masks and batch statistics continue exactly


@pytest.mark.parametrize("name", each_on_one_jax(
    ["gemma", "llama", "gpt2", "vit", "mlp_loop"]))
def test_every_zoo_model_restores_from_data_parallel_into_its_megatron_split(name, tmp_path):
  """The zoo's structures (fused einsum kernels, tied embeddings, nn.scan's stacked layers with
  logical axis metadata, a looped stack): a data-parallel checkpoint restores into the model's
  one-line Megatron split, parameters and optimizer state exactly as saved."""
  from models import ZOO

  zoo = ZOO[name]
  batch = zoo.make_batch(16)
  def rules():
    return (nn.logical_axis_rules(zoo.logical_rules) if zoo.logical_rules
            else contextlib.nullcontext())

  def trainer_and_state(split: bool):
    epl.init()
    if split:
      epl.annotate(zoo.annotate_rules(2))
    trainer = epl.Trainer(zoo.init_fn, zoo.loss_fn, optax.adam(1e-3))
    with rules():
      if split:
        # Planned as trainer.init plans it, but its random initial state (which restore
        # replaces, reading only the plan) not compiled: 3-7 s a model. Restoring after a real
        # trainer.init into a split is test_restore_into_another_strategy_continues_the_run's.
        return trainer, trainer._build(jax.random.key(0), batch)
      return trainer, trainer.init(jax.random.key(0), batch)

  dp, state = trainer_and_state(split=False)
  ckpt = epl.Checkpointer(tmp_path / name)
  ckpt.save(0, state)
  ckpt.wait()
  saved = numpy_tree(dp._built.to_user(state))
  split, _ = trainer_and_state(split=True)
  assert split.plan.num_replicas == 4
  with rules():
    restored = ckpt.restore(split)
  assert_trees_close(numpy_tree(split._built.to_user(restored)), saved, dict(rtol=0, atol=0))
  specs = jax.tree.leaves(jax.tree.map(lambda x: x.sharding.spec, restored.params))
  assert any("model" in str(s) for s in specs)   # restored straight into the split shardings
