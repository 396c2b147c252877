"""The examples run and do what their docstrings say (in-process, on the 8 test devices)."""

import ast
import glob
import importlib.util
import json
import os
import re
import sys

import jax
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


def _code():
  """Each example's code (the scripts, their models, the notebook's code cells) as ``(string
  literals but docstrings, imported modules)``."""
  paths = sorted(glob.glob(os.path.join(EXAMPLES, "**", "*.py"), recursive=True))
  sources = {os.path.relpath(p, EXAMPLES): open(p, encoding="utf-8").read() for p in paths}
  with open(os.path.join(EXAMPLES, "notebook.ipynb"), encoding="utf-8") as f:
    cells = json.load(f)["cells"]
  sources["notebook.ipynb"] = "\n".join(line for c in cells if c["cell_type"] == "code"
                                        for line in "".join(c["source"]).split("\n")
                                        if not line.startswith("%"))   # a magic is no Python
  out = {}
  for name, source in sources.items():
    nodes = list(ast.walk(ast.parse(source)))
    docs = {id(n.body[0].value) for n in nodes
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    strings = [n.value for n in nodes if isinstance(n, ast.Constant)
               and isinstance(n.value, str) and id(n) not in docs]
    imports = [a.name for n in nodes if isinstance(n, ast.Import) for a in n.names]
    imports += [n.module for n in nodes if isinstance(n, ast.ImportFrom) and n.module]
    out[name] = strings, imports
  return out


def test_the_examples_stand_alone():
  """A clone runs them with nothing beside it: no example imports from tests/ or names a path
  outside the repository (the text they train on ships in examples/data)."""
  code = _code()
  assert {"llama.py", "example_models/llama.py", "notebook.ipynb"} <= set(code)
  outside = re.compile(r"^(tests|shared)$|tests/|shared/|/work/|\.cache")
  for name, (strings, imports) in code.items():
    paths = [s for s in strings if outside.search(s)]
    assert not paths, f"examples/{name} names a path outside the repository: {paths}"
    tests = [m for m in imports if m.split(".")[0] in ("tests", "models", "helpers")]
    assert not tests, f"examples/{name} imports from tests/: {tests}"
  assert os.path.getsize(os.path.join(EXAMPLES, "data", "tinyshakespeare.txt")) == 1_115_394


def test_a_missing_extra_is_named_with_exit_status_2(monkeypatch, capsys):
  """scikit-learn missing: the digits example names the extra and exits 2 (1 is the planning
  CLI's "does not fit")."""
  for name in ("sklearn", "sklearn.datasets", "sklearn.model_selection"):
    monkeypatch.setitem(sys.modules, name, None)           # their import fails as if missing
  with pytest.raises(SystemExit) as exited:
    load("resnet_digits").load()
  assert exited.value.code == 2
  assert 'pip install -e ".[examples]"' in capsys.readouterr().err


@pytest.mark.slow
def test_shakespeare_long_context_4_trains_as_one_device():
  """examples/shakespeare_long.py: the GPT with its rows split over 4 devices (context
  parallelism) gives one device's losses and parameters (same batches, plain jax.jit)."""
  result = load("shakespeare_long").main(["--context", "4", "--seq", "64", "--steps", "2",
                                          "--layers", "1", "--width", "32", "--batch", "4",
                                          "--check"])
  assert re.search(r"context parallelism over 4 devices: 1 epl.nn.dot_product_attention "
                   r"call\(s\) run over 'context'", result["plan"])
  np.testing.assert_allclose(result["losses"], result["reference"], rtol=1e-5)
  flat = lambda t: [np.asarray(x) for x in jax.tree.leaves(t)]  # noqa: E731
  for ours, ref in zip(flat(result["variables"]), flat(result["reference_variables"])):
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-6)
