"""Pipeline storage in the user's parameter tree: any optax optimizer, ZeRO, and parameters tied
across stages, each against the single-device reference (loss, gradients, parameters)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import epljax as epl
from epljax.pipeline import storage
from helpers import classification_batch, linen_fns
from pipeline_helpers import Stack, TwoStages, check_matches_reference


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
