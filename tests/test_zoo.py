"""The zoo contract: every model of ``tests/models`` under the strategies a user would try (a
covering of the models x strategies matrix: ``LEFT_OUT``).

Each cell trains 2 steps and compares with single-device training on the same global batch:
the losses of both steps, the first step's gradients (as SGD's momentum trace holds them) and
the parameters after both, to 1e-5 (1e-4 for deep models; AMP within bfloat16 precision as in
``test_memory_amp.py``). It checks that the step compiled once, that shardings and dtypes
survive the steps, and that the plan is sane for the strategy: Megatron specs for the splits;
for pipelines, stages that each hold more than half the mean parameter bytes and at most 1.5x
the mean FLOPs, a tied embedding held by the first and last stage, and no balance warning,
except where no cut can balance and epljax must say so (``SAYS_UNBALANCED``); sharded state for
ZeRO.
"""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.core import meta
from jax.sharding import PartitionSpec as P

import epljax as epl
from epljax import hlo
from epljax.mesh import DATA
from epljax.pipeline.auto import StageBalanceWarning, stage_balance
from helpers import DEEP_TOL, TOL, assert_trees_close, on_one_jax, reference_run
from models import ZOO, ZooModel
from pipeline_helpers import count_compiles
from test_memory_amp import GRAD_RTOL, LOSS_RTOL

ROWS = 16      # global batch of every cell
STEPS = 2

# strategy -> epl config. The split strategies add their annotation in ``run_cell``.
STRATEGIES = {
    "dp": {},
    "split_annotate": {},
    "split_logical": {},
    "pipeline_2": {"auto.auto_parallel": True, "pipeline.num_stages": 2,
                   "pipeline.num_micro_batch": 2},
    "pipeline_4": {"auto.auto_parallel": True, "pipeline.num_stages": 4,
                   "pipeline.num_micro_batch": 4},
    # Interleaved: 4 chunks, 2 per stage (Llama: its nn.scan split in 4, so each stage runs
    # layers it does not store, which the step brings with ppermutes).
    "pipeline_interleaved": {"auto.auto_parallel": True, "pipeline.num_stages": 2,
                             "pipeline.num_virtual_stages": 2, "pipeline.num_micro_batch": 2},
    # The looped MLP's stages each run their repeated blocks as one scan (the other models
    # have one layer, or two different ones, per stage: nothing repeats to roll).
    "pipeline_roll": {"auto.auto_parallel": True, "pipeline.num_stages": 2,
                      "pipeline.num_micro_batch": 2, "pipeline.roll_layers": True},
    # Two tensor-parallel stages named by the user (data 2 x stage 2 x model 2).
    "pipeline_split": {"pipeline.num_stages": 2, "pipeline.num_micro_batch": 2},
    # The whole model split(2), cut into 2 stages by auto_parallel (data 2 x stage 2 x model 2).
    "pipeline_auto_split": {"auto.auto_parallel": True, "pipeline.num_stages": 2,
                            "pipeline.num_micro_batch": 2},
    "gc_auto": {"gradient_checkpoint.type": "auto"},
    "zero_v1": {"zero.level": "v1"},
    "zero_v3": {"zero.level": "v3"},
    "amp_o1": {"amp.level": "O1"},
    # The plan searched (epljax/search.py): whatever it chooses trains like the reference.
    "auto_plan": {"auto.auto_parallel": True},
    # Two stages with the train state as the loop's slots (pipeline.param_layout="stage"):
    # tied embeddings held once, nn.scan parts, rolled layers; SGD's momentum in the slots.
    "pipeline_stage": {"auto.auto_parallel": True, "pipeline.num_stages": 2,
                       "pipeline.num_micro_batch": 2, "pipeline.param_layout": "stage"},
}

# Cells that cannot be balanced and must say so (none left: the layers under nn.scan are split
# into one scan per stage, ``pipeline/chunks.py``).
SAYS_UNBALANCED: set[tuple[str, str]] = set()


def optimizer():
  # SGD, not Adam: Adam turns the rounding noise of exactly-zero gradients (an attention key
  # bias) into full-size updates, which no two summation orders agree on.
  return optax.sgd(0.1, momentum=0.9)


# The matrix is a covering, not the whole product (each cell compiles 2-4 programs, and the zoo
# was a quarter of CI's time): every model runs data parallelism, a split, a pipeline with more
# than 2 stages or a tensor-parallel pipeline, ZeRO and recomputation; every strategy runs on at
# least 3 families (zero_v3 counting the re-fetch test's) but the plain 2-stage cut (2) and those
# only one model can run (split_logical, pipeline_roll). A cell left out is one whose risk
# another cell of the same model carries:
# - a plain 2-stage cut where the model also runs 4 stages and a 2-stage tensor-parallel cut
#   (Llama keeps both: its nn.scan is chunked differently for 2 and 4 stages);
# - zero_v1 where zero_v3 runs (v3 shards what v1 shards, and the parameters); the looped MLP
#   keeps v1 alone (its loop of identical shapes is what v1's shards are cut from);
# - zero_v3 on the models of REFETCH_MODELS but Llama: their re-fetch test below runs the same
#   contract (exact, one compile, ZeRO v3's shards) with the barrier GPU and TPU compile; the
#   CPU's barrier runs on Llama's scanned layers and GPT-2's loop;
# - gpt2_fused is gpt2 with Hugging Face's fused Conv1D kernels: what differs is their split,
#   their stage cut under a split, their ZeRO shards and their casts (gpt2 runs the rest), and
#   gpt2_fused_t (the kernels transposed) differs only in the split;
# - the looped MLP, all dense layers of one width, runs the pipelines it exists for (2 stages,
#   rolled, interleaved, tensor-parallel cut) and no second copy of the generic features;
# - Gemma's interleaved stages: a schedule over a cut that its 4-stage cell makes, with layers
#   of Llama's and GPT-2's kinds, which interleave (with the looped MLP) beside it.
LEFT_OUT = {
    "gemma": {"pipeline_2", "pipeline_auto_split", "pipeline_interleaved", "zero_v1",
              "zero_v3"},
    "gpt2": {"pipeline_2", "pipeline_auto_split"},
    "gpt2_fused": {"pipeline_2", "pipeline_4", "pipeline_interleaved", "pipeline_split",
                   "gc_auto", "zero_v1", "zero_v3", "auto_plan", "pipeline_stage"},
    "gpt2_fused_t": set(STRATEGIES) - {"split_annotate"},
    "vit": {"pipeline_2", "pipeline_auto_split", "pipeline_interleaved", "zero_v1", "zero_v3"},
    "mlp_loop": {"pipeline_4", "zero_v3", "amp_o1", "auto_plan"},
}


def covering():
  """``(model, strategy, half)`` of every covered cell, each on one of CI's two jax versions
  (``half``, ``helpers.on_one_jax``), alternating over models and strategies: every model and
  every strategy of two cells or more runs on both (tested below), and the library code they
  share runs on both in every other test."""
  for i, (name, model) in enumerate(ZOO.items()):
    for j, strategy in enumerate(STRATEGIES):
      if strategy == "split_logical" and model.logical_rules is None:
        continue   # the model carries no logical axis names
      if strategy == "pipeline_split" and not model.stage_splits:
        continue   # Llama's layers are one nn.scan, mlp_loop's one module: no path boundary
      if strategy == "pipeline_roll" and name != "mlp_loop":
        continue
      if strategy in LEFT_OUT.get(name, ()):
        continue
      yield name, strategy, (i + j) % 2


def cells():
  return [pytest.param(name, strategy, id=f"{name}-{strategy}", marks=on_one_jax(half))
          for name, strategy, half in covering()]


def test_every_model_and_strategy_of_two_cells_runs_on_both_jax_versions():
  """Every model and every strategy with two cells or more has a cell on each of CI's jax
  versions (``covering``)."""
  halves: dict[tuple[str, str], set[int]] = {}
  count: dict[tuple[str, str], int] = {}
  for name, strategy, half in covering():
    for key in (("model", name), ("strategy", strategy)):
      halves.setdefault(key, set()).add(half)
      count[key] = count.get(key, 0) + 1
  assert {k for k, n in count.items() if n >= 2 and halves[k] != {0, 1}} == set()


_REFERENCES: dict[str, tuple] = {}
_INITIAL: dict[str, dict] = {}


def initial(model: ZooModel) -> dict:
  """``model``'s variables as ``init_fn`` makes them on one device, once per model."""
  if model.name not in _INITIAL:
    _INITIAL[model.name] = meta.unbox(jax.jit(model.init_fn)(jax.random.key(0),
                                                             model.make_batch(ROWS)))
  return _INITIAL[model.name]


def reference(model: ZooModel):
  """Single-device training of ``model`` on the global batch, once per model."""
  if model.name not in _REFERENCES:
    _REFERENCES[model.name] = reference_run(model.init_fn, model.loss_fn, optimizer(),
                                            jax.random.key(0), model.make_batch(ROWS), STEPS,
                                            variables=initial(model))
  return _REFERENCES[model.name]


# The cells that create their state with ``trainer.init(rng, batch)``, compiling ``init_fn``
# in the strategy's shardings (3-5 s a compile): each of the three ways state is stored
# (replicated, over stages, ZeRO-sharded) on two models, counting the three pairs of
# test_variables_start_the_state_init_fn_would_make, which shows that the other cells' start,
# the model's variables made once (``trainer.init(..., variables=)``), gives the same state,
# leaf for leaf and sharding for sharding, as the rng path.
INIT_FROM_RNG = {("gemma", "dp"), ("gpt2_fused", "dp"), ("gpt2", "pipeline_4"),
                 ("vit", "pipeline_4"), ("llama", "zero_v3")}
assert INIT_FROM_RNG <= {tuple(cell.values) for cell in cells()}, "INIT_FROM_RNG names no cell"


def global_norm(tree) -> float:
  """``optax.global_norm`` in NumPy (eager jax ops would compile one program per leaf shape)."""
  return float(np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64)))
                           for x in jax.tree.leaves(tree))))


def assert_close_in_bf16_scaled(actual, expected, rtol=GRAD_RTOL):
  """``test_memory_amp``'s bfloat16 check (each leaf within 2**-5 of its largest magnitude),
  with the leaf's scale floored at 2**-6 of the whole tree's: a leaf whose exact value
  vanishes (an attention key bias's gradient: softmax ignores a shift of the logits) holds
  only the bfloat16 rounding of terms the size of the tree's other values."""
  e_leaves = [np.asarray(e, np.float32) for e in jax.tree.leaves(expected)]
  floor = 2.0 ** -6 * max(float(np.max(np.abs(e))) for e in e_leaves)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(expected)[0]]
  for path, a, e in zip(paths, jax.tree.leaves(actual), e_leaves, strict=True):
    a = np.asarray(a, np.float32)
    scale = max(float(np.max(np.abs(e))), floor)
    assert np.max(np.abs(a - e)) <= rtol * scale + 1e-7, (path, np.max(np.abs(a - e)), scale)


class _NoRules:
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False


def run_cell(model: ZooModel, strategy: str):
  """Trains ``model`` with ``strategy`` against the reference; returns (trainer, state)."""
  history, expected = reference(model)
  batch = model.make_batch(ROWS)
  epl.init(STRATEGIES[strategy])
  # A model with logical axis names comes with its rules (MaxText style), whatever the
  # strategy: epljax refuses a name no rule maps. Without a split the "model" axis has size 1.
  rules = nn.logical_axis_rules(model.logical_rules) if model.logical_rules else _NoRules()
  if strategy == "split_annotate":
    epl.annotate(model.annotate_rules(2))
  elif strategy in ("split_logical", "pipeline_auto_split"):
    # The user marks the whole model as one split(2) task graph; the specs come from the
    # model's own logical axis names.
    epl.annotate({model.annotate_pattern.split("/")[0]: epl.split(2)})
  elif strategy == "pipeline_split":
    epl.annotate(model.stage_split_rules(2))   # the module-path rules a user writes
  amp = strategy == "amp_o1"
  tol = DEEP_TOL if model.deep else TOL
  with rules, warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always", StageBalanceWarning)
    trainer = epl.Trainer(model.init_fn, model.loss_fn, optimizer())
    state = trainer.init(jax.random.key(0), batch, variables=(
        None if (model.name, strategy) in INIT_FROM_RNG else initial(model)))
    unbalanced = [str(w.message) for w in caught if w.category is StageBalanceWarning]
    if (model.name, strategy) in SAYS_UNBALANCED:
      assert any("nn.scan" in m for m in unbalanced), unbalanced
    else:
      assert not unbalanced, unbalanced
    shardings = jax.tree.map(lambda x: x.sharding, state)
    dtypes = jax.tree.map(lambda x: x.dtype, state)
    with count_compiles() as compiles:
      for step in range(STEPS):
        state, metrics = trainer.train_step(state, batch)
        if amp:
          np.testing.assert_allclose(metrics["loss"], history[step][0], rtol=LOSS_RTOL)
        else:
          np.testing.assert_allclose(metrics["loss"], history[step][0], **tol)
        if step == 0:
          # SGD's momentum trace after the first step is that step's gradient, exactly
          # (g + 0.9 * 0): the gradients are checked without compiling loss_and_grads too
          # (read in the user's order: fused q/k/v are stored part by part).
          user_opt_state = trainer._require().to_user(state)["opt_state"]
          grads0 = meta.unbox(optax.tree_utils.tree_get(user_opt_state, "trace"))
          if amp:
            assert_close_in_bf16_scaled(grads0, history[0][1])
          else:
            assert_trees_close(grads0, history[0][1], tol)
          # The step's norm (gradients of one shape and layout reduced together) is the
          # reference gradient's global norm, and the step was finite.
          assert bool(metrics["finite"])
          np.testing.assert_allclose(metrics["grad_norm"], global_norm(history[0][1]),
                                     **(dict(rtol=GRAD_RTOL) if amp else tol))
    steps_compiled = [c for c in compiles if "epl_step" in c]
    # The searched plan's step was compiled by the search, which training reuses.
    assert len(steps_compiled) == (0 if strategy == "auto_plan" else 1), steps_compiled
    variables = meta.unbox(trainer.variables(state))
    if amp:
      assert_close_in_bf16_scaled(variables, expected)
    else:
      assert_trees_close(variables, expected, tol)
    assert jax.tree.map(lambda x: x.sharding, state) == shardings
    assert jax.tree.map(lambda x: x.dtype, state) == dtypes
  return trainer, state


def normalized(spec: P) -> P:
  """``spec`` without trailing ``None`` entries: ``P(None, None)`` and ``P()`` mean the same."""
  entries = list(spec)
  while entries and entries[-1] is None:
    entries.pop()
  return P(*entries)


def check_specs(model: ZooModel, trainer, expect_megatron: bool):
  expected = {p: normalized(s) for p, s in model.expected_specs(reference(model)[1]).items()}
  actual = {leaf.path: normalized(leaf.spec) for leaf in trainer.plan.leaves if leaf.trainable}
  assert set(actual) == set(expected)
  if expect_megatron:
    assert dict(trainer.plan.mesh.shape)["model"] == 2
    wrong = {p: (actual[p], expected[p]) for p in expected if actual[p] != expected[p]}
    assert not wrong, f"(actual, Megatron) specs: {wrong}"
  else:   # replicated: no mesh axis of size > 1 (logical rules may name the size-1 "model")
    sizes = dict(trainer.plan.mesh.shape)
    split = {p: s for p, s in actual.items()
             if any(sizes[a] > 1 for a in jax.tree.leaves(tuple(s)))}
    assert not split, split


# The tied embedding of each model that has one: held by the first and the last stage.
TIED = {"gemma": "params/embedder/input_embedding", "gpt2": "params/wte/embedding",
        "gpt2_fused": "params/wte/embedding"}


def check_stages(trainer, name: str, stages: int, chunks: int | None = None):
  """Every stage (chunk, interleaved) holds parameters and work: no more than 1.5x the mean
  FLOPs, more than half the mean parameter bytes; a tied embedding is held by the first and
  the last chunk."""
  plan = trainer.plan
  assert plan.num_stages == stages
  chunks = chunks or stages
  built = trainer._built
  flops, params = stage_balance(built.capture, built.layout.stage_of, chunks)
  assert max(flops) <= 1.5 * sum(flops) / chunks and min(flops) > 0, flops
  assert min(params) > 0.5 * sum(params) / chunks, params
  pipe = plan.pipeline
  if name in TIED:
    assert pipe.shared == {pipe.param_paths.index(TIED[name]): (0, chunks - 1)}
  else:
    assert pipe.shared == {}


def check_zero(state, level: str):
  """Every optimizer-state leaf (and with v3 every parameter leaf) that has a dimension the 8
  data-parallel replicas divide is sharded over ``data``."""
  def unsharded(tree):
    return [x.shape for x in jax.tree.leaves(tree) if hasattr(x, "sharding")
            and any(d % 8 == 0 for d in x.shape)
            and DATA not in jax.tree.leaves(tuple(x.sharding.spec))]

  assert not unsharded(state.opt_state), unsharded(state.opt_state)
  if level == "v3":
    assert not unsharded(state.params), unsharded(state.params)


@pytest.mark.parametrize("name, strategy", cells())
def test_zoo_contract(name, strategy):
  model = ZOO[name]
  trainer, state = run_cell(model, strategy)
  plan = trainer.plan
  if strategy in ("split_annotate", "split_logical"):
    assert plan.num_replicas == 4
    check_specs(model, trainer, expect_megatron=True)
  elif (name, strategy) in SAYS_UNBALANCED:
    assert plan.num_stages == int(strategy.split("_")[1])
  elif strategy == "pipeline_split":
    assert dict(plan.mesh.shape) == {"data": 2, "stage": 2, "model": 2}
    assert plan.pipeline.split == (2, 2)
    assert any(line.startswith("stash     residuals") and "before the model split" in line
               for line in plan.pipeline.describe())    # kept in slots, split over model
    check_stages(trainer, name, 2)
  elif strategy == "pipeline_auto_split":
    assert dict(plan.mesh.shape) == {"data": 2, "stage": 2, "model": 2}
    assert plan.pipeline.split == (2, 2)
    check_stages(trainer, name, 2)
    if name == "llama":   # each stage's layers where stored, in slots split over model
      pipe = plan.pipeline
      assert len(pipe.parts) == len(jax.tree.leaves(state.params["layers"])), pipe.parts
      types = pipe.store.buffers     # the slots' types
      for v, i in pipe.parts.items():   # a part keeps its leaf's model split
        spec = tuple(pipe.store.specs[i])
        assert types[f"part{v - len(pipe.store.avals)}"].spec == spec + (None,) * (
            len(pipe.store.avals[i].shape) - len(spec)), (pipe.param_paths[i], types)
      text = trainer.lower(state, model.make_batch(ROWS)).compile().as_text()
      assert not [c for c in hlo.collectives(text) if c.kind == "all-gather"]
  elif strategy == "pipeline_interleaved":
    check_stages(trainer, name, 2, chunks=4)
    assert plan.pipeline.schedule.num_virtual_stages == 2
    if name == "llama":   # every stacked layer weight read in chunks, none held whole
      assert len(plan.pipeline.parts) == len(jax.tree.leaves(state.params["layers"])), (
          plan.pipeline.parts)
  elif strategy == "pipeline_roll":
    check_stages(trainer, name, 2)
    assert all(row.loop != "-" for row in plan.pipeline.stage_info()), plan
  elif strategy == "pipeline_stage":   # the state is the slots: each stage's row whole
    check_stages(trainer, name, 2)
    assert plan.pipeline.in_stages and set(state.params) == set(plan.pipeline.store.buffers)
    assert all(x.shape[0] == 2 and x.sharding.spec[0] == "stage"
               for x in state.params.values()), {k: x.sharding for k, x in state.params.items()}
  elif strategy.startswith("pipeline_"):
    check_stages(trainer, name, int(strategy.split("_")[1]))
  elif strategy == "auto_plan":
    rows = plan.search
    assert [r.chosen for r in rows].count(True) == 1 and rows[0].chosen, rows
    assert rows[0].compiled and rows[0].reason == "" and all(r.reason for r in rows[1:])
    assert {a: n for a, n in plan.mesh.shape.items() if n > 1} == {
        a: n for a, n in rows[0].mesh_shape.items() if n > 1}, (plan.mesh, rows[0])
    assert [r.predicted_step_s for r in rows if r.compiled] == sorted(
        r.predicted_step_s for r in rows if r.compiled), rows
    # Two stages were weighed (data x stage), or the plan says why this model has none.
    assert (any(r.mesh_shape == {"data": 4, "stage": 2, "model": 1} for r in rows)
            or any(n.startswith("stage=2 not searched") for n in plan.search_notes)), (
        plan.search_notes)
  else:
    assert plan.num_replicas == 8 and plan.num_stages == 1
    if strategy != "zero_v3":   # v3 shards the parameters over data (check_zero)
      check_specs(model, trainer, expect_megatron=False)
  if strategy.startswith("zero_"):
    check_zero(state, strategy.split("_")[1])
  if strategy == "gc_auto":
    lines = [f for f in plan.features if "checkpoint" in f.lower()]
    assert lines, plan.features
  if strategy == "amp_o1":
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}


_REFETCHES: dict[str, int] = {}   # model -> matmul units whose stored weight is re-fetched


# Each kind of matmul unit the re-fetch wraps: dense layers in a Python loop (Gemma), in an
# nn.scan (Llama), a convolution (ViT), fused Conv1D kernels stored as read and transposed
# (gpt2_fused, gpt2_fused_t). GPT-2 and the looped MLP hold only kinds these hold.
REFETCH_MODELS = ["gemma", "llama", "vit", "gpt2_fused", "gpt2_fused_t"]


@pytest.mark.parametrize("name", REFETCH_MODELS)
def test_zoo_zero_v3_with_the_refetch_of_gpu_and_tpu(name, monkeypatch):
  """ZeRO v3's backward re-fetch as GPU and TPU run it (``recompute.refetch``: a barrier over
  the stored shard alone, not tied to the cotangent), forced here on CPU: the ``zero_v3`` cell's
  contract (exact against the reference, one compile) on each kind of matmul unit. A kernel stored
  ``(out, in)`` and read transposed is re-fetched as stored: ``gpt2_fused_t`` re-fetches as
  many weights as ``gpt2_fused``, whose kernels are the same read untransposed."""
  from epljax.memory import uses
  real, seen = uses.refetch, []

  def as_on_gpu(stored, cts, *, platform):
    seen.append(platform)
    return real(stored, cts, platform="gpu")

  monkeypatch.setattr(uses, "refetch", as_on_gpu)
  _, state = run_cell(ZOO[name], "zero_v3")
  assert seen
  _REFETCHES[name] = len(seen)
  if name == "gpt2_fused_t" and "gpt2_fused" in _REFETCHES:
    assert len(seen) == _REFETCHES["gpt2_fused"]
  check_zero(state, "v3")


@pytest.mark.parametrize("name, strategy", [("gpt2_fused", "zero_v3"), ("llama", "pipeline_4"),
                                            ("vit", "amp_o1")])
def test_variables_start_the_state_init_fn_would_make(name, strategy):
  """``trainer.init(rng, batch, variables=init_fn's variables)`` makes the state that
  ``trainer.init(rng, batch)`` compiles: every leaf equal, in the same sharding and dtype
  (fused q/k/v stored part by part, ZeRO v3's sharded parameters, the pipeline's storage over
  ``stage`` of Llama's scanned layers, AMP's float32 masters)."""
  model = ZOO[name]
  batch = model.make_batch(ROWS)
  epl.init(STRATEGIES[strategy])
  rules = nn.logical_axis_rules(model.logical_rules) if model.logical_rules else _NoRules()
  with rules:
    made = epl.Trainer(model.init_fn, model.loss_fn, optimizer()).init(jax.random.key(0), batch)
    given = epl.Trainer(model.init_fn, model.loss_fn, optimizer()).init(
        jax.random.key(0), batch, variables=jax.tree.map(np.asarray, initial(model)))
  assert jax.tree.structure(given) == jax.tree.structure(made)
  for a, b in zip(jax.tree.leaves(given), jax.tree.leaves(made)):
    assert (a.sharding, a.dtype, a.shape) == (b.sharding, b.dtype, b.shape)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
