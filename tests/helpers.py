"""Single-device references and small models shared by the tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from flax.core import meta

import epljax as epl

TOL = dict(rtol=1e-5, atol=1e-5)       # float32, shallow models
DEEP_TOL = dict(rtol=1e-4, atol=1e-4)  # float32, deep models

# CI runs the suite on the oldest jax pyproject.toml allows (0.10) and on the newest (0.12).
# A wide matrix whose cells run the same library code on different models (the zoo's) runs each
# cell on one of them: the oldest takes half 0, any newer jax half 1. EPLJAX_EVERY_CELL=1 runs
# every cell.
JAX_HALF = 0 if jax.__version_info__ < (0, 11) else 1
EVERY_CELL = os.environ.get("EPLJAX_EVERY_CELL") == "1"


def on_one_jax(half: int):
  """Marks for a matrix cell that runs on one of CI's two jax versions (``JAX_HALF``)."""
  where = "jax 0.10" if half % 2 == 0 else "jax >= 0.11"
  return [pytest.mark.skipif(not EVERY_CELL and half % 2 != JAX_HALF,
                             reason=f"a cell CI runs on {where} only (EPLJAX_EVERY_CELL=1 "
                                    "runs it here)")]


def each_on_one_jax(values, start: int = 0):
  """``values`` as pytest params, alternating between CI's two jax versions (``on_one_jax``),
  the first on half ``start``."""
  return [pytest.param(v, marks=on_one_jax(start + i)) for i, v in enumerate(values)]


def assert_trees_close(actual, expected, tol=TOL):
  a_leaves, a_def = jax.tree.flatten(actual)
  e_leaves, e_def = jax.tree.flatten(expected)
  assert a_def == e_def, f"structures differ:\n{a_def}\n{e_def}"
  for path_leaf, a, e in zip(jax.tree_util.tree_flatten_with_path(expected)[0], a_leaves,
                             e_leaves):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), err_msg=jax.tree_util.keystr(
        path_leaf[0]), **tol)


def momentum_grads(trainer, state):
  """The gradient of the step that made ``state``, read from SGD-with-momentum's trace (after
  the first step it is that step's gradient exactly: ``g + 0.9 * 0``), in the user's structure
  and order: the gradients are checked without compiling ``trainer.loss_and_grads`` as well (a
  second program as large as the step). Read it before the next step donates ``state``."""
  opt_state = trainer._require().to_user(state)["opt_state"]
  return meta.unbox(optax.tree_utils.tree_get(opt_state, "trace"))


def classification_batch(rows: int, features: int = 20, classes: int = 10, seed: int = 0):
  rng = np.random.default_rng(seed)
  return {"x": rng.normal(size=(rows, features)).astype(np.float32),
          "y": rng.integers(0, classes, rows).astype(np.int32)}


class MLP(nn.Module):
  """EPL's quick-start model (Dense 2 -> Dense 10), widened so gradients are not tiny."""
  hidden: int = 16
  classes: int = 10
  scope: str | None = None   # None, "replicate" (a scope inside the module)

  @nn.compact
  def __call__(self, x):
    if self.scope == "replicate":
      with epl.replicate(1):
        h = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(self.classes)(h)
    h = nn.relu(nn.Dense(self.hidden)(x))
    return nn.Dense(self.classes)(h)


def cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def linen_fns(model: nn.Module):
  def init_fn(rng, batch):
    return model.init(rng, batch["x"])

  def loss_fn(variables, batch):
    return cross_entropy(model.apply(variables, batch["x"]), batch["y"])

  return init_fn, loss_fn


def reference_run(init_fn, loss_fn, optimizer, rng, batch, steps, *, micro_batches=1,
                  variables=None):
  """Plain single-device training on the whole batch: [(loss, grads)], final variables.

  With ``micro_batches`` > 1 the gradient is averaged over equal contiguous chunks, which for a
  mean loss equals the big-batch gradient. ``variables``: ``init_fn``'s, if already made.
  """
  if variables is None:
    first = jax.tree.map(lambda x: x[: len(x) // micro_batches], batch)
    variables = jax.jit(init_fn)(rng, first)
  variables = meta.unbox(variables)   # Flax partitioning boxes removed
  params = variables["params"]
  opt_state = jax.jit(optimizer.init)(params)   # (one program, not one per leaf shape)

  @jax.jit
  def step(params, opt_state):
    loss, grads = jax.value_and_grad(lambda p: loss_fn({**variables, "params": p}, batch))(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return loss, grads, optax.apply_updates(params, updates), opt_state

  history = []
  for _ in range(steps):
    loss, grads, params, opt_state = step(params, opt_state)
    history.append((loss, grads))
  return history, {**variables, "params": params}


# Compile without LLVM's optimizations, as the tests in this process do (see conftest.py).
FAST_COMPILE = "--xla_backend_optimization_level=1"


def worker_env() -> dict[str, str]:
  """The environment of a training worker started by a test: 8 CPU devices, this checkout."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 " + FAST_COMPILE
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return env


def printed(text: str, kind: str) -> dict[int, str]:
  """``{step: rest of the line}`` of a worker's ``KIND step ...`` lines."""
  return {int(line.split()[1]): line.split(maxsplit=2)[2] for line in text.splitlines()
          if line.startswith(kind + " ")}


def kill_9_and_resume(worker: str, tmp_path, steps: int) -> tuple[str, str, str, int]:
  """Runs ``worker`` (``--steps --every 2 --dir [--sleep]``, printing ``LOSS step ...`` and
  ``RESUMED step``) once through, then again killed with SIGKILL after its step 5 and
  restarted in the same directory. Returns the uninterrupted run's output, what the killed
  run printed, the resumed run's output and the step it resumed from."""
  cmd = [sys.executable, worker, "--steps", str(steps), "--every", "2"]
  reference = subprocess.run([*cmd, "--dir", str(tmp_path / "ref")], env=worker_env(),
                             capture_output=True, text=True, timeout=300)
  assert reference.returncode == 0, reference.stderr[-3000:]
  run_dir = str(tmp_path / "run")
  victim = subprocess.Popen([*cmd, "--dir", run_dir, "--sleep", "0.3"], env=worker_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
  seen = []
  for line in victim.stdout:
    seen.append(line)
    if line.startswith("LOSS 5 "):    # it saved step 4 (committed or in flight) and goes on
      victim.send_signal(signal.SIGKILL)
      break
  victim.wait(timeout=60)
  assert victim.returncode == -signal.SIGKILL
  resumed = subprocess.run([*cmd, "--dir", run_dir], env=worker_env(), capture_output=True,
                           text=True, timeout=300)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  start = int(resumed.stdout.split("RESUMED ")[1].split()[0])
  assert start in (2, 4)   # the last committed save: 4, or 2 if 4 was still being written
  return reference.stdout, "".join(seen), resumed.stdout, start


def share_compiles(monkeypatch, directory) -> None:
  """The workers this test starts (``worker_env`` copies the environment) share one compilation
  cache in ``directory``, the test's own: the first run compiles, the runs after it load the
  same programs instead of compiling them again (a shakespeare_resume.py run: 10.5 s alone,
  5.5 s from the cache). One worker at a time writes it; the suite's own cache stays
  per-process (conftest.py)."""
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(directory))
  monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
