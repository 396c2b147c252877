"""Communication options against single-device references on the same global batch."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import epljax as epl
from epljax import communication, hlo
from helpers import MLP, TOL, assert_trees_close, classification_batch, linen_fns

ROWS, REPLICAS = 64, 8
LR = 0.1
INIT_FN, LOSS_FN = linen_fns(MLP())
# One compiled reference gradient for every batch of the same shape.
_GRAD = jax.jit(jax.value_and_grad(
    lambda params, variables, batch: LOSS_FN({**variables, "params": params}, batch)))


def _setup(config, **trainer_kwargs):
  epl.init(config)
  init_fn, loss_fn = INIT_FN, LOSS_FN
  batch = classification_batch(ROWS)
  trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(LR), **trainer_kwargs)
  state = trainer.init(jax.random.key(0), batch)
  variables = jax.jit(init_fn)(jax.random.key(0), batch)
  return trainer, state, batch, variables, loss_fn


def _grads(loss_fn, variables, batch):
  assert loss_fn is LOSS_FN
  return _GRAD(variables["params"], variables, batch)


def _replica_grads(loss_fn, variables, batch):
  """Each replica's gradient on its own contiguous block of rows."""
  blocks = np.split(np.arange(ROWS), REPLICAS)
  return [_grads(loss_fn, variables, jax.tree.map(lambda x, b=b: x[b], batch))[1]
          for b in blocks]


def _clip(grads, max_norm):
  return optax.clip_by_global_norm(max_norm).update(grads, optax.EmptyState())[0]


def _mean(trees):
  return jax.tree.map(lambda *xs: sum(xs) / len(xs), *trees)


def _after_one_step(variables, grads):
  return jax.tree.map(lambda p, g: p - LR * g, variables["params"], grads)


@pytest.fixture(scope="module")
def norms():
  """The global norms of the full-batch and per-replica gradients, to pick a clip norm that
  clips every replica but not in the same proportion."""
  epl.init()
  init_fn, loss_fn = INIT_FN, LOSS_FN
  batch = classification_batch(ROWS)
  variables = jax.jit(init_fn)(jax.random.key(0), batch)
  full = float(optax.tree.norm(_grads(loss_fn, variables, batch)[1]))
  local = [float(optax.tree.norm(g)) for g in _replica_grads(loss_fn, variables, batch)]
  return full, local


@pytest.mark.parametrize("offload", ["", "v1"])   # v1: the gradients come in host memory
@pytest.mark.parametrize("after", [True, False])
def test_clip_after_allreduce_decides_what_the_clipping_sees(after, offload, norms):
  full, local = norms
  max_norm = 0.5 * min(local + [full])      # clips the reduced and every local gradient
  trainer, state, batch, variables, loss_fn = _setup(
      {"communication.clip_after_allreduce": after, "offload.level": offload},
      clip_norm=max_norm)
  loss, full_grads = _grads(loss_fn, variables, batch)
  reduced_then_clipped = _clip(full_grads, max_norm)
  clipped_then_reduced = _mean([_clip(g, max_norm) for g in
                                _replica_grads(loss_fn, variables, batch)])
  expected, other = ((reduced_then_clipped, clipped_then_reduced) if after else
                     (clipped_then_reduced, reduced_then_clipped))

  got_loss, got = trainer.loss_and_grads(state, batch)
  np.testing.assert_allclose(got_loss, loss, **TOL)
  assert_trees_close(got, expected)
  differs = [not np.allclose(a, b, rtol=1e-3, atol=1e-5)
             for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(other))]
  assert any(differs), "both orders gave the same gradients: the test cannot tell them apart"
  state, metrics = trainer.train_step(state, batch)
  np.testing.assert_allclose(metrics["loss"], loss, **TOL)
  assert_trees_close(trainer.variables(state)["params"], _after_one_step(variables, expected))
  assert f"clip_after_allreduce={after}" in "\n".join(trainer.plan.features)


def test_local_path_without_clipping_matches_the_reference():
  """The per-replica computation itself (shard_map, explicit psum) changes nothing."""
  trainer, state, batch, variables, loss_fn = _setup({}, clip_norm=1e6)
  loss, grads = _grads(loss_fn, variables, batch)
  got_loss, got = trainer.loss_and_grads(state, batch)
  np.testing.assert_allclose(got_loss, loss, **TOL)
  assert_trees_close(got, grads)
  state, metrics = trainer.train_step(state, batch)
  assert_trees_close(trainer.variables(state)["params"], _after_one_step(variables, grads))


@pytest.fixture(scope="module")
def fp16_run():
  trainer, state, batch, variables, loss_fn = _setup(
      {"communication.fp16": True, "communication.fp16_scale": 64,
       "pipeline.num_micro_batch": 2})
  return trainer, state, batch, variables, loss_fn


def test_fp16_allreduce_is_float32_within_half_precision(fp16_run):
  trainer, state, batch, variables, loss_fn = fp16_run
  loss, grads = _grads(loss_fn, variables, batch)
  got_loss, got = trainer.loss_and_grads(state, batch)
  np.testing.assert_allclose(got_loss, loss, **TOL)
  eps = float(jnp.finfo(jnp.float16).eps)
  for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(grads)):
    scale = float(np.abs(e).max())
    np.testing.assert_allclose(g, e, rtol=0, atol=2 * eps * scale)
  errors = [float(np.abs(g - e).max())
            for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(grads))]
  assert max(errors) > 0, "bit-identical to float32: the reduction did not run in float16"


def test_fp16_allreduce_is_a_half_precision_collective_in_the_hlo(fp16_run):
  trainer, state, batch, *_ = fp16_run
  found = hlo.collectives(trainer.lower(state, batch).compile().as_text())
  shapes = [s for c in found if c.kind == "all-reduce" for s in c.shapes]
  params = {f"{x.dtype.name[0]}{x.dtype.itemsize * 8}[{','.join(map(str, x.shape))}]"
            for x in jax.tree.leaves(state.params)}
  assert any(s.startswith("f16[") for s in shapes), shapes
  gradient_sized = [s for s in shapes if s.split("[")[1] in {p.split("[")[1] for p in params}
                    and s.split("[")[1] != "]"]
  assert gradient_sized and all(s.startswith("f16[") for s in gradient_sized), shapes
  assert "float16" in "\n".join(trainer.plan.features)


def test_clip_after_allreduce_without_a_norm_says_how():
  epl.init({"communication.clip_after_allreduce": True})
  trainer = epl.Trainer(INIT_FN, LOSS_FN, optax.sgd(LR))
  with pytest.raises(epl.PlanError, match=r"(?s)give the norm to the Trainer.*clip_norm=1.0"):
    trainer.init(jax.random.key(0), classification_batch(ROWS))
  with pytest.raises(epl.PlanError, match=r"clip_norm=-1.0 must be a positive number"):
    communication.features(epl.Env.get().config.communication, clip_norm=-1.0)


def test_collective_options_map_to_xla_options_that_reach_the_compiler(monkeypatch):
  config = epl.init({"communication.num_communicators": 4,
                     "communication.max_splits": 2}).config.communication
  params = {"w": jax.ShapeDtypeStruct((100, 10), jnp.float32),
            "b": jax.ShapeDtypeStruct((10,), jnp.float32)}
  options = communication.compiler_options(communication.features(config), params)
  assert options == {communication.OVERLAP_LIMIT: 4, communication.COMBINE_BYTES: 2020}
  assert communication.compiler_options(
      communication.features(epl.Config().communication), params) == {}
  # Real XLA option names (an unknown name fails the compile), and the Trainer passes them on.
  trainer, state, batch, *_ = _setup({"communication.num_communicators": 4,
                                      "communication.max_splits": 2})
  trainer.train_step(state, batch)
  features = "\n".join(trainer.plan.features)
  assert "xla_gpu_experimental_parallel_collective_overlap_limit=4" in features
  monkeypatch.setattr(communication, "compiler_options", lambda *a: {"xla_not_an_option": 1})
  trainer, state, batch, *_ = _setup({})
  with pytest.raises(Exception, match="No such compile option: 'xla_not_an_option'"):
    trainer.train_step(state, batch)


def test_sparse_as_dense_is_accepted_and_changes_nothing():
  trainer, state, batch, variables, loss_fn = _setup({"communication.sparse_as_dense": True})
  _, grads = _grads(loss_fn, variables, batch)
  assert_trees_close(trainer.loss_and_grads(state, batch)[1], grads)
  assert "sparse_as_dense" in "\n".join(trainer.plan.features)


def test_local_clipping_measures_the_norm_without_the_loss_scale():
  """Gradients that carry a loss scale (fstate[LOSS_SCALE]) are clipped as if unscaled and keep
  their scale, so the feature that unscales them later gets the clipped gradients."""
  grads = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([12.0])}          # norm 13
  scale = jnp.float32(1024.0)
  got = communication.clip_by_global_norm(jax.tree.map(lambda g: g * scale, grads), 6.5, scale)
  assert_trees_close(jax.tree.map(lambda g: g / scale, got), _clip(grads, 6.5))
  assert_trees_close(communication.clip_by_global_norm(grads, 20.0), grads)


def test_fp16_allreduce_under_a_dynamic_loss_scale_does_not_overflow():
  """Mixed precision's loss scale (2**15) is taken out before the float16 all-reduce: no step
  is skipped and the gradients are float32's within half precision."""
  trainer, state, batch, variables, loss_fn = _setup(
      {"communication.fp16": True, "amp.level": "O1", "amp.loss_scale": "dynamic"})
  _, expected = _grads(loss_fn, variables, batch)
  _, grads = trainer.loss_and_grads(state, batch)
  for g, e in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
    # bfloat16 compute (AMP) and a float16 reduction: within bfloat16's precision.
    np.testing.assert_allclose(g, e, rtol=0.05, atol=0.02 * float(np.abs(e).max()) + 1e-6)
  for _ in range(3):
    state, metrics = trainer.train_step(state, batch)
  assert int(metrics["amp_skipped_steps"]) == 0
  assert float(metrics["loss_scale"]) == 2.0 ** 15
