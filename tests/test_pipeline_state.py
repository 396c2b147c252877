"""Model state inside pipeline stages: BatchNorm statistics and NNX RNG streams per micro
batch, exactly as single-device gradient accumulation over the same micro batches, with one replica
or several (batch means averaged over the replicas); state that is not a batch mean refused
with several replicas."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import epljax as epl
from helpers import TOL, assert_trees_close, classification_batch, cross_entropy, momentum_grads
from pipeline_helpers import BACKWARD, FORWARD, count_compiles
from test_pipeline_chunks import ScannedWithStats

from epljax.pipeline.auto import StageBalanceWarning

MICRO = 4


class BatchNormStages(nn.Module):
  """Two stages, each with its own BatchNorm (statistics of the micro batch while training),
  each stage on ``devices`` devices: with 4, one replica, which sees whole micro batches; with
  1, four replicas, each seeing its own rows (the second stage's statistics are over incoming
  rows)."""
  devices: int = 4

  @nn.compact
  def __call__(self, x):
    with epl.replicate(self.devices, name="stage_0"):
      h = nn.relu(nn.BatchNorm(use_running_average=False, momentum=0.8)(nn.Dense(16)(x)))
    with epl.replicate(self.devices, name="stage_1"):
      h = nn.BatchNorm(use_running_average=False, momentum=0.8)(nn.Dense(16)(h))
      return nn.Dense(10)(nn.relu(h))


def _fns(model):
  def init_fn(rng, batch):
    return model.init(rng, batch["x"])

  def loss_fn(variables, batch):
    logits, updates = model.apply(variables, batch["x"], mutable=["batch_stats"])
    return cross_entropy(logits, batch["y"]), updates

  return init_fn, loss_fn


def _micro_batches(batch, replicas):
  """The micro batches of the Trainer (``epljax.batch.micro_batches``): micro batch ``m`` takes
  rows ``m`` of every replica's block."""
  def one(x):
    rows = len(x) // (replicas * MICRO)
    x = x.reshape(replicas, MICRO, rows, *x.shape[1:]).swapaxes(0, 1)
    return x.reshape(MICRO, replicas * rows, *x.shape[3:])
  return jax.tree.map(one, batch)


def _reference(init_fn, loss_fn, optimizer, batch, replicas, steps):
  """Single-device gradient accumulation with the statistics threaded through the micro
  batches in order: [(loss, grads)] per step and the final variables."""
  variables = jax.jit(init_fn)(jax.random.key(0), jax.tree.map(lambda x: x[:8], batch))
  params, stats = variables["params"], variables["batch_stats"]
  opt_state = optimizer.init(params)
  micro = _micro_batches(batch, replicas)

  @jax.jit
  def step(params, stats, opt_state):
    total, losses = jax.tree.map(jnp.zeros_like, params), []
    for m in range(MICRO):
      one = jax.tree.map(lambda x, m=m: x[m], micro)
      (loss, updates), grads = jax.value_and_grad(
          lambda p, s=stats, b=one: loss_fn({"params": p, "batch_stats": s}, b),
          has_aux=True)(params)
      stats = updates["batch_stats"]
      total = jax.tree.map(jnp.add, total, grads)
      losses.append(loss)
    grads = jax.tree.map(lambda g: g / MICRO, total)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return jnp.mean(jnp.stack(losses)), grads, optax.apply_updates(params, updates), stats, \
        opt_state

  history = []
  for _ in range(steps):
    loss, grads, params, stats, opt_state = step(params, stats, opt_state)
    history.append((loss, grads))
  return history, {"params": params, "batch_stats": stats}


@pytest.mark.parametrize("replicas,config", [
    (1, BACKWARD), (1, FORWARD), (4, BACKWARD), (4, FORWARD),
    (4, {**BACKWARD, "gradient_checkpoint.type": "auto"})],
    ids=["1f1b", "gpipe", "4_replicas_1f1b", "4_replicas_gpipe", "4_replicas_1f1b_gc_auto"])
def test_batch_norm_stages_match_single_device_micro_batches(replicas, config):
  """One replica sees whole micro batches; with 4, each stage's batch means are averaged over
  the replicas (``pipeline/stats.py``)."""
  epl.init({**config, "pipeline.num_micro_batch": MICRO})
  init_fn, loss_fn = _fns(BatchNormStages(devices=4 // replicas))
  optimizer = optax.sgd(0.1, momentum=0.9)
  batch = classification_batch(32)
  trainer = epl.Trainer(init_fn, loss_fn, optimizer, mutable=["batch_stats"])
  state = trainer.init(jax.random.key(0), batch)
  assert (trainer.plan.num_stages, trainer.plan.num_replicas) == (2, replicas)
  shardings = jax.tree.map(lambda x: x.sharding, state)
  history, expected = _reference(init_fn, loss_fn, optimizer, batch, replicas, steps=2)
  with count_compiles() as compiles:
    for step in range(2):
      state, metrics = trainer.train_step(state, batch)
      np.testing.assert_allclose(metrics["loss"], history[step][0], **TOL)
      if step == 0:   # the first step's gradient, from SGD's momentum trace (g + 0.9 * 0)
        assert_trees_close(momentum_grads(trainer, state), history[0][1], TOL)
  assert len([c for c in compiles if "epl_step" in c]) == 1
  assert_trees_close(trainer.variables(state), expected, TOL)
  # the statistics moved (4 micro batches per step, each an update of the running averages)
  assert not np.allclose(expected["batch_stats"]["BatchNorm_0"]["mean"], 0)
  assert jax.tree.map(lambda x: x.sharding, state) == shardings
  means = "; its 2 batch means averaged over the replicas (data)" if replicas > 1 else ""
  assert ("state     stage 1 'stage_1' keeps 2 model state leaves (128 B), updated by each "
          f"micro batch's forward in order{means}\n") in str(trainer.plan) + "\n"


def test_batch_norm_under_nn_scan_with_several_replicas_matches_single_device():
  """BatchNorm in layers under ``nn.scan`` (a stage of its own, 4 replicas): the statistics
  are averaged over the replicas in every iteration of the scan."""
  epl.init({"auto.auto_parallel": True, "pipeline.num_stages": 2,
            "pipeline.num_micro_batch": MICRO})
  with pytest.warns(StageBalanceWarning, match="reads model state"):
    _matches_reference_with_4_replicas(ScannedWithStats())


def _matches_reference_with_4_replicas(model):
  """Two SGD steps of ``model`` (4 pipeline replicas) against single-device micro batches."""
  init_fn, loss_fn = _fns(model)
  optimizer = optax.sgd(0.1)
  batch = classification_batch(32)
  trainer = epl.Trainer(init_fn, loss_fn, optimizer, mutable=["batch_stats"])
  state = trainer.init(jax.random.key(0), batch)
  assert trainer.plan.num_replicas == 4
  history, expected = _reference(init_fn, loss_fn, optimizer, batch, 4, steps=2)
  for step in range(2):
    state, metrics = trainer.train_step(state, batch)
    np.testing.assert_allclose(metrics["loss"], history[step][0], **TOL)
  assert_trees_close(trainer.variables(state), expected, TOL)
  return trainer


class SplitBatchNormStages(nn.Module):
  """BatchNorm inside two split(k) stages (Megatron MLP after it): 8 / (2k) replicas."""
  k: int = 4

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(16)(x)
    for i in range(2):
      with epl.split(self.k, name=f"stage_{i}"):
        y = nn.gelu(nn.Dense(64)(nn.BatchNorm(use_running_average=False)(h)))
        h = h + nn.Dense(16)(y)
    return nn.Dense(8)(h)


@pytest.mark.parametrize("k", [4, 2])
def test_batch_norm_in_split_stages_matches_single_device_micro_batches(k):
  epl.init({**BACKWARD, "pipeline.num_micro_batch": MICRO})
  init_fn, loss_fn = _fns(SplitBatchNormStages(k))
  optimizer = optax.sgd(0.1)
  batch = classification_batch(32, classes=8)
  trainer = epl.Trainer(init_fn, loss_fn, optimizer, mutable=["batch_stats"])
  state = trainer.init(jax.random.key(0), batch)
  replicas = 4 // k
  assert dict(trainer.plan.mesh.shape) == {"data": replicas, "stage": 2, "model": k}
  history, expected = _reference(init_fn, loss_fn, optimizer, batch, replicas, steps=2)
  for step in range(2):
    state, metrics = trainer.train_step(state, batch)
    np.testing.assert_allclose(metrics["loss"], history[step][0], **TOL)
  assert_trees_close(trainer.variables(state), expected, TOL)


class RowStatistic(nn.Module):
  """A statistic of stage 0's rows kept (or, with ``passed_on``, passed to stage 1 and kept
  there) as model state; ``kind`` says how it is made from the rows."""
  kind: str
  passed_on: bool = False

  @nn.compact
  def __call__(self, x):
    with epl.replicate(1, name="stage_0"):
      h = nn.Dense(8)(x)
      stat = {"sum": lambda: jnp.sum(h, axis=0), "slice_mean": lambda: jnp.mean(h[:1], axis=0),
              "mean": lambda: jnp.mean(h, axis=0)}[self.kind]()
      if not self.passed_on:
        kept = self.variable("batch_stats", "stat", jnp.zeros, (8,))
        kept.value = 0.5 * kept.value + stat
    with epl.replicate(1, name="stage_1"):
      if self.passed_on:
        kept = self.variable("batch_stats", "stat", jnp.zeros, (8,))
        kept.value = 0.5 * kept.value + stat
      return nn.Dense(10)(h)


@pytest.mark.parametrize("model,why", [
    (RowStatistic("sum"), r"reduce_sum over the rows in RowStatistic.*, not divided by the "
                          r"number of rows"),
    (RowStatistic("slice_mean"), r"slice along the rows in RowStatistic"),
    (RowStatistic("mean", passed_on=True), r"reduce_sum over the rows in RowStatistic.*"
                                           r"stage_0\], a mean that does not make its own "
                                           r"stage's model state"),
], ids=["sum", "slice_mean", "mean_of_an_earlier_stage"])
def test_state_from_one_replicas_rows_is_refused_with_several_replicas(model, why):
  """A sum, a mean of some rows, a mean made by an earlier stage (not averaged there): each
  is per replica, so the state would differ from one device's."""
  epl.init({"pipeline.num_micro_batch": 2})
  init_fn, loss_fn = _fns(model)
  trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(0.1), mutable=["batch_stats"])
  stage = "stage_1" if model.passed_on else "stage_0"
  with pytest.raises(epl.PlanError, match=(
      rf"(?s)Model state 'batch_stats/stat' of pipeline stage '{stage}', with 4 replicas .* "
      rf"computed from its replica's rows alone: {why}.*epl.replicate\(k, name=...\)")):
    trainer.init(jax.random.key(0), classification_batch(16))


class FrozenThenKeepdims(nn.Module):
  """Stage 0: BatchNorm with its running averages (state kept as it is); stage 1: statistics
  written with ``keepdims`` (sum, broadcast, divide). Four replicas."""

  @nn.compact
  def __call__(self, x):
    with epl.replicate(1, name="stage_0"):
      h = nn.relu(nn.BatchNorm(use_running_average=True)(nn.Dense(16)(x)))
    with epl.replicate(1, name="stage_1"):
      h = nn.Dense(16)(h)
      mean = jnp.mean(h, axis=0, keepdims=True)
      var = jnp.mean(jnp.square(h - mean), axis=0, keepdims=True)
      kept = self.variable("batch_stats", "mean", jnp.zeros, (1, 16))
      kept.value = 0.9 * kept.value + 0.1 * mean
      return nn.Dense(10)((h - mean) * jax.lax.rsqrt(var + 1e-5))


def test_kept_state_and_keepdims_means_with_several_replicas_match_single_device():
  epl.init({**BACKWARD, "pipeline.num_micro_batch": MICRO})
  trainer = _matches_reference_with_4_replicas(FrozenThenKeepdims())
  assert "its 2 batch means averaged over the replicas (data)" in str(trainer.plan)


class NNXDropoutStages(nnx.Module):
  """Dropout with the module's own RNG stream (NNX ``Rngs``: a key and a counter as model
  state) in the first stage; each stage on 4 devices (one replica)."""

  def __init__(self, rngs: nnx.Rngs, devices: int = 4):
    self.devices = devices
    self.body = nnx.Linear(20, 16, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)
    self.head = nnx.Linear(16, 10, rngs=rngs)

  def __call__(self, x):
    with epl.replicate(self.devices, name="stage_0"):
      h = self.drop(nnx.relu(self.body(x)))
    with epl.replicate(self.devices, name="stage_1"):
      return self.head(h)


def _nnx_loss(model, batch):
  return cross_entropy(model(batch["x"]), batch["y"])


def _nnx_reference(model, batch, steps, lr=0.1):
  """Single-device SGD with gradient accumulation; the RNG state advances per micro batch."""
  micro = _micro_batches(batch, 1)
  grad_fn = nnx.value_and_grad(_nnx_loss)
  losses = []
  for _ in range(steps):
    total, step_losses = None, []
    for m in range(MICRO):
      loss, grads = grad_fn(model, jax.tree.map(lambda x, m=m: x[m], micro))
      total = grads if total is None else jax.tree.map(jnp.add, total, grads)
      step_losses.append(loss)
    nnx.update(model, jax.tree.map(lambda p, g: p - lr * g / MICRO,
                                   nnx.state(model, nnx.Param), total))
    losses.append(np.mean(step_losses))
  return losses, model


def test_nnx_rng_state_in_stages_matches_single_device_micro_batches():
  epl.init({**BACKWARD, "pipeline.num_micro_batch": MICRO})
  batch = classification_batch(32)
  make = lambda rng: NNXDropoutStages(nnx.Rngs(rng, dropout=1))  # noqa: E731
  trainer = epl.Trainer(lambda rng, b: make(rng), _nnx_loss, optax.sgd(0.1))
  state = trainer.init(jax.random.key(0), batch)
  losses, model = _nnx_reference(make(jax.random.key(0)), batch, steps=2)
  for step in range(2):
    state, metrics = trainer.train_step(state, batch)
    np.testing.assert_allclose(metrics["loss"], losses[step], **TOL)
  trained = trainer.variables(state)
  assert_trees_close(nnx.state(trained, nnx.Param), nnx.state(model, nnx.Param))
  counts = lambda m: [int(c) for c in jax.tree.leaves(nnx.state(m, nnx.RngCount))]  # noqa: E731
  assert counts(trained) == counts(model) and 2 * MICRO in counts(trained)


def test_nnx_rng_state_with_several_replicas_is_refused():
  epl.init({**BACKWARD, "pipeline.num_micro_batch": MICRO})
  make = lambda rng: NNXDropoutStages(nnx.Rngs(rng, dropout=1), devices=2)  # noqa: E731
  trainer = epl.Trainer(lambda rng, b: make(rng), _nnx_loss, optax.sgd(0.1))
  with pytest.raises(epl.PlanError, match=r"(?s)Pipeline stage 'stage_0', with 2 replicas .*, "
                     r"draws random numbers \(.* in .*\) from its model state \(an RNG stream: "
                     r"'.*'"):
    trainer.init(jax.random.key(0), classification_batch(32))
