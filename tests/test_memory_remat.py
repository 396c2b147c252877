"""Gradient checkpointing: the single-device reference's numbers, with less memory.

``Deep``, ``TaggedDeep`` and ``TwoGraphs`` compute the same function with the same parameter
names, so one single-device reference serves them all.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import io_callback

import epljax as epl
from epljax.errors import PlanError
from epljax.memory import blocks
from epljax.sharding.program import trace_steps
from helpers import TOL, assert_trees_close, classification_batch, momentum_grads, reference_run
from helpers import linen_fns as linen_fns_of
from pipeline_helpers import Stack
from memory_models import (Deep, TaggedDeep, TwoGraphs, deep_batch, deep_fns, deep_optimizer,
                           deep_reference, deep_run, plain_mlp_fns)

ROWS = 1024


def train(config, init_fn, loss_fn, batch, *, grads=False, steps=1, optimizer=None):
  """Trainer, final state, (loss, grads) before the first step if asked, step losses."""
  epl.init(config)
  trainer = epl.Trainer(init_fn, loss_fn, optimizer or optax.sgd(0.1))
  state = trainer.init(jax.random.key(0), batch)
  first = trainer.loss_and_grads(state, batch) if grads else None
  losses = []
  for _ in range(steps):
    state, metrics = trainer.train_step(state, batch)
    losses.append(metrics["loss"])
  return trainer, state, first, losses


@pytest.fixture(scope="module")
def deep():
  """Reference, and the deep model trained without GC and with "auto" (shared with
  test_memory_combo through memory_models' session cache)."""
  history, expected = deep_reference()
  runs = {"none": deep_run("none", {}),
          "auto": deep_run("auto", {"gradient_checkpoint.type": "auto"})}
  return deep_batch(), history, expected, runs


def check_reference(run, history, expected, grads=True):
  trainer, state, first, losses = run
  for step, loss in enumerate(losses):
    np.testing.assert_allclose(loss, history[step][0], **TOL)
  if grads:
    np.testing.assert_allclose(first[0], history[0][0], **TOL)
    assert_trees_close(first[1], history[0][1])
  assert_trees_close(trainer.variables(state), expected)


def test_auto_matches_the_reference(deep):
  _, history, expected, runs = deep
  check_reference(runs["auto"], history, expected)


def test_auto_finds_the_repeated_layers_and_halves_temp_memory(deep):
  runs = deep[3]
  plain, remat = runs["none"][0].plan, runs["auto"][0].plan
  assert any("segments cut where little is live (Deep/layers_*" in f for f in remat.features)
  assert remat.memory.temp_size_in_bytes < 0.5 * plain.memory.temp_size_in_bytes
  assert remat.activation_bytes < 0.5 * plain.activation_bytes
  # Chen et al.: about one extra forward pass, a third of a step's FLOPs.
  extra = (remat.compiled.cost_analysis()["flops"] / plain.compiled.cost_analysis()["flops"]
           - 1)
  assert 0.15 < extra < 0.5, extra


@pytest.mark.parametrize("style", ["returned", "tf"])
def test_collection_keeps_only_tagged_tensors(deep, style):
  batch, history, expected, runs = deep
  init_fn, loss_fn = deep_fns(TaggedDeep(depth=6, style=style))
  run = train({"gradient_checkpoint.type": "collection"}, init_fn, loss_fn, batch, steps=2,
              optimizer=deep_optimizer())
  check_reference(run, history, expected, grads=False)
  plan = run[0].plan
  assert any("collection: 2 tagged tensors -> 3 segments" in f for f in plan.features)
  assert plan.activation_bytes < 0.6 * runs["none"][0].plan.activation_bytes


def test_end_taskgraph_limits_checkpointing_to_the_first_task_graphs(deep):
  batch, history, expected, runs = deep
  init_fn, loss_fn = deep_fns(TwoGraphs(depth=6))
  run = train({"cluster.colocate_split_and_replicate": True, "gradient_checkpoint.type": "auto",
               "gradient_checkpoint.end_taskgraph": 0}, init_fn, loss_fn, batch, steps=2,
              optimizer=deep_optimizer())
  check_reference(run, history, expected, grads=False)
  plan = run[0].plan
  assert [t.name for t in plan.taskgraphs] == ["low", "high"]
  assert any("segments cut where little is live" in f and "task graphs 0..0" in f
             for f in plan.features)
  none, auto = (runs[k][0].plan.activation_bytes for k in ("none", "auto"))
  assert auto < plan.activation_bytes < none
  # The same two task graphs named by epl.annotate rules instead of scopes: the same cut-off
  # (blocks.step_taskgraphs reads module rules as the capture does; it read scopes alone, and
  # checkpointed nothing here: the plain run's activation bytes).
  epl.init({"cluster.colocate_split_and_replicate": True, "gradient_checkpoint.type": "auto",
            "gradient_checkpoint.end_taskgraph": 0})
  epl.annotate({"Deep/(Dense_0|layers_[0-2])": epl.replicate(1, name="low"),
                "Deep/(layers_[3-5]|Dense_1)": epl.replicate(1, name="high")})
  init_fn, loss_fn = deep_fns(Deep(depth=6))
  annotated = epl.Trainer(init_fn, loss_fn, deep_optimizer())
  annotated.init(jax.random.key(0), batch)
  assert [t.name for t in annotated.plan.taskgraphs] == ["low", "high"]
  assert annotated.plan.activation_bytes == plan.activation_bytes


def test_dropout_keeps_its_mask():
  """Random bits are recomputed from their key: the same mask, so the same gradients."""
  init_fn, loss_fn = deep_fns(Deep(depth=2, dropout=0.3), dropout_key=7)
  batch = classification_batch(64, features=32, classes=16)
  history, expected = reference_run(init_fn, loss_fn, deep_optimizer(), jax.random.key(0),
                                    batch, 1)
  trainer, state, _, losses = train({"gradient_checkpoint.type": "auto"}, init_fn, loss_fn,
                                    batch, optimizer=deep_optimizer())
  # The step's gradient: SGD's momentum trace after one step (no loss_and_grads compile).
  run = trainer, state, (losses[0], momentum_grads(trainer, state)), losses
  check_reference(run, history, expected)


def test_plain_jax_model_is_cut_about_every_sqrt_layers():
  init_fn, loss_fn = plain_mlp_fns(depth=9)
  batch = classification_batch(ROWS, features=32, classes=16)
  params = init_fn(jax.random.key(0), batch)
  loss, grads = jax.value_and_grad(loss_fn)(params, batch)
  acts = {}
  for name, config in [("none", {}), ("auto", {"gradient_checkpoint.type": "auto"})]:
    trainer, _, (loss0, grads0), _ = train(config, init_fn, loss_fn, batch, grads=True, steps=0)
    np.testing.assert_allclose(loss0, loss, **TOL)
    assert_trees_close(grads0, grads)
    acts[name] = trainer.plan.activation_bytes
  assert any("segments cut where little is live (no module names)" in f
             for f in trainer.plan.features), trainer.plan.features
  assert acts["auto"] < 0.7 * acts["none"]


def test_check_gradients_with_pipeline_stages_is_refused_with_the_way_out():
  epl.init({"gradient_checkpoint.type": "auto", "gradient_checkpoint.check_gradients": True,
            "pipeline.num_micro_batch": 2})
  init_fn, loss_fn = linen_fns_of(Stack(stages=2))
  trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(0.1))
  with pytest.raises(PlanError, match=r"(?s)runs as 2 pipeline stages.*without pipeline stages"):
    trainer.init(jax.random.key(0), classification_batch(16))


def test_check_gradients_passes_on_a_pure_model_and_raises_on_an_impure_one():
  init_fn, loss_fn = deep_fns(Deep(depth=2))
  batch = classification_batch(64, features=32, classes=16)
  history, expected = reference_run(init_fn, loss_fn, optax.sgd(0.1), jax.random.key(0),
                                    batch, 2, micro_batches=2)
  config = {"gradient_checkpoint.type": "auto", "gradient_checkpoint.check_gradients": True,
            "pipeline.num_micro_batch": 2}
  trainer, state, _, losses = train(config, init_fn, loss_fn, batch, steps=2)
  assert bool(state.feature_state["gradient_checkpoint"]["checked"])
  for step in range(2):    # with gradient accumulation, too
    np.testing.assert_allclose(losses[step], history[step][0], **TOL)
  assert_trees_close(trainer.variables(state), expected)

  counter = iter(range(1, 10**6))
  mlp_init, _ = plain_mlp_fns(depth=4)

  def impure_loss(params, b):
    # A callback declared pure that is not: recomputing it gives other numbers.
    x = b["x"]
    for layer in params["layers"]:
      noise = jax.pure_callback(lambda: np.float32(next(counter)),
                                jax.ShapeDtypeStruct((), jnp.float32))
      x = jnp.tanh(x @ layer["w"] + layer["b"]) * noise
    logits = x @ params["head"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

  epl.init({**config, "pipeline.num_micro_batch": 1})
  trainer = epl.Trainer(mlp_init, impure_loss, optax.sgd(0.1))
  state = trainer.init(jax.random.key(0), batch)
  with pytest.raises(epl.GradientCheckError, match=r"the gradients with and without gradient "
                     r"checkpointing differ beyond 0.0001 \(relative\) at head .* layers/0/w"):
    trainer.train_step(state, batch)


def test_collectives_stateful_random_and_effects_are_never_recomputed():
  def fn(params, x):
    y = jnp.sin(x @ params)
    noise = jax.lax.rng_uniform(0.0, 1.0, y.shape)
    io_callback(lambda v: None, None, y.sum())
    return jnp.sum(y * noise)

  program, _ = trace_steps(fn, jnp.ones((4, 4)), (jnp.ones((2, 4)),))
  kept = {s.primitive for s in program.steps if blocks.must_run_once(s)}
  assert kept == {"rng_uniform", "io_callback"}
  segments = blocks.plan_segments(program, [(0, len(program.steps))],
                                  [True] * len(program.steps))
  assert any(seg.remat for seg in segments)
  for seg in segments:
    if seg.remat:
      assert not any(blocks.must_run_once(s) for s in program.steps[seg.start:seg.stop])


def test_tagging_is_a_no_op_unless_collection():
  x = jnp.ones(3)
  for kind in ["", "auto"]:
    epl.init({"gradient_checkpoint.type": kind} if kind else {})
    assert not jax.make_jaxpr(lambda v: epl.add_to_collection(v, "checkpoints"))(x).eqns
  epl.init({"gradient_checkpoint.type": "collection"})
  jaxpr = jax.make_jaxpr(lambda v: epl.add_to_collection(v, "checkpoints"))(x)
  assert [e.primitive.name for e in jaxpr.eqns] == ["name"]
  with pytest.raises(epl.EPLError, match=r"epljax knows one collection, 'checkpoints'"):
    epl.add_to_collection(x, "activations")


def test_invalid_type_lists_the_valid_ones():
  with pytest.raises(epl.ConfigError, match=r"'gradient_checkpoint.type' .* must be one of "
                     r"'', 'collection', 'auto'; got 'full'"):
    epl.Config({"gradient_checkpoint.type": "full"})


def test_forward_hooks_wrap_any_stage_function():
  """A pipeline stage is ``fn(stage_params, *inputs) -> activations``: the hooks must work on
  it as on the whole loss (the pipeline wraps each stage's forward the same way)."""
  import flax.linen as nn
  from jax.sharding import Mesh

  from epljax import memory
  from epljax.features import BuildContext
  from memory_models import Block

  class Stage(nn.Module):
    @nn.compact
    def __call__(self, x):
      for i in range(4):
        x = Block(name=f"layers_{i}")(x)
      return x

  x = jax.random.normal(jax.random.key(1), (256, 32))
  params = Stage().init(jax.random.key(0), x)["params"]

  def stage(p, h):
    return Stage().apply({"params": p}, h)

  mesh = Mesh(np.array(jax.devices()).reshape(8, 1, 1), ("data", "stage", "model"))
  ctx = BuildContext(mesh=mesh, num_replicas=8, num_micro_batch=1, capture=None,
                     params_shape=jax.eval_shape(lambda: params), optimizer=optax.sgd(0.1))
  def wrap(config):
    epl.init(config)
    fn = stage
    for feature in memory.features(epl.Env.get().config):
      fn = feature.forward(fn, ctx)
    return fn

  def compiled_grads(fn):
    return jax.jit(jax.grad(lambda p, h: jnp.sum(fn(p, h) ** 2), argnums=(0, 1))).lower(
        params, x).compile()

  plain = compiled_grads(stage)
  expected, expected_temp = plain(params, x), plain.memory_analysis().temp_size_in_bytes

  remat = compiled_grads(wrap({"gradient_checkpoint.type": "auto"}))
  assert_trees_close(remat(params, x), expected)
  assert remat.memory_analysis().temp_size_in_bytes < 0.5 * expected_temp

  mixed_fn = wrap({"gradient_checkpoint.type": "auto", "amp.level": "O1"})
  out = jax.jit(mixed_fn)(params, x)
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(out, stage(params, x), rtol=2 ** -5, atol=2 ** -5)
  mixed = compiled_grads(mixed_fn)
  g, g_ref = jax.tree.leaves(mixed(params, x)), jax.tree.leaves(expected)
  scale = max(np.max(np.abs(e)) for e in g_ref)
  assert max(np.max(np.abs(a - e)) for a, e in zip(g, g_ref)) <= 2 ** -5 * scale
  assert mixed.memory_analysis().temp_size_in_bytes < 0.5 * expected_temp


@pytest.mark.slow
def test_auto_inside_pipeline_stages():
  """Each stage's forward is checkpointed per block: the stash keeps (almost) no residuals,
  and the numbers are those of the plain pipeline (itself tested against the reference)."""
  init_fn, loss_fn = linen_fns_of(Stack(stages=2, layers=4, width=32))
  batch = classification_batch(128)
  runs = {name: train({"pipeline.num_micro_batch": 4, **config}, init_fn, loss_fn, batch)
          for name, config in [("none", {}), ("auto", {"gradient_checkpoint.type": "auto"})]}
  (plain, plain_state, _, plain_losses), (remat, state, _, losses) = runs["none"], runs["auto"]
  assert remat.plan.num_stages == 2
  np.testing.assert_allclose(losses[0], plain_losses[0], **TOL)
  assert_trees_close(remat.variables(state), plain.variables(plain_state))
  # A stage's 4 blocks are rolled into one scan (pipeline.roll_layers, on by default), whose
  # body is rematerialized per iteration.
  assert any("1 scanned layer bodies rematerialized per iteration" in f
             for f in remat.plan.features)
  stash = lambda t: sum(t.plan.pipeline.loop.buffers.residuals.values())  # noqa: E731
  # Measured on jax 0.11: 1384 of 9833 bytes rolled (2048 with the blocks written out, the
  # segment inputs): what stays are the scan's inputs.
  assert stash(remat) < 0.25 * stash(plain)
