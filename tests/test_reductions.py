"""Gradient partial sums added before one all-reduce (``epljax.sharding.reductions``), on data
parallelism: a tied embedding's two gradients (lookup and logits) meet in one reduction over
replicas, exactly as single-device training computes them; uses the rewrite cannot take as
traced (a cast, a reshape, a slice of the table) are left alone and the plan says nothing
was fused."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import epljax as epl
from epljax import hlo
from helpers import TOL, assert_trees_close, reference_run

VOCAB, WIDTH, ROWS, LENGTH = 64, 16, 16, 4


class TiedLM(nn.Module):
  """An embedding table read by the lookup and by the logits; ``use`` picks how the logits
  read it: ``attend`` (its transpose), ``bf16`` (a cast copy), ``slice`` (its first rows)."""
  use: str = "attend"

  @nn.compact
  def __call__(self, ids):
    embed = nn.Embed(VOCAB, WIDTH)
    h = jnp.tanh(nn.Dense(WIDTH)(embed(ids)))
    table = embed.embedding
    if self.use == "attend":
      return embed.attend(h)
    if self.use == "bf16":
      return (h.astype(jnp.bfloat16) @ table.astype(jnp.bfloat16).T).astype(jnp.float32)
    kernel = table[:VOCAB // 2].reshape(VOCAB // 2, 2, WIDTH // 2)
    return jnp.einsum("blkd,vkd->blv", h.reshape(*h.shape[:-1], 2, WIDTH // 2), kernel)


def fns(use):
  model = TiedLM(use)

  def init_fn(rng, batch):
    return model.init(rng, batch["ids"])

  def loss_fn(variables, batch):
    logits = model.apply(variables, batch["ids"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  return init_fn, loss_fn


def make_batch():
  ids = np.random.default_rng(0).integers(0, VOCAB // 2, (ROWS, LENGTH)).astype(np.int32)
  return {"ids": ids, "y": np.roll(ids, 1, axis=1)}


def train(use, config=None):
  epl.init(config or {})
  init_fn, loss_fn = fns(use)
  batch = make_batch()
  trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(0.1))
  state = trainer.init(jax.random.key(0), batch)
  step = hlo.collectives(trainer.lower(state, batch).compile().as_text())
  state, metrics = trainer.train_step(state, batch)
  sums = [f for f in trainer.plan.features if f.startswith("gradient sums")]
  return trainer, state, metrics, step, sums, batch


def table_reductions(step, shapes=(f"f32[{VOCAB},{WIDTH}]",)) -> list[str]:
  """The all-reduced arrays of the step with one of ``shapes`` (the table's gradient)."""
  return [s for c in step if c.kind == "all-reduce" for s in c.shapes
          if s.split("{")[0] in shapes]


def test_tied_embedding_reduced_once_over_replicas_and_exact():
  trainer, state, metrics, step, sums, batch = train("attend")
  assert sums == ["gradient sums: 1 parameters read by 2 row-wise uses (tied), one reduction "
                  "over data each"]
  assert len(table_reductions(step)) == 1, step   # was 2: the lookup's and the logits' each
  init_fn, loss_fn = fns("attend")
  history, expected = reference_run(init_fn, loss_fn, optax.sgd(0.1), jax.random.key(0),
                                    batch, 1)
  np.testing.assert_allclose(metrics["loss"], history[0][0], **TOL)
  assert_trees_close(trainer.variables(state), expected, TOL)


@pytest.mark.parametrize("use", ["bf16", "slice"])
def test_uses_not_taken_as_traced_are_left_alone(use):
  """A cast copy or a reshaped slice of the table is not the parameter: nothing is fused,
  the step is the one GSPMD makes of the traced program (two reductions of the table)."""
  trainer, state, metrics, step, sums, _ = train(use)
  assert sums == []
  assert bool(metrics["finite"])
  pieces = (f"f32[{VOCAB},{WIDTH}]", f"f32[{VOCAB // 2},2,{WIDTH // 2}]")   # table, its slice
  assert len(table_reductions(step, pieces)) == 2, step


def test_with_gradient_checkpointing_the_tied_table_is_not_fused():
  """There the per-replica copy kept more memory than the reduction it saves (the measured
  reason in ``build._shared_reductions``); both gradients are reduced as GSPMD places them."""
  _, _, metrics, step, sums, _ = train("attend", {"gradient_checkpoint.type": "auto"})
  assert sums == []
  assert bool(metrics["finite"])
  assert len(table_reductions(step)) == 2, step


def test_off_xla_cpu_the_step_is_what_gspmd_makes_and_the_plan_says_so(monkeypatch):
  """The rewrite makes up for a pass XLA:CPU lacks; on other platforms (simulated here by
  taking cpu out of ``reductions.PLATFORMS``) the traced forward runs as it is: the table's two
  gradients are reduced where GSPMD makes them, with the same numbers."""
  from epljax.sharding import reductions
  monkeypatch.setattr(reductions, "PLATFORMS", ())
  trainer, state, metrics, step, sums, batch = train("attend")
  assert sums == ["gradient sums: each partial sum all-reduced where made (on cpu, XLA merges "
                  "them itself: XLA:GPU's all-reduces are within 5% of epljax's rewrite, which "
                  "runs on XLA:CPU only; bench/gpu_compile.py)"]
  assert len(table_reductions(step)) == 2, step
  init_fn, loss_fn = fns("attend")
  history, expected = reference_run(init_fn, loss_fn, optax.sgd(0.1), jax.random.key(0),
                                    batch, 1)
  np.testing.assert_allclose(metrics["loss"], history[0][0], **TOL)
  assert_trees_close(trainer.variables(state), expected, TOL)
