"""Data parallelism against the single-device reference on the same global batch."""

import logging

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import epljax as epl
from helpers import (MLP, TOL, assert_trees_close, classification_batch, cross_entropy,
                     linen_fns, reference_run)

OPTIMIZERS = {
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=1e-2),
}

# name: (config, set up the strategy, model, expected replicas, expected mesh, grad scale)
STRATEGIES = {
    "set_default_strategy": ({}, lambda: epl.set_default_strategy(epl.replicate(1)), MLP(),
                             8, {"data": 8, "stage": 1, "model": 1}, 1.0),
    "scope_inside_module": ({}, lambda: None, MLP(scope="replicate"),
                            8, {"data": 8, "stage": 1, "model": 1}, 1.0),
    "no_annotation": ({}, lambda: None, MLP(), 8, {"data": 8, "stage": 1, "model": 1}, 1.0),
    "replicate_2": ({}, lambda: epl.set_default_strategy(epl.replicate(2)), MLP(),
                    4, {"data": 4, "stage": 1, "model": 2}, 1.0),
    "accumulate_4": ({"pipeline.num_micro_batch": 4},
                     lambda: epl.set_default_strategy(epl.replicate(1)), MLP(),
                     8, {"data": 8, "stage": 1, "model": 1}, 1.0),
    "reduce_sum": ({"communication.gradients_reduce_method": "sum"}, lambda: None, MLP(),
                   8, {"data": 8, "stage": 1, "model": 1}, 8.0),
}

STEPS = 3


def scaled(optimizer, scale):
  """The reference optimizer for gradients_reduce_method='sum': EPL sums over replicas."""
  return optax.chain(optax.scale(scale), optimizer) if scale != 1.0 else optimizer


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_matches_single_device_reference(strategy, opt_name, caplog):
  config, setup, model, replicas, mesh_shape, grad_scale = STRATEGIES[strategy]
  epl.init(config)
  setup()
  init_fn, loss_fn = linen_fns(model)
  batch = classification_batch(64)
  trainer = epl.Trainer(init_fn, loss_fn, OPTIMIZERS[opt_name]())
  state = trainer.init(jax.random.key(0), batch)
  assert trainer.plan.num_replicas == replicas
  assert dict(trainer.plan.mesh.shape) == mesh_shape
  assert trainer.plan.num_stages == 1
  shardings = jax.tree.map(lambda x: x.sharding, state)
  dtypes = jax.tree.map(lambda x: x.dtype, state)

  history, expected = reference_run(
      init_fn, loss_fn, scaled(OPTIMIZERS[opt_name](), grad_scale), jax.random.key(0), batch,
      STEPS, micro_batches=config.get("pipeline.num_micro_batch", 1))

  loss0, grads0 = trainer.loss_and_grads(state, batch)
  np.testing.assert_allclose(loss0, history[0][0], **TOL)
  assert_trees_close(grads0, jax.tree.map(lambda g: g * grad_scale, history[0][1]))

  caplog.set_level(logging.WARNING)
  with jax.log_compiles():
    for step in range(STEPS):
      state, metrics = trainer.train_step(state, batch)
      np.testing.assert_allclose(metrics["loss"], history[step][0], **TOL)
  compiles = [r for r in caplog.records if "Compiling" in r.getMessage()
              and "epl_step" in r.getMessage()]
  assert len(compiles) == 1, [r.getMessage()[:80] for r in compiles]
  assert int(state.step) == STEPS
  assert_trees_close(trainer.variables(state), expected)
  assert jax.tree.map(lambda x: x.sharding, state) == shardings
  assert jax.tree.map(lambda x: x.dtype, state) == dtypes


def test_gradient_accumulation_equals_the_big_batch():
  """4 micro batches of 16 rows give the gradient of the 64-row batch in one step."""
  init_fn, loss_fn = linen_fns(MLP())
  batch = classification_batch(64)
  grads = {}
  for micro in (1, 4):
    epl.init({"pipeline.num_micro_batch": micro})
    trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(0.1))
    state = trainer.init(jax.random.key(0), batch)
    grads[micro] = trainer.loss_and_grads(state, batch)
    assert trainer.plan.num_micro_batch == micro
    assert trainer.plan.micro_batch_per_replica == 64 // 8 // micro
  np.testing.assert_allclose(grads[4][0], grads[1][0], **TOL)
  assert_trees_close(grads[4][1], grads[1][1])


def test_accumulation_has_no_communication_inside_the_micro_batch_loop():
  """Micro batches are cut from each device's own rows: only the gradient all-reduce."""
  epl.init({"pipeline.num_micro_batch": 4})
  init_fn, loss_fn = linen_fns(MLP())
  batch = classification_batch(64)
  trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(0.1))
  trainer.init(jax.random.key(0), batch)
  kinds = {c.kind for c in trainer.plan.collectives}
  assert kinds == {"all-reduce"}


@pytest.mark.parametrize("config, rows, message", [
    ({}, 12, r"The global batch of 12 rows does not divide into 8 replicas x 1 micro batches "
             r"\(= 8\)\. Use a global batch that is a multiple of 8, for example 8 or 16"),
    ({"pipeline.num_micro_batch": 2}, 24,
     r"24 rows does not divide into 8 replicas x 2 micro batches \(= 16\)"),
    ({"pipeline.num_micro_batch": 5}, 64,
     r"64 rows does not divide into pipeline.num_micro_batch=5 micro batches"),
])
def test_indivisible_batch_names_the_sizes(config, rows, message):
  epl.init(config)
  init_fn, loss_fn = linen_fns(MLP())
  trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(0.1))
  with pytest.raises(ValueError, match=message):
    trainer.init(jax.random.key(0), classification_batch(rows))


def test_replicate_2_splits_each_replica_micro_batch_over_its_devices():
  epl.set_default_strategy(epl.replicate(2))
  init_fn, loss_fn = linen_fns(MLP())
  trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(0.1))
  trainer.init(jax.random.key(0), classification_batch(16))
  assert trainer.plan.batch_axes == ("data", "model")
  assert trainer.plan.micro_batch_per_replica == 4
  with pytest.raises(ValueError, match=r"12 rows does not divide into 4 replicas x 1 micro "
                     r"batches x 2 devices per replica sharing each micro batch \(replicate\(2\)\) "
                     r"\(= 8\)"):
    trainer.shard_batch(classification_batch(12))


class BNModel(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Dense(16)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
    return nn.Dense(10)(nn.relu(x))


def test_batchnorm_model_updates_its_statistics_like_single_device():
  model = BNModel()
  batch = classification_batch(64)

  def init_fn(rng, b):
    return model.init(rng, b["x"])

  def loss_fn(variables, b):
    logits, updates = model.apply(variables, b["x"], mutable=["batch_stats"])
    return cross_entropy(logits, b["y"]), updates

  trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(0.1), mutable=["batch_stats"])
  state = trainer.init(jax.random.key(0), batch)
  for _ in range(2):
    state, metrics = trainer.train_step(state, batch)

  variables = model.init(jax.random.key(0), batch["x"])
  opt = optax.sgd(0.1)
  opt_state = opt.init(variables["params"])
  for _ in range(2):
    def ref(p, v=variables):
      return loss_fn({**v, "params": p}, batch)
    (loss, updates), grads = jax.value_and_grad(ref, has_aux=True)(variables["params"])
    upd, opt_state = opt.update(grads, opt_state, variables["params"])
    variables = {"params": optax.apply_updates(variables["params"], upd), **updates}
  np.testing.assert_allclose(metrics["loss"], loss, **TOL)
  assert_trees_close(trainer.variables(state), variables)
  assert "batch_stats" in trainer.plan.param_specs


def test_forgetting_mutable_or_has_aux_is_explained():
  model = BNModel()
  batch = classification_batch(16)

  def loss_fn(variables, b):
    logits, updates = model.apply(variables, b["x"], mutable=["batch_stats"])
    return cross_entropy(logits, b["y"]), updates

  def init_fn(r, b):
    return model.init(r, b["x"])

  trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(0.1))
  with pytest.raises(epl.PlanError, match=r"loss_fn returned a tuple where the loss .* pass "
                     r"has_aux=True .* pass mutable=\['batch_stats'\]"):
    trainer.init(jax.random.key(0), batch)
  # The updates returned as aux would never be applied.
  trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(0.1), has_aux=True)
  with pytest.raises(epl.PlanError, match=r"loss_fn's aux has the structure of the model's "
                     r"collections \['batch_stats'\]: updates returned as aux are not applied. "
                     r"Pass mutable=\['batch_stats'\] to epl.Trainer"):
    trainer.init(jax.random.key(0), batch)
  # An option the loss does not follow: the hint is to follow it or leave it out.
  def plain_loss(variables, b):
    return cross_entropy(model.apply(variables, b["x"], mutable=["batch_stats"])[0], b["y"])

  for option, text in [(dict(has_aux=True), r"With has_aux=True, loss_fn returns \(loss, aux\); "
                                            r"return the pair, or leave has_aux out"),
                       (dict(mutable=["batch_stats"]),
                        r"With mutable=\['batch_stats'\], loss_fn returns \(loss, updates\)")]:
    with pytest.raises(epl.PlanError, match=text):
      epl.Trainer(init_fn, plain_loss, optax.sgd(0.1), **option).init(jax.random.key(0), batch)


def test_has_aux_returns_aux_in_metrics_stacked_over_micro_batches():
  epl.init({"pipeline.num_micro_batch": 2})
  model = MLP()

  def loss_fn(variables, b):
    logits = model.apply(variables, b["x"])
    return cross_entropy(logits, b["y"]), {"accuracy": jnp.mean(logits.argmax(-1) == b["y"])}

  trainer = epl.Trainer(lambda r, b: model.init(r, b["x"]), loss_fn, optax.sgd(0.1),
                        has_aux=True)
  batch = classification_batch(32)
  state = trainer.init(jax.random.key(0), batch)
  state, metrics = trainer.train_step(state, batch)
  assert metrics["aux"]["accuracy"].shape == (2,)


def test_plain_jax_pytree_model():
  """init_fn returns a plain dict of arrays (no 'params' key): the whole tree is trained."""

  def init_fn(rng, b):
    k1, k2 = jax.random.split(rng)
    return {"w": jax.random.normal(k1, (20, 10)) * 0.1, "b": jnp.zeros(10)}

  def loss_fn(p, b):
    return cross_entropy(b["x"] @ p["w"] + p["b"], b["y"])

  batch = classification_batch(32)
  trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(0.5))
  state = trainer.init(jax.random.key(1), batch)
  state, _ = trainer.train_step(state, batch)
  p = init_fn(jax.random.key(1), batch)
  g = jax.grad(loss_fn)(p, batch)
  assert_trees_close(trainer.variables(state), jax.tree.map(lambda a, b: a - 0.5 * b, p, g))
  assert trainer.plan.param_specs == {"b": jax.sharding.PartitionSpec(),
                                      "w": jax.sharding.PartitionSpec()}


def test_integer_trainable_leaf_is_refused():
  trainer = epl.Trainer(lambda r, b: {"w": jnp.ones((20, 10)), "count": jnp.zeros((), jnp.int32)},
                        lambda p, b: jnp.mean(b["x"] @ p["w"]), optax.sgd(0.1))
  with pytest.raises(epl.PlanError, match=r"Trainable leaf 'count' .* has dtype int32"):
    trainer.init(jax.random.key(0), classification_batch(8))


def test_calls_before_init_and_bad_optimizer():
  init_fn, loss_fn = linen_fns(MLP())
  trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(0.1))
  with pytest.raises(epl.StateError, match=r"Call trainer.init\(rng, batch\) first"):
    _ = trainer.plan
  with pytest.raises(epl.EPLError, match="optimizer must be an optax.GradientTransformation"):
    epl.Trainer(init_fn, loss_fn, "sgd")


def test_states_a_step_cannot_take_say_which_state_to_pass():
  epl.init()
  init_fn, loss_fn = linen_fns(MLP())
  batch = classification_batch(16)
  trainer = epl.Trainer(init_fn, loss_fn, optax.adam(1e-2))
  state = trainer.init(jax.random.key(0), batch)
  other = epl.Trainer(init_fn, loss_fn, optax.sgd(0.1))
  with pytest.raises(epl.StateError, match=r"Expected the trainer's TrainState, got dict: pass "
                     r"the TrainState that trainer.init or the previous train_step returned"):
    trainer.train_step({"params": state.params}, batch)
  with pytest.raises(epl.StateError, match=r"does not have the structure of this trainer's "
                     r"state \(a state of another Trainer or model\?\)"):
    trainer.train_step(other.init(jax.random.key(0), batch), batch)
  new_state, _ = trainer.train_step(state, batch)
  with pytest.raises(epl.StateError, match=r"already used by a train_step, which reuses its "
                     r"buffers .* continue from the state that train_step returned"):
    trainer.train_step(state, batch)
  trainer.train_step(new_state, batch)   # the state it returned: not checked again
  with pytest.raises(epl.StateError, match=r"already used by a train_step"):
    trainer.train_step(new_state, batch)   # ... until it was used


def test_plan_printout_is_a_readable_table():
  epl.set_default_strategy(epl.replicate(1))
  init_fn, loss_fn = linen_fns(MLP())
  trainer = epl.Trainer(init_fn, loss_fn, optax.adamw(1e-3))
  trainer.init(jax.random.key(0), classification_batch(64))
  text = str(trainer.plan)
  for expected in ["mesh      data=8 x stage=1 x model=1 over 8 cpu devices",
                   "replicas  8    stages 1", "64 rows per step = 8 replicas x 8 rows",
                   "taskgraph_0  replicate  1", "params/Dense_0/kernel", "(20, 16)", "P()",
                   "2.0 KiB", "optimizer state", "collectives per step", "all-reduce"]:
    assert expected in text, expected
  plan = trainer.plan
  assert plan.taskgraphs == [epl.TaskGraph(0, "taskgraph_0", "replicate", 1)]
  assert plan.param_bytes == (20 * 16 + 16 + 16 * 10 + 10) * 4
  assert plan.optimizer_bytes >= 2 * plan.param_bytes   # Adam's two moments
  assert plan.memory.argument_size_in_bytes > 0


class NNXNet(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    # No bias before BatchNorm: its true gradient is 0, and Adam would amplify rounding noise.
    self.dense1 = nnx.Linear(20, 16, use_bias=False, rngs=rngs)
    self.bn = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
    self.dropout = nnx.Dropout(0.25, rngs=rngs)
    self.dense2 = nnx.Linear(16, 10, rngs=rngs)

  def __call__(self, x):
    with epl.replicate(1, name="body"):
      return self.dense2(self.dropout(nnx.relu(self.bn(self.dense1(x)))))


def test_nnx_model_with_batchnorm_and_dropout_matches_single_device():
  batch = classification_batch(64)

  def init_fn(rng, b):
    return NNXNet(nnx.Rngs(params=rng, dropout=jax.random.fold_in(rng, 1)))

  def loss_fn(model, b):
    return cross_entropy(model(b["x"]), b["y"])

  trainer = epl.Trainer(init_fn, loss_fn, optax.adamw(1e-2))
  state = trainer.init(jax.random.key(0), batch)
  losses = []
  for _ in range(3):
    state, metrics = trainer.train_step(state, batch)
    losses.append(metrics["loss"])
  assert [t.name for t in trainer.plan.taskgraphs] == ["body"]
  trained = trainer.variables(state)
  assert isinstance(trained, NNXNet)

  # The reference: NNX on one device, written with NNX's own transforms.
  model = init_fn(jax.random.key(0), batch)
  optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer):
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss

  for i in range(3):
    np.testing.assert_allclose(losses[i], step(model, optimizer), **TOL)
  assert_trees_close(nnx.state(trained, nnx.Param), nnx.state(model, nnx.Param))
  assert_trees_close(nnx.state(trained, nnx.BatchStat), nnx.state(model, nnx.BatchStat))
  specs = trainer.plan.param_specs
  assert specs["dense1"]["kernel"] == jax.sharding.PartitionSpec()
  assert "mean" in specs["bn"]


def test_given_variables_start_the_state_and_wrong_ones_are_named():
  """``trainer.init(rng, batch, variables=...)`` (pretrained weights): an NNX module (its
  BatchNorm statistics and dropout RNG keys included) gives the state ``trainer.init(rng,
  batch)`` makes; variables of another shape, dtype or structure are refused by path."""
  batch = classification_batch(64)

  def init_fn(rng, b):
    return NNXNet(nnx.Rngs(params=rng, dropout=jax.random.fold_in(rng, 1)))

  def loss_fn(model, b):
    return cross_entropy(model(b["x"]), b["y"])

  def data(x):
    return jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x

  made = epl.Trainer(init_fn, loss_fn, optax.adamw(1e-2)).init(jax.random.key(0), batch)
  given = epl.Trainer(init_fn, loss_fn, optax.adamw(1e-2)).init(
      jax.random.key(0), batch, variables=init_fn(jax.random.key(0), batch))
  assert jax.tree.structure(given) == jax.tree.structure(made)
  for a, b in zip(jax.tree.leaves(given), jax.tree.leaves(made)):
    assert (a.sharding, a.dtype) == (b.sharding, b.dtype)
    np.testing.assert_array_equal(np.asarray(data(a)), np.asarray(data(b)))

  init_fn, loss_fn = linen_fns(MLP())
  trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(0.1))
  good = jax.tree.map(np.asarray, init_fn(jax.random.key(0), batch))
  dense = {k: dict(v) for k, v in good["params"].items()}
  cases = [
      ({"params": {**dense, "Dense_0": {**dense["Dense_0"], "kernel": np.zeros((20, 8))}}},
       r"params/Dense_0/kernel: \(20, 8\) float64, init_fn makes \(20, 16\) float32"),
      ({"params": {"Dense_0": dense["Dense_0"]}},
       r"the params differ from what init_fn makes; missing params/Dense_1/bias, "
       r"params/Dense_1/kernel, not in the model none"),
      (jax.tree.map(lambda x: x.astype(np.float16), good),
       r"4 of the params leaves differ in shape or dtype .* float16, init_fn makes .* float32")]
  for bad, message in cases:
    with pytest.raises(epl.StateError, match=message):
      trainer.init(jax.random.key(0), batch, variables=bad)
  # Arrays already in their shardings are copied: the step donates the state, not the user's.
  placed = trainer.variables(trainer.init(jax.random.key(0), batch, variables=good))
  state, _ = trainer.train_step(trainer.init(jax.random.key(0), batch, variables=placed), batch)
  assert not any(x.is_deleted() for x in jax.tree.leaves(placed))
  assert_trees_close(placed, good, dict(rtol=0, atol=0))


@pytest.mark.parametrize("config", [{}, {"zero.level": "v1", "optimizer.num_apply_group": 2}])
def test_optimizer_with_masked_parts(config):
  """optax.multi_transform keeps MaskedNodes in its state where a label leaves a parameter out;
  their shardings (and ZeRO's and the grouped apply's maps of the state) keep them too."""
  init_fn, loss_fn = linen_fns(MLP(hidden=64, classes=16))
  batch = classification_batch(64, classes=16)

  def labels(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "kernels" if "kernel" in jax.tree_util.keystr(path) else "biases",
        params)

  optimizer = optax.multi_transform({"kernels": optax.sgd(0.1, momentum=0.9),
                                     "biases": optax.adam(1e-2)}, labels)
  history, expected = reference_run(init_fn, loss_fn, optimizer, jax.random.key(0), batch, 2)
  epl.init(config)
  trainer = epl.Trainer(init_fn, loss_fn, optimizer)
  state = trainer.init(jax.random.key(0), batch)
  for step in range(2):
    state, metrics = trainer.train_step(state, batch)
    np.testing.assert_allclose(metrics["loss"], history[step][0], **TOL)
  assert_trees_close(trainer.variables(state), expected)


def test_batch_leaves_a_device_cannot_take_are_named():
  epl.init()
  init_fn, loss_fn = linen_fns(MLP())
  trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(0.1))
  batch = classification_batch(16)
  cases = [({**batch, "names": np.array(["a"] * 16)},
            r"Batch leaf 'names' has dtype <U1, which JAX cannot put on a device"),
           ({**batch, "temperature": 2},
            r"Batch leaf 'temperature' is of type int, not an array; .* Constants .* belong in "
            r"loss_fn's closure"),
           ({**batch, "y": batch["y"][:8]},
            r"Batch leaves have different leading \(batch\) sizes \(x: 16, y: 8\)")]
  for bad, message in cases:
    with pytest.raises(epl.PlanError, match=message):
      trainer.init(jax.random.key(0), bad)
