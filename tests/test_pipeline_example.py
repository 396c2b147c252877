"""examples/bert_pipeline.py runs and its loss goes down (a few steps, in-process)."""

import importlib.util
import os

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "bert_pipeline.py")


def test_bert_pipeline_example_loss_goes_down(capsys):
  spec = importlib.util.spec_from_file_location("bert_pipeline", EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  losses = module.main(["--steps", "6", "--micro_batch", "4", "--layers", "1", "--width", "32",
                        "--plan"])
  out = capsys.readouterr().out
  assert "stages 2" in out and "PreferBackward (1F1B)" in out
  assert "held-out loss" in out
  assert losses[-1] < losses[0] - 1.0


GPT2 = os.path.join(os.path.dirname(__file__), "..", "examples", "gpt2_pipeline.py")


def _load(path, name):
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_gpt2_pipeline_example_with_tied_embeddings_loss_goes_down(capsys):
  losses = _load(GPT2, "gpt2_pipeline").main(
      ["--steps", "6", "--micro_batch", "2", "--layers", "1", "--width", "32", "--plan"])
  out = capsys.readouterr().out
  assert "replicas  2    stages 2" in out and "data=2 x stage=2 x model=2" in out
  assert "split     stage 0 'stage_0': epl.split(2) over model" in out
  assert "split     stage 1 'stage_1': epl.split(2) over model" in out
  assert ("tied      'params/wte/embedding' held by stages 'stage_0', 'stage_1'; their "
          "gradients are summed") in out
  assert "held-out next-byte loss" in out
  assert losses[-1] < losses[0] - 0.5


def test_gpt2_pipeline_model_matches_single_device():
  """The example's model and optimizer (tied wte, masked AdamW) on 2 replicas x 2 stages x
  split(2): loss, gradients and parameters equal single-device training. The sizes, batch shape
  and optimizer are the example test's above, so its step program comes from the compilation
  cache instead of being compiled again."""
  import epljax as epl
  import jax
  import numpy as np
  import optax

  gpt2 = _load(GPT2, "gpt2_pipeline")
  model = gpt2.GPT2(width=32, layers=1)
  tokens = np.random.default_rng(0).integers(0, gpt2.VOCAB, (16, model.length + 1)).astype(
      np.int32)
  epl.init({"pipeline.num_micro_batch": 4})
  init_fn = lambda key, b: model.init(key, b["tokens"][:, :-1])  # noqa: E731
  loss_fn = lambda v, b: gpt2.next_byte_loss(model, v, b)  # noqa: E731
  from helpers import DEEP_TOL, assert_trees_close, reference_run

  def optimizer():
    return optax.adamw(3e-3, weight_decay=1e-2, mask=gpt2.decay_mask)

  trainer = epl.Trainer(init_fn, loss_fn, optimizer())
  batch = {"tokens": tokens}
  state = trainer.init(jax.random.key(0), batch)
  assert dict(trainer.plan.mesh.shape) == {"data": 2, "stage": 2, "model": 2}
  history, expected = reference_run(init_fn, loss_fn, optimizer(), jax.random.key(0), batch, 2)
  loss, grads = trainer.loss_and_grads(state, batch)
  np.testing.assert_allclose(loss, history[0][0], **DEEP_TOL)
  assert_trees_close(grads, history[0][1], DEEP_TOL)
  for step in range(2):
    state, metrics = trainer.train_step(state, batch)
    np.testing.assert_allclose(metrics["loss"], history[step][0], **DEEP_TOL)
  assert_trees_close(trainer.variables(state), expected, DEEP_TOL)
