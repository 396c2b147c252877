"""Cost is a tested property: each strategy's compiled step against a hand-written ``jax.jit``.

For data parallelism, Megatron ``split``, gradient checkpointing and ZeRO v1/v3, the hand-written
step is what a JAX user writes for the same layout: ``value_and_grad`` and the optax update,
jitted with the shardings epljax chose (``trainer.plan`` / the state's shardings), and
``jax.checkpoint`` on each block for checkpointing. For pipeline stages it is the hand-written
``shard_map`` GPipe over stacked blocks of ``bench/pipelines/compile.py``, against epljax's
default 1F1B of the same blocks under ``nn.scan`` cut by ``auto.auto_parallel``. epljax's step
does more (the global norm, the non-finite check and skip, the step metrics); these tests bound
what that costs, from the compiled programs alone (deterministic, no timing):

- FLOPs (``cost_analysis``) within 5%;
- temp bytes per device (``memory_analysis``) within 5%;
- bytes accessed (``cost_analysis``, each conditional's results counted once:
  ``hlo.conditional_result_bytes``) within 5%;
- the same collectives with the same bytes (HLO).

The step time behind these figures is measured side by side in ``bench/overhead.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import epljax as epl
from epljax import hlo

VOCAB, WIDTH, HEADS, LAYERS, LENGTH, ROWS = 256, 64, 4, 4, 64, 64
TOLERANCE = 0.05


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    x = x + nn.MultiHeadDotProductAttention(HEADS, name="attn")(nn.LayerNorm()(x), mask=mask)
    h = nn.gelu(nn.Dense(4 * WIDTH, name="c_fc")(nn.LayerNorm()(x)))
    return x + nn.Dense(WIDTH, name="c_proj")(h)


class GPT(nn.Module):
  """A GPT of ``LAYERS`` blocks; ``split`` wraps the blocks in ``epl.split`` (Megatron),
  ``remat`` checkpoints each block by hand (the hand-written side of gradient checkpointing)."""
  split: bool = False
  remat: bool = False

  @nn.compact
  def __call__(self, ids):
    x = nn.Embed(VOCAB, WIDTH)(ids)
    x = x + self.param("wpe", nn.initializers.normal(0.02), (LENGTH, WIDTH))
    block = nn.remat(Block) if self.remat else Block
    for i in range(LAYERS):
      if self.split:
        with epl.split(4, name="blocks"):
          x = block(name=f"h_{i}")(x)
      else:
        x = block(name=f"h_{i}")(x)
    return nn.Dense(VOCAB, name="head")(nn.LayerNorm()(x))


def batch() -> dict:
  ids = np.random.default_rng(0).integers(0, VOCAB, (ROWS, LENGTH + 1)).astype(np.int32)
  return {"x": ids[:, :-1], "y": ids[:, 1:]}


def lm_loss(model: nn.Module):
  def loss_fn(variables, b):
    logits = model.apply(variables, b["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()
  return loss_fn


@dataclasses.dataclass(frozen=True)
class Cost:
  flops: float
  bytes_accessed: float
  temp: int
  collectives: dict

  @classmethod
  def of(cls, compiled) -> Cost:
    costs = compiled.cost_analysis()
    costs = costs[0] if isinstance(costs, list) else costs
    text = compiled.as_text()
    return cls(flops=costs["flops"],
               bytes_accessed=costs["bytes accessed"] - hlo.conditional_result_bytes(text),
               temp=compiled.memory_analysis().temp_size_in_bytes,
               collectives=hlo.summarize(hlo.collectives(text)))


def hand_written_step(trainer, state, model: nn.Module, optimizer, b):
  """The step a user writes by hand, jitted with the shardings of epljax's state and batch."""
  shardings = trainer._require().state_shardings
  param_sh, opt_sh = shardings.params, shardings.opt_state
  batch_sh = state_batch_sharding(trainer)
  loss_fn = lm_loss(model)

  def step(params, opt_state, b):
    loss, grads = jax.value_and_grad(lambda p: loss_fn({"params": p}, b))(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  jitted = jax.jit(step, in_shardings=(param_sh, opt_sh, batch_sh),
                   out_shardings=(param_sh, opt_sh, NamedSharding(trainer.plan.mesh, P())),
                   donate_argnums=(0, 1))
  return jitted.lower(state.params, state.opt_state, trainer.shard_batch(b)).compile()


def state_batch_sharding(trainer) -> NamedSharding:
  return NamedSharding(trainer.plan.mesh, P(trainer.plan.batch_axes))


def planned_state(trainer, b):
  """What ``trainer.init(key(0), b)`` plans and returns, as shapes and shardings alone: every
  figure here is read from the compiled step, which lowers from the state's shapes and
  shardings, so the random initialization is not compiled (4-5 s a case). The step and the
  hand-written step lower to the same module text as from ``trainer.init``'s arrays (checked
  for every case and the pipeline, jax 0.10.2, 2026-11-25)."""
  rng = jax.random.key(0)
  built = trainer._build(rng, b)
  return jax.eval_shape(built.init_jit, rng, trainer.shard_batch(b))


@functools.cache
def costs(case: str) -> tuple[Cost, Cost]:
  """(epljax, hand-written) costs of one case's step; shared by the assertions on it."""
  config = {"none": {}, "split": {}, "gc": {"gradient_checkpoint.type": "auto"},
            "zero_v1": {"zero.level": "v1"}, "zero_v3": {"zero.level": "v3"}}[case]
  epl.init(config)
  split = case == "split"
  if not split:
    epl.set_default_strategy(epl.replicate(1))
  model = GPT(split=split)
  optimizer = optax.adamw(1e-3)
  b = batch()
  trainer = epl.Trainer(lambda k, bb: model.init(k, bb["x"]), lm_loss(model), optimizer)
  state = planned_state(trainer, b)
  ours = Cost.of(trainer.lower(state, b).compile())
  hand_model = GPT(split=split, remat=case == "gc")
  theirs = Cost.of(hand_written_step(trainer, state, hand_model, optimizer, b))
  return ours, theirs


CASES = ["none", "split", "gc", "zero_v1", "zero_v3"]

# Bytes accessed above 5%, measured 2026-11-25 (jax 0.10.2 / 0.11.2), bounds just above:
# - ZeRO reduce-scatters the gradients and all-gathers the updated parameters (v3 also gathers
#   each parameter again for its backward use, FSDP's trade of traffic for memory): more,
#   smaller kernels than GSPMD's one all-reduce (v1 1.08x / ~1.1x, v3 1.10x / 1.12x);
# - gradient checkpointing "auto" saves less than nn.remat on each block (temp 0.23x) and
#   reads more to recompute (1.045x / 1.061x).
BYTES_TOLERANCE = {"gc": 0.08, "zero_v1": 0.15, "zero_v3": 0.15}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("figure", ["flops", "temp", "bytes_accessed"])
def test_step_costs_what_a_hand_written_step_costs(case, figure):
  ours, theirs = costs(case)
  ratio = getattr(ours, figure) / getattr(theirs, figure)
  bound = 1 + (BYTES_TOLERANCE.get(case, TOLERANCE) if figure == "bytes_accessed" else TOLERANCE)
  assert ratio <= bound, (
      f"{case}: the epljax step's {figure} is {ratio:.3f}x the hand-written step's "
      f"({getattr(ours, figure):.4g} vs {getattr(theirs, figure):.4g}; at most {bound:.2f}x)")


def total(collectives: dict) -> int:
  return sum(nbytes for _, nbytes in collectives.values())


GC_SCALARS = pytest.mark.xfail(strict=True, reason=(
    "XLA:CPU only: gradient_checkpoint.type=auto all-reduces 8 float32 scalars on their own (9 "
    "all-reduces where the hand-written nn.remat step has 1; 32 bytes more): each recomputed "
    "segment's tie to its cotangent (recompute.after, the CPU path) reads one element of a "
    "data-split cotangent. The same step compiled for 8 H100s (bench/gpu_aot.py, 2026-11-26) "
    "has the hand-written step's one all-reduce of 948,740 bytes"))


@pytest.mark.parametrize("case", ["none", pytest.param("gc", marks=GC_SCALARS)])
def test_data_parallel_steps_all_reduce_what_a_hand_written_step_does(case):
  ours, theirs = costs(case)
  assert {k: b for k, (_, b) in ours.collectives.items()} == {
      k: b for k, (_, b) in theirs.collectives.items()}


@pytest.mark.parametrize("case", ["split", "zero_v1"])
def test_split_and_zero_communicate_no_more_than_a_hand_written_step(case):
  # split: the column matmuls' partial sums share one all-reduce (sharding.reductions, on
  # XLA:CPU); ZeRO v1: the gradients are reduce-scattered, not all-reduced.
  ours, theirs = costs(case)
  assert total(ours.collectives) <= total(theirs.collectives), (ours.collectives,
                                                                theirs.collectives)


def test_zero_v3_gathers_each_parameter_again_for_its_backward_use_and_no_more():
  ours, theirs = costs("zero_v3")
  param_bytes = costs("none")[1].collectives["all-reduce"][1]   # one all-reduce of the grads
  assert total(ours.collectives) <= total(theirs.collectives) + param_bytes


def _bench_on_path() -> None:
  bench = os.path.join(os.path.dirname(__file__), os.pardir, "bench")
  if bench not in sys.path:
    sys.path.insert(0, bench)


@functools.cache
def pipeline_costs(layers: int = 8) -> tuple[Cost, Cost]:
  """(epljax 1F1B, hand-written GPipe) costs: 4 stages x 2 replicas, 8 micro batches."""
  _bench_on_path()
  from pipelines import compile as hand
  trainer, b = hand.epljax_trainer(
      hand.Scanned(layers), {"pipeline.num_micro_batch": hand.M, "auto.auto_parallel": True,
                             "pipeline.num_stages": hand.S}, 2 * hand.M * hand.ROWS)
  state = planned_state(trainer, b)
  step, args = hand.handwritten_step(layers)
  return Cost.of(trainer.lower(state, b).compile()), Cost.of(step.lower(*args).compile())


@pytest.mark.parametrize("figure", ["flops", "temp", "bytes_accessed"])
def test_pipeline_step_costs_no_more_than_a_hand_written_gpipe(figure):
  # 2026-11-25, jax 0.10.2: FLOPs 0.77x (the bubble's ticks are skipped), temp 0.84x (1F1B
  # keeps S micro batches' activations, GPipe M), bytes accessed 1.02x.
  ours, theirs = pipeline_costs()
  ratio = getattr(ours, figure) / getattr(theirs, figure)
  assert ratio <= 1 + TOLERANCE, f"pipeline: {figure} {ratio:.3f}x the hand-written GPipe's"


def test_pipeline_sends_what_a_hand_written_gpipe_sends_and_reduces_no_more():
  ours, theirs = pipeline_costs()
  assert ours.collectives["collective-permute"] == theirs.collectives["collective-permute"]
  assert total(ours.collectives) <= total(theirs.collectives), (ours.collectives,
                                                                theirs.collectives)


@functools.cache
def _hand_gpipe_bytes(layers: int, width: int, micro: int):
  _bench_on_path()
  from pipelines import memory as pm
  return pm.hand_bytes(layers, width, micro)


@pytest.mark.parametrize("layout", ["user", "stage"])
def test_pipeline_bytes_per_device_no_more_than_a_hand_written_gpipe(layout):
  # A parameter-bound GPT (4 layers of width 256, one per stage, AdamW, GPipe over 4 micro
  # batches of 2 rows; bench/pipeline.py memory), so the bytes compared are mostly the
  # parameters' copies, in either pipeline.param_layout. Peak bytes per device: arguments +
  # outputs - aliased + temp.
  _bench_on_path()
  from pipelines import memory as pm
  layers, width, micro = 4, 256, 4
  theirs = _hand_gpipe_bytes(layers, width, micro)
  ours = pm.epljax_bytes(layers, width, micro, "PreferForward", param_layout=layout)
  assert ours.peak <= (1 + TOLERANCE) * theirs.peak, (
      f"pipeline ({layout}) peak {ours.peak / 2**20:.1f} MiB per device vs the hand-written "
      f"GPipe's "
      f"{theirs.peak / 2**20:.1f} MiB ({ours.peak / theirs.peak:.3f}x, at most "
      f"{1 + TOLERANCE:.2f}x)")
