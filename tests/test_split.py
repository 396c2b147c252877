"""split: tensor, vocabulary, classifier and expert parallelism against the single-device
reference, the specs the split rules choose, and the collectives they cost."""

import re

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import epljax as epl
from epljax.nn import MoE
from helpers import DEEP_TOL, assert_trees_close, cross_entropy, momentum_grads, reference_run

COLOCATE = {"cluster.colocate_split_and_replicate": True}
STEPS = 2


def tokens_batch(rows=16, length=8, vocab=64, seed=0):
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, vocab, (rows, length + 1)).astype(np.int32)
  return {"x": ids[:, :-1], "y": ids[:, 1:]}


def features_batch(rows=32, features=16, classes=1024, seed=0):
  rng = np.random.default_rng(seed)
  return {"x": rng.normal(size=(rows, features)).astype(np.float32),
          "y": rng.integers(0, classes, rows).astype(np.int32)}


def train_and_compare(model, batch, aux_weight=None, loss=cross_entropy):
  """Trains ``model`` with epljax and on one device; returns the trainer and final state."""
  # SGD, not Adam: Adam turns the rounding noise of exactly-zero gradients (an attention key
  # bias) into full-size updates, which no two summation orders agree on.
  optimizer = optax.sgd(0.1, momentum=0.9)

  def init_fn(rng, b):
    return model.init(rng, b["x"])

  def loss_fn(variables, b):
    out = model.apply(variables, b["x"])
    if aux_weight is not None:
      out, aux = out
      return loss(out, b["y"]) + aux_weight * aux
    return loss(out, b["y"])

  trainer = epl.Trainer(init_fn, loss_fn, optimizer)
  state = trainer.init(jax.random.key(0), batch)
  history, expected = reference_run(init_fn, loss_fn, optimizer, jax.random.key(0), batch, STEPS)
  for step in range(STEPS):
    state, metrics = trainer.train_step(state, batch)
    np.testing.assert_allclose(metrics["loss"], history[step][0], **DEEP_TOL)
    if step == 0:   # its gradient, from the momentum trace (test_trainer_dp: loss_and_grads)
      assert_trees_close(momentum_grads(trainer, state), history[0][1], DEEP_TOL)
  assert_trees_close(trainer.variables(state), expected, DEEP_TOL)
  return trainer, state


def specs_of(trainer, *path):
  tree = trainer.plan.param_specs["params"]
  for key in path:
    tree = tree[key]
  return tree


class MegatronMLP(nn.Module):
  """Embed -> split(4)[Dense -> relu -> Dense] -> logits: one all-reduce per forward."""
  vocab: int = 64

  @nn.compact
  def __call__(self, ids):
    x = nn.Embed(self.vocab, 32)(ids)
    with epl.split(4, name="mlp"):
      h = nn.relu(nn.Dense(64, name="wi")(x))
      x = x + nn.Dense(32, name="wo")(h)
    return nn.Dense(self.vocab, name="head")(nn.LayerNorm()(x))


def test_megatron_mlp_column_then_row_with_nested_data_parallelism():
  trainer, state = train_and_compare(MegatronMLP(), tokens_batch())
  # The forward communicates once for the MLP: an all-reduce of this replica's activations
  # (8 sequences x 8 tokens x 32 features), besides scalar reductions of the loss.
  forward = epl.hlo.collectives(trainer.lower_loss(state, tokens_batch()).compile().as_text())
  tensors = [c for c in forward if any(not s.endswith("[]") for s in c.shapes)]
  assert [(c.kind, c.shapes) for c in tensors] == [("all-reduce", ("f32[8,8,32]",))]
  plan = trainer.plan
  assert dict(plan.mesh.shape) == {"data": 2, "stage": 1, "model": 4}
  assert plan.num_replicas == 2 and plan.batch_axes == ("data",)
  assert specs_of(trainer, "wi", "kernel") == P(None, "model")
  assert specs_of(trainer, "wi", "bias") == P("model")
  assert specs_of(trainer, "wo", "kernel") == P("model", None)
  assert specs_of(trainer, "wo", "bias") == P()
  # Code outside the scope joined the split task graph by data flow only: not split.
  assert specs_of(trainer, "Embed_0", "embedding") == P()
  assert specs_of(trainer, "head", "kernel") == P()
  rules = {leaf.path: leaf.rule for leaf in plan.leaves}
  assert rules["params/wi/kernel"] == "column" and rules["params/wo/kernel"] == "row"
  assert rules["params/wi/bias"] == "follows"


class Block(nn.Module):
  """A transformer block whose attention and MLP are split over 4 devices."""

  @nn.compact
  def __call__(self, ids):
    x = nn.Embed(64, 32)(ids)
    with epl.split(4, name="block"):
      x = x + nn.MultiHeadDotProductAttention(num_heads=8, name="attn")(x)
      h = nn.gelu(nn.Dense(128, name="wi")(nn.LayerNorm(name="ln")(x)))
      x = x + nn.Dense(32, name="wo")(h)
    return nn.Dense(64, name="head")(x)


def test_attention_is_split_by_heads():
  trainer, _ = train_and_compare(Block(), tokens_batch())
  for proj in ("query", "key", "value"):
    assert specs_of(trainer, "attn", proj, "kernel") == P(None, "model", None)
    assert specs_of(trainer, "attn", proj, "bias") == P("model", None)
  assert specs_of(trainer, "attn", "out", "kernel") == P("model", None, None)
  assert specs_of(trainer, "attn", "out", "bias") == P()
  assert specs_of(trainer, "ln", "scale") == P()      # the norm follows its replicated input
  assert specs_of(trainer, "wi", "kernel") == P(None, "model")


class SplitEmbedding(nn.Module):
  @nn.compact
  def __call__(self, ids):
    with epl.split(4, name="embed"):
      x = nn.Embed(64, 32, name="table")(ids)
    return nn.Dense(64, name="head")(nn.tanh(x))


def test_embedding_table_is_split_by_vocabulary():
  trainer, _ = train_and_compare(SplitEmbedding(), tokens_batch())
  assert specs_of(trainer, "table", "embedding") == P("model", None)
  assert {leaf.path: leaf.rule for leaf in trainer.plan.leaves}[
      "params/table/embedding"] == "vocabulary"


class LargeClassifier(nn.Module):
  """EPL's large-scale classification: replicate(8) features, split(8) classifier."""
  classes: int = 1024

  @nn.compact
  def __call__(self, x):
    with epl.replicate(8, name="features"):
      x = nn.relu(nn.Dense(64)(x))
      x = nn.relu(nn.Dense(32)(x))
    with epl.split(8, name="classifier"):
      return nn.Dense(self.classes, name="fc")(x)


def epl_cross_entropy(logits, labels):
  return epl.nn.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


# optax's loss picks the label's logit with a gather; epljax's with a comparison against the
# class index, a mask that must not keep the classifier whole (it did from 2026-11-22 to
# 2026-11-27: the mask was taken for an activation the split would be mixed into).
@pytest.fixture(scope="module", params=[cross_entropy, epl_cross_entropy],
                ids=["optax_loss", "epl_nn_loss"])
def classifier_hlo(request):
  """The compiled step of the split classifier (trained and compared first)."""
  epl.init(COLOCATE)
  trainer, state = train_and_compare(LargeClassifier(), features_batch(), loss=request.param)
  plan = trainer.plan
  text = trainer.lower(state, features_batch()).compile().as_text()
  return plan, text


def test_split_classifier_matches_and_splits_the_classes(classifier_hlo):
  plan, _ = classifier_hlo
  assert dict(plan.mesh.shape) == {"data": 1, "stage": 1, "model": 8}
  assert [(t.name, t.strategy, t.device_count) for t in plan.taskgraphs] == [
      ("features", "replicate", 8), ("classifier", "split", 8)]
  assert plan.batch_axes == ("data", "model")
  assert plan.param_specs["params"]["fc"]["kernel"] == P(None, "model")
  assert plan.param_specs["params"]["Dense_0"]["kernel"] == P()


def test_split_classifier_never_gathers_the_kernel_or_the_logits(classifier_hlo):
  _, text = classifier_hlo
  found = epl.hlo.collectives(text)
  whole = {"f32[32,1024]", "f32[1024,32]"}   # kernel (32, 1024), logits (32, 1024)
  gathered = [c for c in found if c.kind in ("all-gather", "all-to-all", "all-reduce")
              and set(c.shapes) & whole]
  assert not gathered, gathered
  assert max(c.bytes for c in found) < 32 * 1024 * 4 / 2


class MoELM(nn.Module):
  """EPL's MoE pattern: the default strategy replicate(8), gating outside, experts split(8)."""

  @nn.compact
  def __call__(self, ids):
    x = nn.Embed(64, 16)(ids)
    y, aux = MoE(num_experts=8, hidden=32, top_k=2, experts=epl.split(8, name="experts"))(x)
    return nn.Dense(64)(x + y), aux


@pytest.fixture(scope="module")
def moe_run():
  epl.init(COLOCATE)
  epl.set_default_strategy(epl.replicate(8))
  trainer, state = train_and_compare(MoELM(), tokens_batch(rows=16, length=16),
                                     aux_weight=0.01)
  text = trainer.lower(state, tokens_batch(rows=16, length=16)).compile().as_text()
  return trainer.plan, text


def test_moe_experts_are_split_on_the_experts_dimension(moe_run):
  plan, _ = moe_run
  moe = plan.param_specs["params"]["MoE_0"]
  assert moe["w_in"] == P("model", None, None) and moe["w_out"] == P("model", None, None)
  assert moe["gate"] == P()
  assert [(t.name, t.strategy) for t in plan.taskgraphs] == [
      ("taskgraph_0", "replicate"), ("experts", "split")]


def test_moe_moves_tokens_with_all_to_all_and_never_gathers_an_expert(moe_run):
  _, text = moe_run
  found = epl.hlo.collectives(text)
  assert any(c.kind == "all-to-all" for c in found)
  weights = {"f32[8,16,32]", "f32[8,32,16]"}
  assert not [c for c in found if c.kind == "all-gather" and set(c.shapes) & weights]


class ResidualStem(nn.Module):
  @nn.compact
  def __call__(self, x):
    with epl.split(8, name="body"):
      x = x + nn.Dense(16, name="stem")(x)   # its output joins the input's stream
      return nn.Dense(16, name="head")(x)


def test_a_weight_a_split_keeps_whole_says_why_in_the_plan():
  """A column split whose output would be mixed into an unsplit activation (a stem feeding a
  residual stream) keeps the weight whole: exact, and the plan's "why" says so and where."""
  epl.init(COLOCATE)
  trainer, _ = train_and_compare(ResidualStem(), features_batch(rows=32, classes=16))
  (stem,) = [leaf for leaf in trainer.plan.leaves if leaf.path == "params/stem/kernel"]
  assert stem.spec == P() and stem.rule.startswith(
      "kept whole: split on dimension 1, it is mixed into an unsplit activation at equation "), (
      stem.rule)
  assert "kept whole" in str(trainer.plan)


class Plain(nn.Module):
  """A model we pretend we cannot edit: no scopes inside."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(32, name="stem")(x))
    h = nn.relu(nn.Dense(64, name="up")(x))
    return nn.Dense(10, name="down")(h + 0 * jnp.sum(h))


class Outer(nn.Module):
  @nn.compact
  def __call__(self, x):
    return Plain(name="mlp")(x)


def test_annotate_splits_a_module_we_cannot_edit():
  epl.init(COLOCATE)
  epl.set_default_strategy(epl.replicate(8))
  epl.annotate({"Outer/mlp/(up|down)": epl.split(8)})
  trainer, _ = train_and_compare(Outer(), features_batch(rows=32, classes=10))
  specs = trainer.plan.param_specs["params"]["mlp"]
  assert specs["up"]["kernel"] == P(None, "model")
  assert specs["down"]["kernel"] == P("model", None)
  assert specs["stem"]["kernel"] == P()


def test_annotate_rules_that_match_nothing_are_reported():
  epl.init(COLOCATE)
  epl.set_default_strategy(epl.replicate(8))
  epl.annotate({"Outer/mpl/up": epl.split(8), "params/mlp/up/kernal": P(None, "model")})
  init_fn = lambda rng, b: Outer().init(rng, b["x"])  # noqa: E731
  loss_fn = lambda v, b: cross_entropy(Outer().apply(v, b["x"]), b["y"])  # noqa: E731
  trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(0.1))
  with pytest.warns(UserWarning) as caught:
    trainer.init(jax.random.key(0), features_batch(rows=32, classes=10))
  texts = "\n".join(str(w.message) for w in caught)
  assert re.search(r"epl.annotate rule 'Outer/mpl/up' matches no module path of this model, so "
                   r"it changes nothing\. .* module paths look like 'Outer', 'Outer/mlp'", texts)
  assert re.search(r"rule 'params/mlp/up/kernal' matches no parameter path .* parameter paths "
                   r"look like 'params/mlp/down/bias'", texts)
  assert trainer.plan.param_specs["params"]["mlp"]["up"]["kernel"] == P()


class Logical(nn.Module):
  @nn.compact
  def __call__(self, x):
    with epl.split(4):
      h = nn.Dense(64, kernel_init=nn.with_logical_partitioning(
          nn.initializers.lecun_normal(), ("embed", "mlp")), name="wi")(x)
      return nn.Dense(10, name="wo")(nn.relu(h))


def test_flax_logical_metadata_and_explicit_rules_are_honoured():
  epl.annotate({"params/wo/kernel": P()})   # override the automatic row split
  with nn.logical_axis_rules([("embed", None), ("mlp", "model")]):
    trainer, _ = train_and_compare(Logical(), features_batch(rows=16, classes=10))
  specs = trainer.plan.param_specs["params"]
  assert specs["wi"]["kernel"] == P(None, "model")
  assert specs["wo"]["kernel"] == P()
  rules = {leaf.path: leaf.rule for leaf in trainer.plan.leaves}
  assert rules["params/wi/kernel"].startswith("user: Flax metadata")
  assert rules["params/wo/kernel"] == "user: epl.annotate rule 'params/wo/kernel'"


def test_two_rules_that_disagree_are_an_error():
  epl.annotate({"params/wi/kernel": P("model", None)})
  model = Logical()
  trainer = epl.Trainer(lambda r, b: model.init(r, b["x"]),
                        lambda v, b: cross_entropy(model.apply(v, b["x"]), b["y"]),
                        optax.sgd(0.1))
  with nn.logical_axis_rules([("embed", None), ("mlp", "model")]):
    with pytest.raises(epl.PlanError, match=(
        r"Two rules disagree on parameter 'params/wi/kernel' \(shape \(16, 64\)\): "
        r"epl.annotate rule 'params/wi/kernel' gives P\('model', None\) and Flax "
        r"metadata \('embed', 'mlp'\) gives P\(None, 'model'\)\. Remove one")):
      trainer.init(jax.random.key(0), features_batch(rows=16, classes=10))


def test_a_logical_name_without_a_rule_is_an_error():
  model = Logical()
  trainer = epl.Trainer(lambda r, b: model.init(r, b["x"]),
                        lambda v, b: cross_entropy(model.apply(v, b["x"]), b["y"]),
                        optax.sgd(0.1))
  with pytest.raises(epl.PlanError, match=r"logical axis name 'embed', which no logical axis "
                     r"rule maps to a mesh axis"):
    trainer.init(jax.random.key(0), features_batch(rows=16, classes=10))


class Indivisible(nn.Module):
  @nn.compact
  def __call__(self, x):
    with epl.split(4):
      return nn.Dense(10, name="fc")(x)


def test_a_dimension_that_does_not_divide_names_parameter_shape_and_count():
  model = Indivisible()
  trainer = epl.Trainer(lambda r, b: model.init(r, b["x"]),
                        lambda v, b: cross_entropy(model.apply(v, b["x"]), b["y"]),
                        optax.sgd(0.1))
  with pytest.raises(epl.PlanError, match=(
      r"Parameter 'params/fc/kernel' \(shape \(16, 10\)\) is split \(column\) on dimension 1 "
      r"of size 10, which does not divide into 4 devices")):
    trainer.init(jax.random.key(0), features_batch(rows=16, classes=10))


def test_annotate_rejects_bad_rules():
  with pytest.raises(epl.ScopeError, match="must be epl.replicate"):
    epl.annotate({"a": "split"})
  with pytest.raises(epl.ScopeError, match="is not a regular expression"):
    epl.annotate({"(": epl.split(2)})


class NNXLogical(nnx.Module):
  def __init__(self, rngs):
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
    self.wi = nnx.Linear(16, 64, kernel_init=init, rngs=rngs)
    self.wo = nnx.Linear(64, 10, rngs=rngs)

  def __call__(self, x):
    with epl.split(4):
      return self.wo(nnx.relu(self.wi(x)))


def test_nnx_sharding_metadata_is_honoured():
  batch = features_batch(rows=16, classes=10)

  def loss_fn(model, b):
    return cross_entropy(model(b["x"]), b["y"])

  trainer = epl.Trainer(lambda r, b: NNXLogical(nnx.Rngs(r)), loss_fn,
                        optax.sgd(0.1, momentum=0.9))
  state = trainer.init(jax.random.key(0), batch)
  specs = trainer.plan.param_specs
  assert specs["wi"]["kernel"] == P(None, "model")
  assert specs["wo"]["kernel"] == P("model", None)    # the automatic row rule
  rules = {leaf.path: leaf.rule for leaf in trainer.plan.leaves}
  assert rules["wi/kernel"] == "user: Flax metadata (None, 'model')"
  losses = []
  for _ in range(STEPS):
    state, metrics = trainer.train_step(state, batch)
    losses.append(metrics["loss"])

  one_device = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
  with jax.set_mesh(one_device):   # NNX creates annotated variables under a mesh
    model = NNXLogical(nnx.Rngs(jax.random.key(0)))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
      loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
      optimizer.update(model, grads)
      return loss

    for i in range(STEPS):
      np.testing.assert_allclose(losses[i], step(model, optimizer), **DEEP_TOL)
  assert_trees_close(nnx.state(trainer.variables(state), nnx.Param),
                     nnx.state(model, nnx.Param), DEEP_TOL)
