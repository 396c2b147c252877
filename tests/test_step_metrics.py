"""Non-finite steps are never applied; the step's metrics (grad_norm, finite, examples, tokens,
step_time); eval_step."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import epljax as epl
from epljax import step as epl_step
from helpers import (DEEP_TOL, MLP, TOL, classification_batch, cross_entropy, each_on_one_jax,
                     linen_fns)

EXACT = dict(rtol=0, atol=0)


def nan_batch(rows=32, seed=1):
  batch = classification_batch(rows, seed=seed)
  batch["x"][3, 5] = np.nan
  return batch


def host(tree):
  return jax.tree.map(lambda x: np.array(x), tree)


def assert_same_bits(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def make(config=None, *, model=None, strategy=True, optimizer=None, **kwargs):
  epl.init(config or {})
  if strategy:
    epl.set_default_strategy(epl.replicate(1))
  init_fn, loss_fn = linen_fns(model or MLP())
  trainer = epl.Trainer(init_fn, loss_fn, optimizer or optax.adam(1e-2), **kwargs)
  return trainer, trainer.init(jax.random.key(0), classification_batch(32))


class TwoStages(nn.Module):
  @nn.compact
  def __call__(self, x):
    with epl.replicate(1, name="stage_0"):
      h = nn.relu(nn.Dense(16)(x))
    with epl.replicate(1, name="stage_1"):
      return nn.Dense(10)(h)


CASES = {
    "data_parallel": dict(),
    "zero_v1": dict(config={"zero.level": "v1"}),
    "pipeline": dict(config={"pipeline.num_micro_batch": 2}, model=TwoStages(), strategy=False),
    # fp16 all-reduce: the NaN travels through the float16 reduction.
    "fp16_allreduce": dict(config={"communication.fp16": True}),
}


# How the step skips: by a lax.cond on XLA:CPU, by a select on GPU/TPU (``step.SKIP_BY_COND``),
# both tested here (the select path by taking cpu out of ``step.SKIP_BY_COND``).
SKIPS = ["cond", "select"]


@pytest.fixture(params=SKIPS)
def skip(request, monkeypatch):
  if request.param == "select":
    monkeypatch.setattr(epl_step, "SKIP_BY_COND", ())
  return request.param


@pytest.mark.parametrize("case", list(CASES))
def test_a_nan_batch_leaves_the_state_bit_identical(case, skip):
  trainer, state = make(**CASES[case], max_nonfinite_steps=3)
  expected_line = "lax.cond" if skip == "cond" else "select fused"
  assert any(expected_line in f for f in trainer.plan.features if f.startswith("non-finite"))
  state, metrics = trainer.train_step(state, classification_batch(32))   # one good step
  assert bool(metrics["finite"]) and int(metrics["step"]) == 1
  before = host(state)
  state, metrics = trainer.train_step(state, nan_batch())
  assert not bool(metrics["finite"])
  assert not np.isfinite(float(metrics["loss"]))
  after = host(state)
  assert_same_bits(after.params, before.params)
  assert_same_bits(after.opt_state, before.opt_state)
  assert int(after.step) == 2                    # the step is counted, not applied
  # ... and the next good step trains as if the bad one had not happened.
  good = classification_batch(32, seed=2)
  state, metrics = trainer.train_step(state, good)
  assert bool(metrics["finite"])
  never_bad = jax.device_put(before, trainer._require().state_shardings)
  never_bad, expected = trainer.train_step(never_bad, good)
  assert float(metrics["loss"]) == float(expected["loss"])
  assert_same_bits(host(state).params, host(never_bad).params)


def test_fp16_allreduce_overflow_is_caught_and_skipped():
  # fp16_scale x gradient beyond float16's 65504: the all-reduce overflows to inf.
  trainer, state = make({"communication.fp16": True, "communication.fp16_scale": 2 ** 20})
  before = host(state)
  batch = classification_batch(32)
  batch["x"] = batch["x"] * 100.0
  state, metrics = trainer.train_step(state, batch)
  assert np.isfinite(float(metrics["loss"])) and not bool(metrics["finite"])
  assert_same_bits(host(state).params, before.params)
  assert_same_bits(host(state).opt_state, before.opt_state)


@pytest.mark.parametrize("bad, finite, norm", [
    (np.inf, False, np.nan), (-np.inf, False, np.nan), (np.nan, False, np.nan),
    (3e20, True, np.inf),     # finite gradients whose squares overflow float32: still finite
    (3.0, True, np.sqrt(9.0 + 2 * 4.0 + 3 * 1.0))])
@pytest.mark.parametrize("by_cond", [True, False], ids=["cond", "select"])
def test_the_finite_flag_is_per_element_and_the_norm_float32(bad, finite, norm, by_cond):
  grads = {"a": np.array([bad, 2.0], np.float32), "b": np.array([2.0], np.float16),
           "c": np.ones(3, jax.numpy.bfloat16)}
  check = jax.jit(lambda loss, g: epl_step.norm_and_finite(loss, g, by_cond))
  got_norm, got_finite = check(np.float32(1.0), grads)
  assert bool(got_finite) is finite
  np.testing.assert_allclose(float(got_norm), norm, rtol=1e-6)
  assert not bool(check(np.float32(np.nan), grads)[1])


@pytest.mark.parametrize("bad, finite, norm", [
    (np.inf, False, np.nan), (np.nan, False, np.nan), (3e20, True, np.inf), (0.5, True, None)])
@pytest.mark.parametrize("by_cond", [True, False], ids=["cond", "select"])
def test_leaves_of_one_layout_share_one_reduction(bad, finite, norm, by_cond):
  """40 gradients of one shape and sharding are reduced in 2 groups (``NORM_GROUP`` = 32), a
  leaf of another shape or sharding alone: 4 reductions, not 42, with the flag still per
  element and the norm the exact one."""
  mesh = jax.make_mesh((8,), ("data",))
  grads = {f"w{i:02d}": np.full((8, 3), i / 7, np.float32) for i in range(40)}
  grads["w17"][5, 1] = bad
  grads["b"] = np.ones(3, np.float32)
  grads["v"] = np.full((8, 3), 2.0, np.float32)
  layouts = jax.tree.map(lambda _: NamedSharding(mesh, P()), grads)
  layouts["v"] = NamedSharding(mesh, P("data"))

  def check(loss, g):
    return epl_step.norm_and_finite(loss, g, by_cond, layouts)

  sums = [e for e in jax.make_jaxpr(check)(np.float32(1.0), grads).jaxpr.eqns
          if e.primitive.name == "reduce_sum"]
  assert len(sums) == 4
  got_norm, got_finite = jax.jit(check)(np.float32(1.0), grads)
  assert bool(got_finite) is finite
  if norm is None:   # finite: the float64 norm of every element
    norm = np.sqrt(sum(np.sum(np.square(g.astype(np.float64))) for g in grads.values()))
  np.testing.assert_allclose(float(got_norm), norm, rtol=1e-6)


@pytest.mark.parametrize("by_cond", [True, False], ids=["cond", "select"])
def test_a_finite_float64_gradient_beyond_float32_is_finite(by_cond):
  with jax.enable_x64(True):   # 1e300 is finite in float64; its float32 cast is not
    norm, finite = jax.jit(lambda loss, g: epl_step.norm_and_finite(loss, g, by_cond))(
        np.float32(1.0), {"a": np.array([1e300, 1.0])})
  assert bool(finite) and float(norm) == np.inf


def test_training_stops_after_max_nonfinite_steps_in_a_row():
  trainer, state = make(max_nonfinite_steps=3)
  # XLA:CPU: the host waits for each step but the last (step.waits_each_step); GPU/TPU do not.
  assert any(f.startswith("host: at most two steps in flight") for f in trainer.plan.features)
  runs = []
  # The third step breaks the first run; the host's one read (after step 3, when the run could
  # first reach 3) finds a run of 1, so the next is at step 5.
  for batch in (nan_batch(), classification_batch(32), nan_batch(), nan_batch(), nan_batch()):
    state, metrics = trainer.train_step(state, batch)
    runs.append(int(state.feature_state["nonfinite_run"]))
    if len(runs) == 4:
      kept = jax.tree.map(jnp.copy, state)   # run 2, after step 4
  assert runs == [1, 0, 1, 2, 3]
  # The run is read one call late (the host never waits for the device).
  with pytest.raises(epl.NonFiniteError, match=r"Step 5 is the 3th step in a row .* not "
                     r"finite \(Trainer\(max_nonfinite_steps=3\)\)"):
    trainer.train_step(state, classification_batch(32))
  # A state the trainer did not just return brings its own run, read after its first step.
  state, _ = trainer.train_step(kept, nan_batch())
  with pytest.raises(epl.NonFiniteError, match=r"Step 5 is the 3th step in a row"):
    trainer.train_step(state, classification_batch(32))


def test_max_nonfinite_steps_is_checked():
  with pytest.raises(epl.EPLError, match=r"max_nonfinite_steps=0: use a positive int"):
    epl.Trainer(lambda r, b: {}, lambda v, b: 0.0, optax.sgd(0.1), max_nonfinite_steps=0)


@pytest.fixture(scope="module")
def dp_run():
  trainer, state = make(optimizer=optax.sgd(0.1))
  batch = classification_batch(32)
  loss, grads = trainer.loss_and_grads(state, batch)
  evaluated = trainer.eval_step(state, batch)
  params = host(state.params)
  state, metrics = trainer.train_step(state, batch)
  norm = np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64)))
                     for g in jax.tree.leaves(grads)))
  return dict(loss=float(loss), norm=float(norm), eval=evaluated,
              metrics=metrics, params=params, state=state, trainer=trainer)


def test_metrics_carry_grad_norm_counts_and_step_time(dp_run):
  m = dp_run["metrics"]
  np.testing.assert_allclose(float(m["loss"]), dp_run["loss"], **TOL)
  np.testing.assert_allclose(float(m["grad_norm"]), dp_run["norm"], **TOL)
  assert bool(m["finite"]) and int(m["step"]) == 1
  assert m["examples"] == 32 and "tokens" not in m      # no integer token array
  assert isinstance(m["step_time"], float) and m["step_time"] > 0


def test_eval_step_is_the_forward_loss_without_an_update(dp_run):
  ev = dp_run["eval"]
  np.testing.assert_allclose(float(ev["loss"]), dp_run["loss"], **TOL)
  assert ev["examples"] == 32 and set(ev) == {"loss", "examples"}


class TokenModel(nn.Module):
  @nn.compact
  def __call__(self, ids):
    return nn.Dense(16)(nn.Embed(16, 8)(ids))


def test_tokens_are_counted_from_the_token_ids_and_eval_gives_aux():
  epl.init()
  epl.set_default_strategy(epl.replicate(1))
  model = TokenModel()

  def loss_fn(v, b):
    logits = model.apply(v, b["ids"])
    return cross_entropy(logits, b["ids"]), {"first": logits[:, 0, 0]}

  trainer = epl.Trainer(lambda r, b: model.init(r, b["ids"]), loss_fn, optax.sgd(0.1),
                        has_aux=True)
  batch = {"ids": np.arange(16 * 6, dtype=np.int32).reshape(16, 6) % 16}
  state = trainer.init(jax.random.key(0), batch)
  ev = trainer.eval_step(state, batch)
  loss, _ = trainer.loss_and_grads(state, batch)
  np.testing.assert_allclose(float(ev["loss"]), float(loss), **TOL)
  assert ev["tokens"] == 96 and ev["examples"] == 16 and ev["aux"]["first"].shape == (16,)
  _, metrics = trainer.train_step(state, batch)
  assert metrics["tokens"] == 96
  with pytest.raises(epl.EPLError, match=r"tokens_key='tokens' is not a key of the batch"):
    epl.Trainer(lambda r, b: model.init(r, b["ids"]), loss_fn, optax.sgd(0.1), has_aux=True,
                tokens_key="tokens")._counts(batch)


# Each model on the other jax version than in test_checkpoint's restore of every zoo model.
@pytest.mark.parametrize("name", each_on_one_jax(
    ["gemma", "llama", "gpt2", "vit", "mlp_loop"], start=1))
def test_eval_step_of_every_zoo_model_is_its_single_device_loss(name):
  """eval_step on the zoo's structures (tied embeddings, nn.scan with logical axis names, ...),
  split by the model's one annotate line: the loss of the same variables on one device."""
  import contextlib

  from flax.core import meta
  from models import ZOO

  zoo = ZOO[name]
  batch = zoo.make_batch(16)
  def rules():
    return (nn.logical_axis_rules(zoo.logical_rules) if zoo.logical_rules
            else contextlib.nullcontext())

  epl.init()
  epl.annotate(zoo.annotate_rules(2))
  trainer = epl.Trainer(zoo.init_fn, zoo.loss_fn, optax.sgd(0.1))
  with rules():
    state = trainer.init(jax.random.key(0), batch)
    metrics = trainer.eval_step(state, batch)
  one = jax.devices()[0]
  variables = jax.device_put(jax.device_get(meta.unbox(trainer.variables(state))), one)
  with rules():
    expected = jax.jit(zoo.loss_fn)(variables, jax.device_put(batch, one))
  tol = DEEP_TOL if zoo.deep else TOL
  np.testing.assert_allclose(metrics["loss"], expected, **tol)
  assert metrics["examples"] == 16
