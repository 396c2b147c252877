"""Pipeline parallelism against the single-device reference on the same global batch."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import epljax as epl
from helpers import TOL, assert_trees_close, classification_batch, cross_entropy, reference_run
from pipeline_helpers import CASES, adamw, run_case


@pytest.mark.parametrize("case", list(CASES))
def test_matches_single_device_reference(case):
  """Loss, gradients and parameters after 2 steps equal single-device training (1e-5); one
  compile of the step; shardings and dtypes kept (``run_case`` checks all of it)."""
  config, _, _, (replicas, stages, per_stage), _, distinct = CASES[case]
  trainer, state = run_case(case)
  plan = trainer.plan
  assert (plan.num_replicas, plan.num_stages) == (replicas, stages)
  assert dict(plan.mesh.shape) == {"data": replicas, "stage": stages, "model": per_stage}
  assert len(plan.pipeline.loop.branches) == distinct
  if config.get("zero.level") == "v1":
    # Each stage's optimizer state over its replicas (Megatron's distributed optimizer):
    # adamw's two moments and the test's recorded gradient, 3x the parameters per device
    # unsharded, are under half of that (all but the small leaves no dimension of which the
    # replicas divide), as the plan's bytes say.
    assert "ZeRO v1: optimizer state sharded over 'data'" in str(plan)
    assert plan.optimizer_bytes < 3 * plan.param_bytes / 2, (plan.optimizer_bytes,
                                                             plan.param_bytes)
    specs = {tuple(x.sharding.spec) for x in jax.tree.leaves(state.opt_state)
             if x.shape == (20, 32)}   # the first kernel's moments and gradient
    assert specs == {("data", "stage")}, specs
  # Activations and gradients move between stages; gradients are reduced over replicas; the
  # stored parameters (the user's leaves, sharded over stage) are gathered into their stage's
  # buffer and the gradients scattered back, moving at most the parameters' bytes each way.
  kinds = {c.kind for c in plan.collectives}
  assert {"collective-permute", "all-reduce"} <= kinds <= {
      "collective-permute", "all-reduce", "all-gather", "all-to-all"}
  moved = sum(c.bytes for c in plan.collectives if c.kind in ("all-gather", "all-to-all"))
  total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(trainer.variables(state)))
  assert moved <= 4 * total
  # One conditional for the forward slot and one for the backward slot of a tick, each with a
  # branch per distinct stage and an empty one for idle (bubble) slots (the step's own, which
  # skips a non-finite update on XLA:CPU, sits outside the loop).
  branches = re.findall(r"conditional\(.*?branch_computations=\{([^}]*)\}.*op_name=\"[^\"]*"
                        r"/while/body/", plan.compiled.as_text())
  assert [len(b.split(",")) for b in branches] == [distinct + 1] * 2


class Routed(nn.Module):
  """Four stages with a skip over two of them, an integer activation and an aux value made
  on the first stage: all must be routed to the last stage through the ones in between. The
  scale made from the batch alone on s0 is recomputed on s3 instead."""

  @nn.compact
  def __call__(self, x):
    with epl.replicate(1, name="s0"):
      h0 = nn.relu(nn.Dense(16)(x))
      k = jnp.argmax(h0[:, :10], axis=-1)          # int32, no gradient
      scale = 1.0 + 0.1 * jnp.abs(x[:, :1])        # from the batch alone
    with epl.replicate(1, name="s1"):
      h1 = jnp.tanh(nn.Dense(16)(h0))
    with epl.replicate(1, name="s2"):
      h2 = jnp.tanh(nn.Dense(16)(h1))
    with epl.replicate(1, name="s3"):
      logits = nn.Dense(10)(h2) + 0.1 * nn.Dense(10)(h0) + 0.5 * jax.nn.one_hot(k, 10)
      logits = logits * scale
    return logits, jnp.mean(h0)


def test_skips_integer_activations_and_aux_are_routed_to_the_last_stage():
  epl.init({"pipeline.num_micro_batch": 4})
  model = Routed()
  batch = classification_batch(32)

  def init_fn(rng, b):
    return model.init(rng, b["x"])

  def loss_fn(variables, b):
    logits, h0_mean = model.apply(variables, b["x"])
    correct = jnp.argmax(logits, -1) == b["y"]
    return cross_entropy(logits, b["y"]), {
        "accuracy": jnp.mean(correct.astype(jnp.float32)),   # float scalar: averaged
        "correct": jnp.sum(correct.astype(jnp.int32)),        # integer scalar: summed
        "predicted": jnp.argmax(logits, -1),                  # per row: concatenated
        "h0_mean": h0_mean}

  trainer = epl.Trainer(init_fn, loss_fn, adamw(), has_aux=True)
  state = trainer.init(jax.random.key(0), batch)
  history, _ = reference_run(init_fn, lambda v, b: loss_fn(v, b)[0], adamw(), jax.random.key(0),
                             batch, 1)
  loss, grads = trainer.loss_and_grads(state, batch)
  np.testing.assert_allclose(loss, history[0][0], **TOL)
  assert_trees_close(grads, history[0][1])
  incoming = [[(a.shape, str(a.dtype)) for a in stage.incoming]
              for stage in trainer.plan.pipeline.stages]
  # h0, k, mean(h0) from s0 and h2 from s2 reach s3; the (4, 1) scale does not travel.
  assert sorted(incoming[3]) == sorted([((4, 16), "float32"), ((4,), "int32"), ((), "float32"),
                                        ((4, 16), "float32")])
  variables = jax.tree.map(np.asarray, trainer.variables(state))   # the step donates the state
  _, metrics = trainer.train_step(state, batch)
  # Micro batch m: chunk m of each of the 2 replicas' 16 rows; aux is the mean over both.
  for m in range(4):
    rows = np.concatenate([np.arange(r * 16 + m * 4, r * 16 + m * 4 + 4) for r in range(2)])
    expected = loss_fn(variables, jax.tree.map(lambda x, rows=rows: x[rows], batch))[1]
    assert_trees_close(jax.tree.map(lambda a, m=m: a[m], metrics["aux"]), expected)


class NNXStages(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.body = nnx.Linear(20, 16, rngs=rngs)
    self.head = nnx.Linear(16, 10, rngs=rngs)

  def __call__(self, x):
    with epl.replicate(1, name="body"):
      h = nnx.relu(self.body(x))
    with epl.replicate(1, name="head"):
      return self.head(h)


def test_nnx_model_in_two_stages_matches_single_device():
  epl.init({"pipeline.num_micro_batch": 2, "pipeline.strategy": "PreferForward"})
  batch = classification_batch(32)

  def loss_fn(model, b):
    return cross_entropy(model(b["x"]), b["y"])

  trainer = epl.Trainer(lambda rng, b: NNXStages(nnx.Rngs(rng)), loss_fn, optax.sgd(0.1))
  state = trainer.init(jax.random.key(0), batch)
  state, metrics = trainer.train_step(state, batch)
  assert trainer.plan.num_stages == 2
  model = NNXStages(nnx.Rngs(jax.random.key(0)))
  loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
  np.testing.assert_allclose(metrics["loss"], loss, **TOL)
  nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(model, nnx.Param), grads))
  trained = trainer.variables(state)
  assert isinstance(trained, NNXStages)
  assert_trees_close(nnx.state(trained, nnx.Param), nnx.state(model, nnx.Param))


def test_a_jitted_call_across_a_stage_boundary_is_inlined():
  @jax.jit
  def body(p, x):
    with epl.replicate(1, name="stage_0"):
      h = jnp.tanh(x @ p["w0"])
    with epl.replicate(1, name="stage_1"):
      return h @ p["w1"]

  def init_fn(rng, b):
    k0, k1 = jax.random.split(rng)
    return {"params": {"w0": jax.random.normal(k0, (20, 16)) * 0.3,
                       "w1": jax.random.normal(k1, (16, 10)) * 0.3}}

  def loss_fn(variables, b):
    return cross_entropy(body(variables["params"], b["x"]), b["y"])

  epl.init({"pipeline.num_micro_batch": 2})
  batch = classification_batch(16)
  trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(0.1))
  state = trainer.init(jax.random.key(0), batch)
  history, _ = reference_run(init_fn, loss_fn, optax.sgd(0.1), jax.random.key(0), batch, 1)
  loss, grads = trainer.loss_and_grads(state, batch)
  assert trainer.plan.num_stages == 2
  np.testing.assert_allclose(loss, history[0][0], **TOL)
  assert_trees_close(grads, history[0][1])
