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
