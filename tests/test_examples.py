"""The examples run and do what their docstrings say (in-process, on the 8 test devices)."""

import importlib.util
import os

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
