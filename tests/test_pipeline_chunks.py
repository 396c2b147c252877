"""Scanned layers across pipeline stages (``pipeline/chunks.py``): the automatic cut splits an
``nn.scan`` into one scan per stage, each stage reads its layers where they are stored, and
training stays exact against one device."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.extend import core as jcore

import epljax as epl
from epljax import hlo
from epljax.pipeline import PipelineWarning
from epljax.pipeline.auto import StageBalanceWarning
from epljax.pipeline.chunks import scan_splitter, split_scan
from epljax.pipeline.storage import interleave_rounds
from epljax.plan import EVERY_STAGE
from helpers import classification_batch, cross_entropy, linen_fns
from pipeline_helpers import check_matches_reference

WIDTH = 16


def _stacked_scan(ws, bs, xs, h):
  """A scan over stacked weights with a carry, a per-step input and stacked outputs."""
  def body(c, layer):
    w, b, x = layer
    c = jnp.tanh(c @ w + b + x)
    return c, jnp.sum(c, axis=-1)
  return lax.scan(body, h, (ws, bs, xs))


def _scan_args(layers=6):
  k = jax.random.split(jax.random.key(0), 4)
  return (jax.random.normal(k[0], (layers, 8, 8)) * 0.4, jax.random.normal(k[1], (layers, 8)),
          jax.random.normal(k[2], (layers, 3, 8)), jax.random.normal(k[3], (3, 8)))


def test_a_split_scan_computes_the_same_values_in_stage_chunks():
  args = _scan_args()
  closed = jax.make_jaxpr(_stacked_scan)(*args)
  position = [e.primitive.name for e in closed.jaxpr.eqns].index("scan")
  split = scan_splitter(closed, position, 3, num_params=2)
  assert callable(split), split
  rewritten = split(closed)
  scans = [e for e in rewritten.jaxpr.eqns if e.primitive.name == "scan"]
  assert [e.params["length"] for e in scans] == [2, 2, 2]
  got = jcore.jaxpr_as_fun(rewritten)(*args)
  want = jcore.jaxpr_as_fun(closed)(*args)
  for g, w in zip(got, want, strict=True):
    np.testing.assert_array_equal(g, w)   # same arithmetic, same order


@pytest.mark.parametrize("why, fn, parts, num_params", [
    ("reverse", lambda ws, bs, xs, h: lax.scan(
        lambda c, l: (jnp.tanh(c @ l[0] + l[1]), None), h, (ws, bs), reverse=True), 2, 2),
    ("do not divide", _stacked_scan, 4, 2),
    ("no parameter", _stacked_scan, 2, 0),
])
def test_a_scan_that_cannot_be_split_says_why(why, fn, parts, num_params):
  closed = jax.make_jaxpr(fn)(*_scan_args())
  position = [e.primitive.name for e in closed.jaxpr.eqns].index("scan")
  found = scan_splitter(closed, position, parts, num_params)
  assert isinstance(found, str) and why in found, found


def test_splitting_checks_the_program_still_has_the_scan_there():
  closed = jax.make_jaxpr(lambda ws, bs, xs, h: _stacked_scan(ws, bs, xs, 2 * h))(*_scan_args())
  assert [e.primitive.name for e in closed.jaxpr.eqns] == ["mul", "scan"]
  with pytest.raises(AssertionError, match="no longer the scan"):
    split_scan(closed, position=0, parts=2)
  with pytest.raises(AssertionError, match="no longer the scan"):   # another length there
    split_scan(closed, position=1, parts=2, length=8)
  with pytest.raises(AssertionError, match="no longer the scan"):   # does not divide
    split_scan(closed, position=1, parts=4)


class _Layer(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    return h + nn.Dense(WIDTH)(nn.gelu(nn.Dense(WIDTH)(nn.LayerNorm()(h)))), None


class Scanned(nn.Module):
  """A classifier whose residual layers run under ``nn.scan`` (weights stacked by layer)."""
  layers: int

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(WIDTH)(x)
    layers = nn.scan(_Layer, variable_axes={"params": 0}, split_rngs={"params": True},
                     length=self.layers)
    h, _ = layers()(h, None)
    return nn.Dense(10)(h)


def _train(layers: int, optimizer, **config):
  epl.init({"auto.auto_parallel": True, "pipeline.num_stages": 2,
            "pipeline.num_micro_batch": 4, **config})
  with warnings.catch_warnings():
    warnings.simplefilter("error", StageBalanceWarning)   # balanced: no warning
    warnings.simplefilter("error", PipelineWarning)       # every stacked leaf a part
    return check_matches_reference(Scanned(layers), classification_batch(16), optimizer)


def _gated_fns(layers: int = 8):
  """Plain JAX: a stem, then a scan over stacked weights *and* a per-layer gate computed from
  another parameter (a stacked input that is not a parameter, like dropout keys)."""
  def init_fn(rng, batch):
    k = jax.random.split(rng, 4)
    return {"params": {"stem": jax.random.normal(k[0], (20, WIDTH)) * 0.2,
                       "mix": jax.random.normal(k[1], (WIDTH, WIDTH)) * 0.2,
                       "w": jax.random.normal(k[2], (layers, WIDTH, WIDTH)) * 0.3,
                       "b": jnp.zeros((layers, WIDTH)),
                       "head": jax.random.normal(k[3], (WIDTH, 10)) * 0.2}}

  def loss_fn(variables, batch):
    p = variables["params"]
    h = jnp.tanh(jnp.tanh(batch["x"] @ p["stem"]) @ p["mix"])
    gates = jax.nn.sigmoid(p["mix"][:layers] * jnp.arange(1.0, layers + 1.0)[:, None])

    def layer(c, xs):
      w, b, g = xs
      return c + g * jnp.tanh(c @ w + b), None

    h, _ = lax.scan(layer, h, (p["w"], p["b"], gates))
    return cross_entropy(h @ p["head"], batch["y"])

  return init_fn, loss_fn


def test_each_stage_takes_its_own_chunk_with_a_stacked_input_that_is_not_a_parameter():
  for stages in (2, 4):
    epl.init({"auto.auto_parallel": True, "pipeline.num_stages": stages,
              "pipeline.num_micro_batch": 4})
    with warnings.catch_warnings():
      warnings.simplefilter("error", PipelineWarning)   # mix[:8] is no stack of layers
      trainer, _ = check_matches_reference(None, classification_batch(16), optax.sgd(0.1),
                                           fns=_gated_fns())
    pipe = trainer.plan.pipeline
    # w and b: each stage reads its rows where they are stored; no stage holds them whole.
    chunked = sorted(pipe.param_paths[i] for i in pipe.parts.values())
    assert chunked == ["params/b", "params/w"], pipe.parts
    assert pipe.shared == {}, pipe.shared
    assert [dict(s.parts) for s in pipe.stages] == [dict(pipe.stages[0].parts)] * stages


@pytest.mark.parametrize("l2_first", [True, False], ids=["l2_first", "l2_last"])
def test_a_stack_also_read_outside_its_scan_is_held_whole_and_says_so(l2_first):
  # An L2 term over every parameter reads the stacked layers whole, outside the scan: the
  # stages cannot take one chunk each, so the stack is held whole. Exact, but it warns.
  model = Scanned(4)

  def loss_fn(variables, batch):
    l2 = (lambda: sum(jnp.sum(x * x) for x in jax.tree.leaves(variables)))
    first = l2() if l2_first else 0.0
    loss = cross_entropy(model.apply(variables, batch["x"]), batch["y"])
    return loss + 1e-3 * (first if l2_first else l2())

  epl.init({"auto.auto_parallel": True, "pipeline.num_stages": 2,
            "pipeline.num_micro_batch": 4})
  with pytest.warns(PipelineWarning, match=(
      r"(?s)^6 stacked parameters \('params/Scan_Layer_0/Dense_0/bias', .* are read in 2 row "
      r"chunks by the pipeline's stages.*holds them whole \(9\.0 KiB in all, where one chunk "
      r"is\s+4\.5 KiB\).*The first, 'params/Scan_Layer_0/Dense_0/bias' \(shape \(4, 16\)\): a \w+ "
      r"reads it other than as one stage's chunk\.\nTo store one chunk per stage")) as caught:
    trainer, _ = check_matches_reference(
        None, classification_batch(16), optax.sgd(0.1),
        fns=(lambda rng, batch: model.init(rng, batch["x"]), loss_fn))
  assert len([w for w in caught if w.category is PipelineWarning]) == 1   # one for all six
  pipe = trainer.plan.pipeline
  assert pipe.parts == {}, pipe.parts
  if l2_first:   # stage 0 runs the L2 term: it holds the whole stack, stage 1 its chunk's copy
    kernel = pipe.param_paths.index("params/Scan_Layer_0/Dense_0/kernel")
    assert [kernel in s.params for s in pipe.stages] == [True, False]


def _all_to_all_bytes(text: str) -> int:
  return sum(c.bytes for c in hlo.collectives(text) if c.kind == "all-to-all")


@pytest.mark.parametrize("optimizer, config", [
    (optax.adam(1e-2), {"zero.level": "v1"}),
    (optax.adamw(1e-2, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
     {"zero.level": "v3"}),
], ids=["adam-zero_v1", "adamw_masked-zero_v3"])
def test_scanned_layers_train_exactly_on_stages_with_any_optimizer(optimizer, config):
  trainer, state = _train(4, optimizer, **config)
  pipe = trainer.plan.pipeline
  assert pipe.shared == {}, pipe.shared       # no stage holds another stage's layers
  assert len(pipe.parts) == 6, pipe.parts     # 2 Dense kernels and biases, LayerNorm
  for leaf in trainer.plan.leaves:
    if leaf.shape and leaf.shape[0] == 4 and len(leaf.shape) > 1:
      assert tuple(leaf.spec)[0] == "stage", (leaf.path, leaf.spec)


def test_each_stage_reads_its_layers_where_stored_whatever_the_depth():
  # Compiled only: the scanned layers train exactly on stages in the tests around this one.
  texts = {}
  for layers in (4, 8):
    epl.init({"auto.auto_parallel": True, "pipeline.num_stages": 2,
              "pipeline.num_micro_batch": 4})
    trainer = epl.Trainer(*linen_fns(Scanned(layers)), optax.sgd(0.1, momentum=0.9))
    with warnings.catch_warnings():
      warnings.simplefilter("error", StageBalanceWarning)
      warnings.simplefilter("error", PipelineWarning)
      texts[layers] = trainer.compile(classification_batch(16)).compiled.as_text()
    assert "parts     6 stacked leaves" in str(trainer.plan)
    assert trainer.plan.pipeline.shared == {}
    by_layer = [leaf.path for leaf in trainer.plan.leaves if leaf.taskgraph == EVERY_STAGE]
    assert len(by_layer) == 6, by_layer   # the task graph table counts them in each stage
  # Only the stem and the head travel (one all-to-all per dtype each way): the stacked layers
  # never do, so doubling them moves no more bytes, and the program does not grow with depth.
  assert _all_to_all_bytes(texts[4]) == _all_to_all_bytes(texts[8]) > 0
  assert len(texts[8]) < 1.02 * len(texts[4]), (len(texts[4]), len(texts[8]))


def test_scanned_layers_interleave_exactly_with_virtual_stages():
  # 8 layers in S x v = 4 chunks of 2: chunk c on stage c % 2, so stage 0 runs layers 0-1 and
  # 4-5, but stores 0-3: ppermutes bring layers 4-5 (and take 2-3 to stage 1) every step.
  trainer, state = _train(8, optax.adam(1e-2), **{"pipeline.num_virtual_stages": 2})
  pipe = trainer.plan.pipeline
  assert len(pipe.stages) == 4 and pipe.schedule.num_virtual_stages == 2
  assert len(pipe.parts) == 6 and pipe.shared == {}, (pipe.parts, pipe.shared)
  assert "(chunks s, s + 2, ...), moved from where stored" in str(trainer.plan)
  text = trainer.lower(state, classification_batch(16)).compile().as_text()
  # Chunks 1 and 2 change stage (1 is stored on stage 0 and runs on 1, 2 the other way), each
  # a quarter of every stacked leaf, there and back (its gradient): half the stacked bytes in
  # collective-permutes (the loop's activations add theirs). Nothing is gathered whole.
  collectives = hlo.collectives(text)
  stacked = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params)
                if x.shape[0] == 8)
  assert not [c for c in collectives if c.kind == "all-gather"]
  assert sum(c.bytes for c in collectives if c.kind == "collective-permute") >= stacked // 2


# More stages than chunks per stage, more chunks per stage than stages (v=3 > S=2, and not a
# power of 2: how every chunk moves for any S and v is testinterleave_rounds'), and ZeRO v3.
@pytest.mark.parametrize("stages, virtual, layers, config", [
    (4, 2, 8, {}), (2, 3, 12, {}), (2, 2, 8, {"zero.level": "v3"})],
    ids=["S4v2", "S2v3", "S2v2-zero_v3"])
def test_scanned_layers_interleave_exactly_with_more_stages_or_chunks(stages, virtual, layers,
                                                                      config):
  epl.init({"auto.auto_parallel": True, "pipeline.num_stages": stages,
            "pipeline.num_virtual_stages": virtual, "pipeline.num_micro_batch": 4, **config})
  trainer, _ = check_matches_reference(Scanned(layers), classification_batch(16),
                                       optax.adam(1e-2))
  pipe = trainer.plan.pipeline
  assert len(pipe.stages) == stages * virtual and len(pipe.parts) == 6 and pipe.shared == {}


@pytest.mark.parametrize("stages, virtual", [(2, 2), (4, 2), (2, 4), (3, 2), (4, 3), (8, 4)])
def testinterleave_rounds_move_every_chunk_once_to_its_stage(stages, virtual):
  rounds = interleave_rounds(stages, virtual)
  assert len(rounds) == virtual
  for sent in rounds:   # one chunk from each stage, from its stored ones, none received twice
    assert [c // virtual for c in sent] == list(range(stages))
    assert sorted(c % stages for c in sent) == list(range(stages))
  assert sorted(c for sent in rounds for c in sent) == list(range(stages * virtual))


def test_a_scan_that_does_not_divide_into_the_stages_says_so():
  epl.init({"auto.auto_parallel": True, "pipeline.num_stages": 2,
            "pipeline.num_micro_batch": 2})
  model = Scanned(3)
  trainer = epl.Trainer(lambda k, b: model.init(k, b["x"]),
                        lambda v, b: jnp.mean(model.apply(v, b["x"]) ** 2), optax.sgd(0.1))
  with pytest.warns(StageBalanceWarning, match="its 3 iterations do not divide into 2 stages"):
    trainer.init(jax.random.key(0), classification_batch(8))


class _NormedLayer(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    return h + nn.BatchNorm(use_running_average=False)(nn.Dense(WIDTH)(h)), None


class ScannedWithStats(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(WIDTH)(x)
    layers = nn.scan(_NormedLayer, variable_axes={"params": 0, "batch_stats": 0},
                     split_rngs={"params": True}, length=8)
    return nn.Dense(10)(layers()(h, None)[0])


def test_a_scan_that_updates_model_state_is_not_split_and_says_why():
  epl.init({"auto.auto_parallel": True, "pipeline.num_stages": 2,
            "pipeline.num_micro_batch": 2})
  model = ScannedWithStats()

  def loss_fn(variables, batch):
    logits, updates = model.apply(variables, batch["x"], mutable=["batch_stats"])
    return cross_entropy(logits, batch["y"]), updates

  trainer = epl.Trainer(lambda k, b: model.init(k, b["x"]), loss_fn, optax.sgd(0.1),
                        mutable=["batch_stats"])
  # The stage holding the scan keeps its statistics whole; with 4 replicas of 2 stages its
  # batch means are averaged over the replicas in every iteration (pipeline/stats.py; exact in
  # test_pipeline_state.py).
  with pytest.warns(StageBalanceWarning, match="reads model state"):
    trainer.init(jax.random.key(0), classification_batch(16))
  assert ("state     stage 1 'stage_1' keeps 2 model state leaves (1.0 KiB), updated by each "
          "micro batch's forward in order; its 2 batch means averaged over the replicas "
          "(data)") in str(trainer.plan)
