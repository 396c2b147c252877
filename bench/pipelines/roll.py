"""Rolled pipeline stages' temp against the same stages written out, and what one stack's
backward holds through ``jax.grad`` of its scan and a layer at a time.

    python bench/pipeline.py roll            # XLA:CPU, 8 simulated devices
    python bench/pipeline.py roll --gpu      # 8 compile-only H100s (v312 venv, JAX_PLATFORMS=cpu)
    python bench/pipeline.py roll --record   # and record the tables in bench/RESULTS.md

Pipeline: ``pipelines/compile.py``'s two Python-loop models (the residual MLP of 32 blocks cut
every 8 blocks, and the 48-layer GPT cut by ``auto.auto_parallel``), S=4 stages x 2 replicas,
M=8, SGD, with ``pipeline.roll_layers`` off and on; temp per device from ``memory_analysis()``
of the step compiled from shapes. A rolled stage runs its layers as a ``lax.scan`` over stacks
of their parameters, and its backward as a reverse scan of each layer's pullback that reads the
layer's weights from the parameter buffer and adds its gradient into the accumulator's rows
(``pipeline/roll.py``, ``vjp``). (Until 2026-11-28 it was ``jax.vjp``'s transpose of the scan,
which writes every layer's gradient into a stacked output and reads the weights as whole
stacks: the rolled step's temp was 1.18x-1.27x the written-out one's.)

Alone: one stack of ``n`` layers ``tanh(h @ W_i)`` (width 512, 64 rows, float32) whose
parameter gradient is added into a donated accumulator of the stack's shape, three ways: the
layers written out and ``jax.grad`` then added; the layers as a ``lax.scan`` and ``jax.grad``
then added (a rolled stage's backward until 2026-11-28); and a reverse ``lax.scan`` of each
layer's ``jax.vjp`` that carries the accumulator and adds each layer's gradient into its rows
(the way ``roll.vjp`` does it; here the forward keeps each layer's input and each layer's
pullback recomputes its forward). On XLA:CPU each result is compared with the scan's
``jax.grad`` (the two scans agree to the bit; the written-out layers round differently).
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS") or "--xla_force_host_platform_device_count=8"
BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)
# This checkout's epljax, not an installed one (a worktree beside an editable install).
sys.path.insert(1, os.path.dirname(BENCH))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402

import epljax as epl  # noqa: E402
from pipelines import compile as pc  # noqa: E402
from pipelines import memory as pm  # noqa: E402
from gpu_aot import as_devices  # noqa: E402

LAYERS, WIDTH, ROWS = 16, 512, 64


def step_temp(model, config: dict, batch: dict, loss_fn, devices) -> float:
  """Temp MiB per device of epljax's pipeline step of ``model`` under ``config``."""
  with as_devices(devices):
    epl.init(config)
    trainer = epl.Trainer(lambda k, b: model.init(k, b["x"]), loss_fn, optax.sgd(0.1))
    compiled = trainer._build(jax.random.key(0), batch).plan.compiled
  return compiled.memory_analysis().temp_size_in_bytes / 2**20


def pipeline_rows(devices) -> list[list]:
  def ce(model):
    return lambda v, b: optax.softmax_cross_entropy_with_integer_labels(
        model.apply(v, b["x"]), b["y"]).mean()

  mlp, gpt = pc.Deep(32), pc.GPT(48)
  cases = [("residual MLP 32", mlp, {}, pc.batch(2 * pc.M * pc.ROWS)),
           ("GPT 48 (auto)", gpt, {"auto.auto_parallel": True, "pipeline.num_stages": pc.S},
            pc.gpt_batch(2 * pc.M * 2))]
  rows = []
  for name, model, extra, batch in cases:
    temps = [step_temp(model, {"pipeline.num_micro_batch": pc.M, "pipeline.roll_layers": roll,
                               **extra}, batch, ce(model), devices) for roll in (False, True)]
    rows.append([name, f"{temps[0]:.2f}", f"{temps[1]:.2f}", f"**{temps[1] / temps[0]:.3f}**"])
    print(f"{name} done", flush=True)
  return rows


def _layer(h, w):
  return jnp.tanh(h @ w)


def _written_out(w, x):
  for i in range(LAYERS):
    x = _layer(x, w[i])
  return x.sum()


def _scanned(w, x):
  return lax.scan(lambda h, wi: (_layer(h, wi), None), x, w)[0].sum()


def grad_then_add(loss):
  return lambda w, x, acc: acc + jax.grad(loss)(w, x)


def reverse_scan_into(w, x, acc):
  """``acc + jax.grad(_scanned)(w, x)`` by a reverse scan that carries ``acc``."""
  last, inputs = lax.scan(lambda h, wi: (_layer(h, wi), h), x, w)

  def back(carry, i):
    ct, acc = carry
    _, pull = jax.vjp(_layer, inputs[i], w[i])
    ct, g = pull(ct)
    return (ct, lax.dynamic_update_index_in_dim(acc, acc[i] + g, i, 0)), None

  (_, acc), _ = lax.scan(back, (jnp.ones_like(last), acc), jnp.arange(LAYERS), reverse=True)
  return acc


WAYS = (("layers written out, jax.grad, then added", grad_then_add(_written_out)),
        ("lax.scan, jax.grad, then added", grad_then_add(_scanned)),
        ("reverse lax.scan carrying the accumulator (roll.vjp's way)", reverse_scan_into))


def alone_rows(device, check: bool) -> list[list]:
  one = jax.sharding.SingleDeviceSharding(device)
  w = jax.ShapeDtypeStruct((LAYERS, WIDTH, WIDTH), jnp.float32, sharding=one)
  x = jax.ShapeDtypeStruct((ROWS, WIDTH), jnp.float32, sharding=one)
  stack = LAYERS * WIDTH * WIDTH * 4 / 2**20
  rows = []
  for name, fn in WAYS:
    temp = jax.jit(fn, donate_argnums=2).lower(w, x, w).compile().memory_analysis(
        ).temp_size_in_bytes / 2**20
    rows.append([name, f"{stack:.0f}", f"{temp:.2f}", f"{temp / stack:.2f}"])
  if check:
    keys = jax.random.split(jax.random.key(0), 3)
    args = (0.05 * jax.random.normal(keys[0], w.shape), jax.random.normal(keys[1], x.shape),
            jax.random.normal(keys[2], w.shape))
    want = grad_then_add(_scanned)(*args)
    for row, (_, fn) in zip(rows, WAYS):
      row.append(f"{float(jnp.abs(fn(*args) - want).max()):.1e}")
  return rows


def main(argv=None) -> None:
  from common import record, table
  args, devices, where = pm.cli(__doc__, argv)
  check = not args.gpu
  first = table(["model (Python loop)", "roll off temp MiB", "roll on temp MiB", "on / off"],
                pipeline_rows(devices[:2 * pc.S]))
  second = table(["stack's gradient into an accumulator", "stack MiB", "temp MiB",
                  "temp / stack"] + (["max diff to the scan's jax.grad"] if check else []),
                 alone_rows(devices[0], check))
  body = f"Pipeline step, rolled and written out:\n\n{first}\n\nOne stack, alone:\n\n{second}"
  print(f"{where}\n\n{body}")
  if args.record:
    about = "\n\n".join(__doc__.split("\n\n")[2:])
    record("Rolled stages' temp", f"{about}\n\n{body}", used=devices[:2 * pc.S])
