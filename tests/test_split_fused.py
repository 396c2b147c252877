"""GPT-2's fused ``c_attn`` (Hugging Face's ``(C, 3C)`` Conv1D, and ``(3C, C)`` read transposed
as ``FlaxConv1D`` and nanoGPT hold it) split with one ``epl.annotate`` rule: each of q, k and v
split by heads (``sharding.fused``), the step's collectives at Megatron's minimum, exact against
the single-device reference under split(2) and in 3D (2 replicas x 2 stages x split(2)), the
user's order in ``Trainer.variables`` and in checkpoints."""

import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.core import meta

import epljax as epl
from epljax import hlo
from epljax.sharding.fused import FusedLayoutError
from helpers import TOL, assert_trees_close, each_on_one_jax, momentum_grads, reference_run
from models import ZOO, common, gpt2_fused

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import comm  # noqa: E402

STEPS = 2
MODELS = ("gpt2_fused", "gpt2_fused_t")
C = gpt2_fused.D_MODEL
# SGD with momentum: after the first step its trace is that step's gradient, which the tests
# read instead of compiling ``trainer.loss_and_grads`` too (test_trainer_dp tests that).
OPTIMIZER = optax.sgd(0.1, momentum=0.9)


# Each model on one of CI's jax versions here, and on the other in the 3D test.
@pytest.fixture(scope="module", params=each_on_one_jax(MODELS))
def split_run(request):
  """A fused-``c_attn`` GPT-2 split over 2 devices (4 replicas) by its one annotate rule
  (``bench/comm.py``'s ``zoo_split``, with SGD's momentum), beside the single-device reference;
  its forward and step HLO collectives; a copy of the state after the first step, for the
  checkpoint test."""
  name = request.param
  zoo = ZOO[name]
  trainer, state, batch = comm.zoo_split(name, optimizer=OPTIMIZER)
  history, expected = reference_run(zoo.init_fn, zoo.loss_fn, OPTIMIZER, jax.random.key(0),
                                    batch, STEPS)
  forward = hlo.executed_collectives(trainer.lower_loss(state, batch).compile().as_text())
  step = hlo.executed_collectives(trainer.lower(state, batch).compile().as_text())
  initial = trainer.variables(state)
  kernel = state.params["h_0"]["attn"]["c_attn"]["kernel"]   # (the step donates the state)
  stored = [(shard.index, np.asarray(shard.data)) for shard in kernel.addressable_shards]
  losses = []
  for i in range(STEPS):
    state, metrics = trainer.train_step(state, batch)
    losses.append(metrics["loss"])
    if i == 0:   # before the next step donates it
      # The first step's gradient, as loss_and_grads gives it before the step (in the user's
      # order), read from the momentum trace instead of compiling loss_and_grads as well.
      loss0, grads0 = metrics["loss"], jax.device_get(momentum_grads(trainer, state))
      first = jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False), state)
  return dict(name=name, zoo=zoo, trainer=trainer, state=state, history=history,
              expected=expected, loss0=loss0, grads0=grads0, forward=forward, step=step,
              losses=losses, initial=initial, stored=stored, first=first)


def test_each_part_of_the_fused_kernel_is_split_by_heads(split_run):
  trainer, zoo = split_run["trainer"], split_run["zoo"]
  expected = zoo.expected_specs(trainer.variables(split_run["state"]))
  leaves = {leaf.path: leaf for leaf in trainer.plan.leaves}
  wrong = {p: (leaves[p].spec, s) for p, s in expected.items()
           if tuple(leaves[p].spec) + (None,) * (len(s) - len(leaves[p].spec))
           != tuple(s) + (None,) * (len(leaves[p].spec) - len(s))}
  assert not wrong, wrong
  fused = sorted(p for p, leaf in leaves.items() if "fused parts" in leaf.rule)
  assert fused == [f"params/h_{i}/attn/c_attn/{w}" for i in range(2) for w in ("bias", "kernel")]
  assert leaves["params/h_0/attn/c_attn/kernel"].rule == "column, 3 fused parts"
  # Stored with device d's shard of q, of k and of v together; the user sees the user's order.
  user = np.asarray(split_run["initial"]["params"]["h_0"]["attn"]["c_attn"]["kernel"])
  dim = 0 if split_run["name"] == "gpt2_fused_t" else 1
  half = C // 2
  for index, data in split_run["stored"]:
    d = index[dim].start // (3 * half)
    parts = [np.take(user, range(j * C + d * half, j * C + (d + 1) * half), axis=dim)
             for j in range(3)]
    np.testing.assert_array_equal(data, np.concatenate(parts, axis=dim))


def test_split_step_equals_the_single_device_reference(split_run):
  run = split_run
  np.testing.assert_allclose(run["loss0"], run["history"][0][0], **TOL)
  assert_trees_close(run["grads0"], run["history"][0][1], TOL)   # in the user's order
  for step in range(STEPS):
    np.testing.assert_allclose(run["losses"][step], run["history"][step][0], **TOL)
  assert_trees_close(run["trainer"].variables(run["state"]), run["expected"], TOL)


def test_step_communicates_exactly_megatrons_minimum(split_run):
  """Forward: the blocks' all-reduces and the vocabulary-parallel embedding and loss; the whole
  step: those, each column region's input gradient once, and the gradients over replicas.
  Nothing is permuted, exchanged or gathered."""
  run = split_run
  plan = run["trainer"].plan
  rows = comm.ZOO_ROWS // plan.num_replicas
  activation = f"f32[{rows},{gpt2_fused.LENGTH},{C}]"
  for found, forward in ((run["forward"], True), (run["step"], False)):
    minimum = comm.megatron_minimum(run["name"], rows, plan.param_bytes, forward_only=forward)
    assert {c.kind for c in found} == {"all-reduce"}, hlo.summarize(found)
    assert comm.activation_arrays(found, activation) == minimum["activation arrays"]
    assert comm.tensor_bytes(found) == minimum["bytes"]


def test_checkpoints_hold_the_users_order(split_run, tmp_path):
  """A split run's checkpoint restores into a data-parallel trainer (which stores ``c_attn``
  as the user wrote it), parameters and optimizer state alike."""
  run = split_run
  zoo, batch = run["zoo"], zoo_batch(run["zoo"])
  # The split trainer (annotate_rules(2), SGD with momentum) after one step: the fixture's.
  split, state, history = run["trainer"], run["first"], run["history"]
  ckpt = epl.Checkpointer(tmp_path)
  ckpt.save(1, state)
  ckpt.wait()
  epl.init()
  plain = epl.Trainer(zoo.init_fn, zoo.loss_fn, OPTIMIZER)
  plain.init(jax.random.key(0), batch)
  restored = ckpt.restore(plain)
  assert_trees_close(plain.variables(restored), split.variables(state), dict(rtol=0, atol=0))
  trace = optax.tree_utils.tree_get(restored.opt_state, "trace")
  assert_trees_close(trace, history[0][1], TOL)   # SGD's trace after a step: its gradient
  # ... and back into the split trainer, continuing exactly as the uninterrupted run.
  again = ckpt.restore(split)
  assert_trees_close(split.variables(again), split.variables(state), dict(rtol=0, atol=0))


def zoo_batch(zoo):
  return zoo.make_batch(comm.ZOO_ROWS)


@pytest.mark.parametrize("name", each_on_one_jax(MODELS, start=1))
def test_3d_is_exact_against_the_reference(name):
  """2 replicas x 2 pipeline stages x split(2) on 8 devices: the fused kernels held part by
  part inside each tensor-parallel stage, no collective-permute there (which would hang)."""
  zoo = ZOO[name]
  batch = zoo.make_batch(16)
  optimizer = OPTIMIZER
  history, expected = reference_run(zoo.init_fn, zoo.loss_fn, optimizer, jax.random.key(0),
                                    batch, STEPS)
  epl.init({"pipeline.num_stages": 2, "pipeline.num_micro_batch": 2})
  epl.annotate(zoo.stage_split_rules(2))
  trainer = epl.Trainer(zoo.init_fn, zoo.loss_fn, optimizer)
  state = trainer.init(jax.random.key(0), batch)
  plan = trainer.plan
  assert dict(plan.mesh.shape) == {"data": 2, "stage": 2, "model": 2}
  assert plan.pipeline.split == (2, 2)
  rules = {leaf.path: leaf.rule for leaf in plan.leaves}
  assert rules["params/h_1/attn/c_attn/kernel"] == "column, 3 fused parts"
  for step in range(STEPS):
    state, metrics = trainer.train_step(state, batch)
    np.testing.assert_allclose(metrics["loss"], history[step][0], **TOL)
    if step == 0:   # its gradient, from the momentum trace (not a loss_and_grads compile)
      assert_trees_close(momentum_grads(trainer, state), history[0][1], TOL)
  assert_trees_close(meta.unbox(trainer.variables(state)), expected, TOL)


def test_blocks_under_nn_remat_keep_the_fused_layout():
  """Hugging Face's gradient checkpointing (each block under ``nn.remat``): the fused kernel is
  read inside the rematerialized body, exact and at Megatron's minimum all the same."""
  model = gpt2_fused.GPT2(remat=True)
  init_fn, loss_fn = gpt2_fused.init_fn_of(model), gpt2_fused.loss_fn_of(model)
  zoo = ZOO["gpt2_fused"]
  batch = zoo_batch(zoo)
  optimizer = optax.sgd(0.1)
  history, expected = reference_run(init_fn, loss_fn, optimizer, jax.random.key(0), batch, 1)
  epl.init()
  epl.annotate(zoo.annotate_rules(2))
  trainer = epl.Trainer(init_fn, loss_fn, optimizer)
  state = trainer.init(jax.random.key(0), batch)
  assert trainer.plan.leaves[[leaf.path for leaf in trainer.plan.leaves].index(
      "params/h_0/attn/c_attn/kernel")].rule == "column, 3 fused parts"
  found = hlo.executed_collectives(trainer.lower(state, batch).compile().as_text())
  assert {c.kind for c in found} == {"all-reduce"}, hlo.summarize(found)
  state, metrics = trainer.train_step(state, batch)
  np.testing.assert_allclose(metrics["loss"], history[0][0], **TOL)
  assert_trees_close(trainer.variables(state), expected, TOL)


class FlippedFused(nn.Module):
  """A fused gate/up projection (through ``jax.nn.relu``, a ``custom_jvp``, which the stored
  order follows) whose features are reversed before they are cut into their two parts."""

  @nn.compact
  def __call__(self, x):
    with epl.split(2, name="mlp"):
      h = jnp.flip(jax.nn.relu(gpt2_fused.Conv1D(4 * C, name="c_fc")(x)), axis=-1)
      gate, up = jnp.split(h, 2, axis=-1)
      return gpt2_fused.Conv1D(C, name="c_proj")(gate * up)


def test_a_fused_value_the_stored_order_cannot_follow_is_an_error():
  model = FlippedFused()
  batch = common.regression_batch(8, C, C)
  epl.init()
  trainer = epl.Trainer(lambda r, b: model.init(r, b["x"]),
                        lambda v, b: jnp.mean((model.apply(v, b["x"]) - b["y"]) ** 2),
                        optax.sgd(0.1))
  with pytest.raises(FusedLayoutError, match=r"(?s)Parameter 'params/c_fc/kernel' \(shape "
                     r"\(32, 128\)\) is a fusion of 2 equal parts.*rev in FlippedFused.*"
                     r"jnp.split right after the matmul.*epl.annotate"):
    state = trainer.init(jax.random.key(0), batch)
    trainer.train_step(state, batch)
