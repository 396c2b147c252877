"""The examples run and do what their docstrings say (in-process, on the 8 test devices)."""

import importlib.util
import os

import numpy as np
import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def load(name):
  spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_quickstart_prints_a_falling_loss(capsys):
  losses = load("quickstart").main(["--steps", "10", "--plan"])
  out = capsys.readouterr().out
  assert "Iteration 10 , Loss:" in out and "Train Finished." in out and "epljax plan" in out
  assert losses[-1] < losses[0]


@pytest.mark.slow
def test_resnet_on_digits_reaches_95_percent_in_5_epochs():
  assert load("resnet_digits").main(["--epochs", "5"]) >= 0.95


@pytest.mark.slow
def test_large_classification_learns_with_a_split_head():
  losses = load("large_classification").main(["--classes", "16000", "--steps", "12",
                                              "--batch", "128"])
  assert losses[-1] < losses[0] - 1.0


@pytest.mark.slow
def test_moe_language_model_loss_goes_down():
  losses = load("moe_lm").main(["--steps", "30", "--sequences", "16"])
  assert np.mean(losses[-5:]) < losses[0] - 1.5
