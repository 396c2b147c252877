"""Memory features on every model structure: named layers (test_memory_remat), layers built
in a loop inside one module, layers under ``nn.scan``, alternating kinds of layers, plain JAX.

Each is trained with the feature and compared with the single-device reference (loss per
step, gradients, updated parameters); the memory claims are read from the compiled step
(``memory_analysis``) and, for gradient checkpointing, from the residuals autodiff keeps
(``jax.ad_checkpoint.saved_residuals``): XLA:CPU may undo a rematerialization the jaxpr
asks for, so both must show the saving.
"""

import contextlib
import io
import math
import os
import re
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from jax.ad_checkpoint import print_saved_residuals
from jax.sharding import Mesh

import epljax as epl
from epljax import hlo
from epljax.config import GradientCheckpointConfig
from epljax.features import BuildContext
from epljax.memory.remat import GradientCheckpoint
from helpers import (DEEP_TOL, assert_trees_close, classification_batch, momentum_grads,
                     reference_run)
from memory_models import (Alternating, LoopStack, Scanned, deep_fns, deep_optimizer,
                           plain_blocks_fns)

ROWS = 1024
STRUCTURES = {
    "loop": lambda: deep_fns(LoopStack(depth=6)),
    "scan": lambda: deep_fns(Scanned(depth=6)),
    "alternating": lambda: deep_fns(Alternating(pairs=1)),
    "plain": lambda: plain_blocks_fns(depth=6),
}
# Also the layers of "scan" under the user's own nn.remat (jax.checkpoint inside the loop).
BUILDERS = {**STRUCTURES, "scan_remat": lambda: deep_fns(Scanned(depth=6, remat=True))}
_RUNS: dict = {}


def batch():
  return classification_batch(ROWS, features=32, classes=16)


def reference(structure):
  key = ("reference", structure)
  if key not in _RUNS:
    init_fn, loss_fn = BUILDERS[structure]()
    _RUNS[key] = reference_run(init_fn, loss_fn, deep_optimizer(), jax.random.key(0), batch(),
                               2)
  return _RUNS[key]


def run(structure, config, steps=2):
  """Trainer, final state, (loss, grads) of the first step, step losses.

  The first step's gradient is read from the optimizer's momentum trace (SGD with momentum:
  ``g + 0.9 * 0``), not from ``trainer.loss_and_grads``, which would compile a second program
  as large as the step."""
  key = (structure, tuple(sorted(config.items())))
  if key not in _RUNS:
    epl.init(config)
    init_fn, loss_fn = BUILDERS[structure]()
    trainer = epl.Trainer(init_fn, loss_fn, deep_optimizer())
    state = trainer.init(jax.random.key(0), batch())
    first, losses = None, []
    for step in range(steps):
      state, metrics = trainer.train_step(state, batch())
      losses.append(metrics["loss"])
      if step == 0:   # before the next step donates the state
        first = (metrics["loss"], jax.device_get(momentum_grads(trainer, state)))
    _RUNS[key] = (trainer, state, first, losses)
  return _RUNS[key]


def check_reference(structure, config):
  history, expected = reference(structure)
  trainer, state, (loss0, grads0), losses = run(structure, config)
  for step, loss in enumerate(losses):
    np.testing.assert_allclose(loss, history[step][0], **DEEP_TOL)
  np.testing.assert_allclose(loss0, history[0][0], **DEEP_TOL)
  assert_trees_close(grads0, history[0][1], DEEP_TOL)
  assert_trees_close(trainer.variables(state), expected, DEEP_TOL)
  return trainer


def residual_bytes(structure, gc_type, offload=False):
  """Bytes of the activations autodiff saves for the backward pass of one loss evaluation
  (arguments left out: they are kept anyway): (in device memory, in host memory)."""
  init_fn, loss_fn = BUILDERS[structure]()
  b = batch()
  variables = init_fn(jax.random.key(0), b)
  flax_style = isinstance(variables, dict) and "params" in variables
  params = variables["params"] if flax_style else variables

  def loss(p, x):
    return loss_fn({**variables, "params": p} if flax_style else p, x)

  if gc_type:
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "stage", "model"))
    ctx = BuildContext(mesh=mesh, num_replicas=1, num_micro_batch=1, capture=None,
                       params_shape=None, optimizer=None)
    feature = GradientCheckpoint(GradientCheckpointConfig(type=gc_type,
                                                          offload_activations=offload))
    forward = feature.forward(lambda p, x: loss(p, x), ctx)
  else:
    forward = loss
  out = io.StringIO()
  with contextlib.redirect_stdout(out):     # jax's public form of saved_residuals
    print_saved_residuals(forward, params, b)
  total = {"device": 0, "host": 0}
  for line in out.getvalue().splitlines():
    m = re.match(r"(\w+)(<host>)?\[([\d,]*)\]", line)
    if m and "argument" not in line:
      total["host" if m[2] else "device"] += math.prod(
          int(d) for d in m[3].split(",") if d) * np.dtype(
              {"f32": np.float32, "bf16": np.float16, "i32": np.int32}.get(m[1], np.int8)).itemsize
  return total["device"], total["host"]


@pytest.mark.parametrize("structure", list(STRUCTURES))
def test_gc_auto_matches_the_reference_and_halves_activations(structure):
  trainer = check_reference(structure, {"gradient_checkpoint.type": "auto"})
  plain = run(structure, {}, steps=1)[0]
  temp = lambda t: t.plan.memory.temp_size_in_bytes  # noqa: E731
  assert temp(trainer) * 2 <= temp(plain), (temp(trainer), temp(plain))
  kept, plain_kept = residual_bytes(structure, "auto")[0], residual_bytes(structure, "")[0]
  assert kept * 2 <= plain_kept, (kept, plain_kept)
  (described,) = [f for f in trainer.plan.features if "gradient checkpointing" in f]
  if structure == "scan":
    assert "1 scanned layer bodies rematerialized per iteration" in described
  else:
    assert "segments cut where little is live" in described, described


def test_gc_auto_with_nothing_to_cut_says_so_and_warns_once():
  def init_fn(rng, b):
    return {"w": jax.random.normal(rng, (32, 16))}

  def loss_fn(params, b):
    return optax.softmax_cross_entropy_with_integer_labels(b["x"] @ params["w"], b["y"]).mean()

  epl.init({"gradient_checkpoint.type": "auto"})
  trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(0.1))
  state = trainer.init(jax.random.key(0), batch())
  with pytest.warns(UserWarning, match="found no place to cut the traced forward") as caught:
    state, _ = trainer.train_step(state, batch())
    trainer.lower(state, batch())
  assert sum("found no place to cut" in str(w.message) for w in caught) == 1
  assert any("no blocks found: nothing rematerialized" in f for f in trainer.plan.features)


@pytest.mark.parametrize("structure", ["loop", "scan", "scan_remat"])
def test_amp_casts_every_matmul_inside_loops_and_scans(structure):
  epl.init({"amp.level": "O1"})
  init_fn, loss_fn = BUILDERS[structure]()
  trainer = epl.Trainer(init_fn, loss_fn, deep_optimizer())
  state = trainer.init(jax.random.key(0), batch())
  lowered = trainer.lower(state, batch()).as_text()
  assert hlo.float32_matmuls(lowered) == 0
  epl.init({})
  plain = epl.Trainer(init_fn, loss_fn, deep_optimizer())
  plain_state = plain.init(jax.random.key(0), batch())
  assert hlo.float32_matmuls(plain.lower(plain_state, batch()).as_text()) > 0
  loss, _ = trainer.loss_and_grads(state, batch())
  np.testing.assert_allclose(loss, reference(structure)[0][0][0], rtol=2 ** -6)


# XLA:CPU's concurrency-optimized scheduler can let the simulated devices run this step's
# independent all-gathers (one before the scanned loop, one inside it) in different orders:
# the step deadlocks and XLA aborts the whole process after 40 s, about 1 run in 3 on 2 cores
# (0 in 27 with the scheduler off). The flag must be set before JAX starts, and it changes the
# temp bytes other tests measure, so this test runs in a process of its own with it.
_OWN_PROCESS = "EPLJAX_TEST_OWN_PROCESS"
_SCHEDULER_OFF = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def test_zero_v3_gathers_one_layer_at_a_time_inside_a_scan():
  if os.environ.get(_OWN_PROCESS) != "1":
    env = {**os.environ, _OWN_PROCESS: "1",
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {_SCHEDULER_OFF}".strip()}
    test = f"{__file__}::test_zero_v3_gathers_one_layer_at_a_time_inside_a_scan"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
                          env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0 and "1 passed" in done.stdout, (done.stdout[-4000:]
                                                               + done.stderr[-4000:])
    return
  counts = {}
  for structure in ("scan", "scan_remat"):
    trainer = check_reference(structure, {"zero.level": "v3"})
    text = trainer.plan.compiled.as_text()
    gathered = [c.shapes[0] for c in hlo.executed_collectives(text) if c.kind == "all-gather"]
    # The stacked kernels are (6, 32, 128) and (6, 128, 32): each gather is one layer's.
    assert "f32[1,32,128]" in gathered and "f32[1,128,32]" in gathered, gathered
    assert not any(s.startswith("f32[6,") for s in gathered), gathered
    counts[structure] = gathered.count("f32[1,32,128]")
  # Under nn.remat the backward pass recomputes the forward: a second gather per layer, whose
  # gathered copy the backward matmuls use (XLA:GPU, where the refetch is not merged with it:
  # tests/test_aot.py::test_zero3_under_remat_gathers_twice_a_layer).
  assert counts["scan_remat"] == 2 * counts["scan"], counts


@pytest.mark.parametrize("config", [{"offload.level": "v0"},
                                    {"zero.level": "v3", "gradient_checkpoint.type": "auto"}])
def test_offload_and_combinations_inside_a_scan_match_the_reference(config):
  check_reference("scan", config)


@pytest.mark.parametrize("structure", ["loop", "scan"])
def test_offloaded_activations_match_the_reference(structure):
  config = {"gradient_checkpoint.type": "auto", "gradient_checkpoint.offload_activations": True}
  check_reference(structure, config)
  # XLA:CPU has no host memory apart from its device memory (the transfers are dropped when
  # lowering for it): what is measurable is where autodiff keeps the activations.
  device, host = residual_bytes(structure, "auto", offload=True)
  kept = residual_bytes(structure, "auto")[0]
  assert host >= kept > 0 and device < 0.1 * kept, (device, host, kept)
