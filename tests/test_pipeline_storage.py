"""Pipeline storage in the user's parameter tree: any optax optimizer, ZeRO, and parameters tied
across stages, each against the single-device reference (loss, gradients, parameters); and
``pipeline.param_layout='stage'``, the train state as the loop's slots, with what it refuses."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import epljax as epl
from epljax.pipeline import storage
from helpers import TOL, assert_trees_close, classification_batch, linen_fns
from pipeline_helpers import Stack, TwoStages, adamw, check_matches_reference, sgd_clipped


def _decay_matrices(params):
  return jax.tree.map(lambda x: x.ndim > 1, params)


def _by_layer(params):
  return jax.tree_util.tree_map_with_path(
      lambda path, _: "head" if "Dense_2" in jax.tree_util.keystr(path) else "body", params)


OPTIMIZERS = {
    # Each looks at a parameter's path, shape or norm: not an elementwise update of one buffer.
    "adamw_mask": lambda: optax.adamw(1e-2, weight_decay=0.1, mask=_decay_matrices),
    "multi_transform": lambda: optax.multi_transform(
        {"body": optax.adam(1e-2), "head": optax.sgd(0.1, momentum=0.9)}, _by_layer),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=2),
    "lamb_clipped": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.lamb(1e-2)),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_any_optax_optimizer_trains_stages_like_one_device(name):
  epl.init({"pipeline.num_micro_batch": 4})
  trainer, state = check_matches_reference(TwoStages(), classification_batch(32),
                                           OPTIMIZERS[name]())
  # The state is the user's tree: parameters and optimizer state, leaves sharded over stage.
  params = trainer.variables(state)["params"]
  assert jax.tree.structure(state.params) == jax.tree.structure(params)
  kernel = state.params["Dense_1"]["kernel"]
  assert kernel.shape == (32, 24) and "stage" in kernel.sharding.spec
  assert kernel.addressable_shards[0].data.shape == (16, 24)


@pytest.mark.parametrize("level", ["v1", "v3"])
def test_zero_shards_stage_state_over_data(level):
  epl.init({"pipeline.num_micro_batch": 4, "zero.level": level})
  with pytest.warns(UserWarning, match="a pipeline stage") if level == "v3" else _nothing():
    trainer, state = check_matches_reference(Stack(stages=2), classification_batch(32),
                                             optax.adam(1e-2))
  assert dict(trainer.plan.mesh.shape) == {"data": 4, "stage": 2, "model": 1}
  mu = state.opt_state[0].mu["Block_0"]["Dense_0"]["kernel"]
  assert mu.sharding.spec == jax.sharding.PartitionSpec("stage", "data")
  kernel = state.params["Block_0"]["Dense_0"]["kernel"]
  assert ("data" in kernel.sharding.spec) == (level == "v3")


class _nothing:
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False


class TiedLM(nn.Module):
  """GPT-2's shared embedding: looked up in the first stage, the output projection of the
  last (one parameter used by two stages)."""
  vocab: int = 20
  width: int = 16

  @nn.compact
  def __call__(self, x):
    embed = nn.Embed(self.vocab, self.width, name="wte")
    tokens = jnp.argmax(x, axis=-1) % self.vocab
    with epl.replicate(1, name="stage_0"):
      h = embed(tokens) + nn.Dense(self.width)(x)
      h = jnp.tanh(nn.Dense(self.width)(h))
    with epl.replicate(1, name="stage_1"):
      h = nn.LayerNorm()(jnp.tanh(nn.Dense(self.width)(h)))
      return embed.attend(h)[:, :10]


def test_a_parameter_tied_across_stages_is_held_by_both_and_its_gradients_summed(monkeypatch):
  # The gradients sliced out of the exchanged buffer at offsets the compiler cannot fold, as
  # on GPUs (XLA:CPU drops the barrier that hides them, so there they are plain numbers).
  monkeypatch.setattr(storage, "BARRIER_DROPPED", frozenset())
  epl.init({"pipeline.num_micro_batch": 4})
  trainer, state = check_matches_reference(TiedLM(), classification_batch(32), optax.adam(1e-2))
  pipe = trainer.plan.pipeline
  paths = pipe.param_paths
  wte = paths.index("params/wte/embedding")
  assert pipe.shared == {wte: (0, 1)}
  assert all(wte in stage.params for stage in pipe.stages)
  assert not any(a.shape == (20, 16) for s in pipe.stages for a in s.incoming)   # not sent
  assert ("tied      'params/wte/embedding' held by stages 'stage_0', 'stage_1'; their "
          "gradients are summed") in str(trainer.plan)


def test_a_parameter_shared_by_a_split_task_graph_is_still_refused():
  class Shared(nn.Module):
    @nn.compact
    def __call__(self, x):
      w = self.param("w", nn.initializers.normal(), (20, 8))
      with epl.replicate(1, name="stage_0"):
        h = x @ w
      with epl.split(1, name="stage_1"):
        return (h @ w.T)[:, :10]

  epl.init({"cluster.colocate_split_and_replicate": True})
  init_fn, loss_fn = linen_fns(Shared())
  trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(0.1))
  with pytest.raises(epl.PlanError, match=r"Parameter 'params/w' \(shape \(20, 8\)\) is used by "
                     r"two task graphs: 'stage_0' \(replicate\(1\)\) and 'stage_1' "
                     r"\(split\(1\)\)"):
    trainer.init(jax.random.key(0), classification_batch(16))


# -- pipeline.param_layout='stage': the train state is the loop's slots ----------------------
STAGE_LAYOUT = {"pipeline.param_layout": "stage", "pipeline.num_micro_batch": 4}


@pytest.mark.parametrize("case", ["rolled_1f1b_adamw", "tied_gpipe_clipped"])
def test_stage_layout_holds_each_stage_whole_and_trains_like_one_device(case):
  model, strategy, optimizer = {
      # Two layers per stage rolled into one loop; identical stages share every slot.
      "rolled_1f1b_adamw": (Stack(stages=2, layers=2), "PreferBackward", adamw()),
      # A parameter tied across stages is held once (by its first stage) and copied to the
      # other in the step, so global-norm clipping sees it once.
      "tied_gpipe_clipped": (TiedLM(), "PreferForward", sgd_clipped()),
  }[case]
  epl.init({**STAGE_LAYOUT, "pipeline.strategy": strategy})
  trainer, state = check_matches_reference(model, classification_batch(32), optimizer)
  stages = trainer.plan.pipeline.schedule.num_stages
  for name, slot in state.params.items():   # (stages, *shape), each device its stage's row
    assert slot.sharding.spec[0] == "stage", (name, slot.sharding)
    assert slot.shape[0] == stages and slot.addressable_shards[0].data.shape[0] == 1
  built = trainer._require()
  user = built.to_user(state)   # what checkpoints hold: the user's trees
  assert jax.tree.structure(user["opt_state"]) == jax.tree.structure(   # (keeping the grads)
      jax.eval_shape(built.user_state.optimizer.init, user["params"]))
  back = built.from_user(user)
  for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert "whole in the loop's slots (pipeline.param_layout='stage'" in str(trainer.plan)
  assert trainer.plan.pipeline.param_bytes_per_device == sum(
      x.addressable_shards[0].data.nbytes for x in state.params.values())
  if case == "rolled_1f1b_adamw":   # loss_and_grads on the slots: the user's tree, exact
    batch = classification_batch(32)
    loss, grads = trainer.loss_and_grads(state, batch)
    init_fn, loss_fn = linen_fns(model)
    variables = trainer.variables(state)
    want_loss, want = jax.jit(jax.value_and_grad(lambda p: loss_fn(
        {**variables, "params": p}, batch)))(variables["params"])
    np.testing.assert_allclose(loss, want_loss, **TOL)
    assert_trees_close(grads, want, TOL)


def test_stage_layout_shards_the_slots_optimizer_state_over_data_under_zero_v1():
  # Megatron's distributed optimizer on the hand-written GPipe's layout: each stage's slots'
  # moments split over its 4 data replicas, the slots themselves whole on every replica.
  epl.init({**STAGE_LAYOUT, "zero.level": "v1"})
  trainer, state = check_matches_reference(Stack(stages=2), classification_batch(32),
                                           optax.adam(1e-2))
  assert dict(trainer.plan.mesh.shape) == {"data": 4, "stage": 2, "model": 1}
  for name, mu in state.opt_state[0].mu.items():
    divisible = any(d % 4 == 0 for d in mu.shape[1:])
    assert ("data" in mu.sharding.spec) == divisible, (name, mu.shape, mu.sharding.spec)
    assert "data" not in state.params[name].sharding.spec


def _mask_tree():   # optax's other form of a mask: a tree of the user's structure
  params = jax.eval_shape(Stack(stages=4).init, jax.random.key(0),
                          classification_batch(32)["x"])["params"]
  return optax.adamw(1e-2, weight_decay=0.1, mask=_decay_matrices(params))


NOT_ELEMENTWISE = {
    **OPTIMIZERS,
    # A mask whose decay hides in the parameters (a small part of each) and a learning rate
    # warming up from zero: the update, compared against its own size, still differs.
    "adamw_mask_warmup": lambda: optax.adamw(optax.linear_schedule(0.0, 1e-2, 100),
                                             weight_decay=0.01, mask=_decay_matrices),
    "adamw_mask_tree": _mask_tree,
}


@pytest.mark.parametrize("name", list(NOT_ELEMENTWISE))
def test_stage_layout_refuses_an_optimizer_that_reads_more_than_each_element(name):
  # Identical stages, so a slot holds a leaf of each stage: a per-leaf norm (LAMB) would mix
  # them. Refused at init, before anything compiles.
  epl.init(STAGE_LAYOUT)
  trainer = epl.Trainer(*linen_fns(Stack(stages=4)), NOT_ELEMENTWISE[name]())
  with pytest.raises(epl.PlanError, match=r"param_layout='stage' runs the optimizer on the "
                     r"stages' slots(.|\n)*Keep(.|\n)*param_layout='user'"):
    trainer.init(jax.random.key(0), classification_batch(32))


@pytest.mark.parametrize("config, message", [
    ({"offload.level": "v0"}, r"offload place\(s\) or update\(s\) the parameters leaf by "
     r"leaf"),
    ({"pipeline.num_virtual_stages": 2, "pipeline.num_micro_batch": 8},
     r"pipeline.num_virtual_stages=2 \(interleaved chunks\)"),
])
def test_stage_layout_refuses_what_its_slots_cannot_hold(config, message):
  epl.init({**STAGE_LAYOUT, **config})
  trainer = epl.Trainer(*linen_fns(Stack(stages=4)), optax.adam(1e-2))
  with pytest.raises(epl.PlanError, match=message):
    trainer.init(jax.random.key(0), classification_batch(32))
