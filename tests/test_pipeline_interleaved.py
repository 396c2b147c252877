"""Interleaved pipeline (``pipeline.num_virtual_stages = v``): S x v chunks, chunk c on stage
c % S, activations round the ring of stages; tick tables, bubble, equivalence, errors."""

import functools
import re
import warnings

import flax.linen as nn
import jax
import optax
import pytest

import epljax as epl
from epljax.errors import ConfigError, PlanError
from epljax.pipeline import PipelineWarning, make_schedule
from epljax.pipeline.render import render_schedule, schedule_text
from epljax.pipeline.schedules import check_schedule
from helpers import DEEP_TOL, TOL, classification_batch, linen_fns
from models import ZOO, ZooModel
from test_pipeline_auto import Plain
from pipeline_helpers import Stack, adamw, check_matches_reference


class FourScopes(nn.Module):
  """Four different chunks from named scopes: with v=2, stage 0 runs 'a' and 'c', stage 1
  'b' and 'd'; every hop carries another activation shape, 'b' -> 'c' wraps to stage 0."""

  @nn.compact
  def __call__(self, x):
    x = x * 0.5
    with epl.replicate(1, name="a"):
      h = nn.relu(nn.Dense(24)(x))
    with epl.replicate(1, name="b"):
      h = nn.tanh(nn.Dense(20)(h))
    with epl.replicate(1, name="c"):
      h = nn.gelu(nn.Dense(16)(h))
    with epl.replicate(1, name="d"):
      return nn.Dense(10)(h)


def _config(micro, virtual, strategy="PreferBackward", **more):
  return {"pipeline.num_micro_batch": micro, "pipeline.num_virtual_stages": virtual,
          "pipeline.strategy": strategy, **more}


# name: (config, model, rows, (replicas, stages), chunks)
CASES = {
    # S=2, v=2: the first and a middle chunk share stage 0 (distinct branches on one device).
    "stack_s2_v2_1f1b": (_config(4, 2), Stack(stages=4), 64, (4, 2), 4),
    "scopes_s2_v2_gpipe": (_config(4, 2, "PreferForward"), FourScopes(), 64, (4, 2), 4),
    # S=4, v=2: two groups of S micro batches go round the ring twice.
    "stack_s4_v2_1f1b": (_config(8, 2), Stack(stages=8), 64, (2, 4), 8),
    # The zoo's GPT-2 cut into S x v = 4 chunks by auto.auto_parallel: attention, and the tied
    # embedding held by chunk 0 (stage 0) and chunk 3 (stage 1).
    "gpt2_auto_s2_v2_1f1b": (_config(2, 2, **{"auto.auto_parallel": True,
                                              "pipeline.num_stages": 2}), ZOO["gpt2"], 16,
                             (4, 2), 4),
}


@functools.cache
def run_case(name):
  config, model, rows, _, _ = CASES[name]
  epl.init(config)
  with warnings.catch_warnings():
    warnings.simplefilter("error", PipelineWarning)
    if isinstance(model, ZooModel):
      return check_matches_reference(
          None, model.make_batch(rows), optax.sgd(0.1, momentum=0.9),
          fns=(model.init_fn, model.loss_fn), tol=DEEP_TOL if model.deep else TOL)
    return check_matches_reference(model, classification_batch(rows), adamw())


# -- the tick tables ------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["PreferBackward", "PreferForward"])
@pytest.mark.parametrize("stages, micro, virtual",
                         [(2, 2, 2), (2, 4, 2), (4, 8, 2), (4, 4, 3), (3, 6, 2), (4, 16, 4)])
def test_interleaved_tables_respect_every_dependency_and_have_the_small_bubble(
    strategy, stages, micro, virtual):
  sched = make_schedule(strategy, stages, micro, virtual)
  check_schedule(sched)
  bubble = (stages - 1) / (virtual * micro + stages - 1)
  assert sched.bubble_fraction == pytest.approx(bubble)
  # Measured from the tables: a lockstep tick lasts as long as its busiest stage's slots.
  for f, b in [(1, 1), (1, 2), (2, 3)]:
    assert sched.measured_bubble(f, b) == pytest.approx(bubble, abs=1e-12)
  assert sched.measured_bubble() < make_schedule(strategy, stages, micro).measured_bubble()
  # Chunk j of stage s is model chunk s + jS: every stage runs each of its chunks M times.
  for s in range(stages):
    for j in range(virtual):
      assert ((sched.forward[:, s] >= 0) & (sched.forward_chunk[:, s] == j)).sum() == micro
  if strategy == "PreferBackward":
    assert sched.num_ticks == virtual * micro + virtual * stages + stages - 2
    # Megatron's interleaved 1F1B: warm-up 2(S - s - 1) + (v - 1)S chunks, plus one.
    assert sched.kept_per_stage == [min(virtual * micro, virtual * stages + stages - 1 - 2 * s)
                                    for s in range(stages)]
  else:
    assert sched.num_ticks == 2 * virtual * micro + 2 * stages - 3
    assert sched.kept_per_stage == [virtual * micro] * stages


@pytest.mark.parametrize("strategy", ["PreferBackward", "PreferForward"])
@pytest.mark.parametrize("stages, micro", [(2, 1), (4, 8), (3, 7)])
def test_measured_bubble_of_the_plain_schedules(strategy, stages, micro):
  sched = make_schedule(strategy, stages, micro)
  assert sched.measured_bubble() == pytest.approx((stages - 1) / (micro + stages - 1))


def test_interleaved_schedule_as_text_and_picture(tmp_path):
  sched = make_schedule("PreferBackward", 2, 2, 2)
  assert schedule_text(sched) == [
      "stage 0  F0.0     F1.0     F0.1     F1.1     B0.1     B1.1     B0.0     B1.0",
      "stage 1  .        F0.0     F1.0     F0.1B0.1 F1.1B1.1 B0.0     B1.0     .",
  ]
  assert "interleaved 1F1B" in sched.describe() and "1/5 = 20%" in sched.describe()
  pytest.importorskip("matplotlib")
  path = render_schedule([make_schedule("PreferForward", 4, 8), make_schedule(
      "PreferBackward", 4, 8), make_schedule("PreferBackward", 4, 8, 2)],
      str(tmp_path / "schedule.png"))
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_micro_batches_must_fill_groups_of_stages():
  with pytest.raises(PlanError, match=re.escape(
      "pipeline.num_micro_batch=6 is not a multiple of the 4 pipeline stages")) as e:
    make_schedule("PreferBackward", 4, 6, 2)
  assert "pipeline.num_micro_batch=4 or 8" in str(e.value)


# -- against the single-device reference ----------------------------------------------------
@pytest.mark.parametrize("name", [
    "stack_s2_v2_1f1b", "scopes_s2_v2_gpipe",
    pytest.param("stack_s4_v2_1f1b", marks=pytest.mark.slow),
    pytest.param("gpt2_auto_s2_v2_1f1b", marks=pytest.mark.slow)])
def test_interleaved_matches_single_device(name):
  _, _, _, (replicas, stages), chunks = CASES[name]
  trainer, _ = run_case(name)
  plan = trainer.plan
  assert (plan.num_replicas, plan.num_stages) == (replicas, stages)
  pipe = plan.pipeline
  assert len(pipe.stages) == chunks and pipe.schedule.num_virtual_stages == chunks // stages
  assert "interleaved" in pipe.describe()[0]
  if name.startswith("gpt2"):
    assert pipe.shared == {pipe.param_paths.index("params/wte/embedding"): (0, 3)}


def test_activations_go_round_the_ring():
  """With v > 1 the last stage sends to the first (chunk S-1 feeds chunk S) and the first
  sends gradients to the last: in the compiled step each ppermute of the tick loop is a
  permutation of all devices, a ring inside each replica (without virtual stages stage S-1
  sends no activations and stage 0 no gradients)."""
  trainer, _ = run_case("stack_s2_v2_1f1b")
  mesh = trainer.plan.mesh
  loop = re.findall(r"collective-permute\([^\n]*source_target_pairs=\{([{}\d,]*)\}[^\n]*"
                    r"op_name=\"[^\"]*/ppermute\"", trainer.plan.compiled.as_text())
  assert len(loop) >= 2
  replica_of = {d.id: r for r, row in enumerate(mesh.devices[:, :, 0]) for d in row}
  for pairs in loop:
    pairs = [tuple(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)\}", pairs)]
    assert sorted(a for a, _ in pairs) == sorted(b for _, b in pairs) == sorted(replica_of)
    assert all(replica_of[a] == replica_of[b] for a, b in pairs)


# -- refused --------------------------------------------------------------------------------
def _init(config, model, rows=64):
  epl.init(config)
  init_fn, loss_fn = linen_fns(model)
  epl.Trainer(init_fn, loss_fn, optax.sgd(0.1)).init(jax.random.key(0),
                                                      classification_batch(rows))


def test_chunks_must_divide_into_stages():
  with pytest.raises(PlanError, match=r"pipeline.num_virtual_stages=2: the model has 3 stage "
                     r"task graphs .* cut the model into 4 stages"):
    _init(_config(4, 2), Stack(stages=3))


def test_virtual_stages_need_a_pipeline():
  with pytest.raises(PlanError, match=r"pipeline.num_virtual_stages=2 interleaves pipeline "
                     r"stages, but the model's task graphs .* a single one"):
    _init(_config(4, 2), Plain())


def test_interleaved_micro_batches_refused_in_the_plan():
  with pytest.raises(PlanError, match=r"num_micro_batch=2 is not a multiple of the 4 "):
    _init(_config(2, 2), Stack(stages=8), rows=32)


def test_config_key():
  assert epl.Config().pipeline.num_virtual_stages == 1
  with pytest.raises(ConfigError, match=r"'pipeline.num_virtual_stages' .* must be >= 1"):
    epl.Config({"pipeline.num_virtual_stages": 0})


def test_interleaving_split_stages_is_refused_with_the_fix():
  """Tensor-parallel stages keep their parameters whole (slots), which has no chunk rows."""
  from test_pipeline_split import SplitDefault

  with pytest.raises(PlanError, match=r"(?s)num_virtual_stages=2 .* tensor-parallel \(epl.split\) "
                     r"stages .* Set pipeline.num_virtual_stages=1"):
    _init(_config(4, 2), SplitDefault(stages=4))
