"""Shared by the benchmarks: paired timing, machine description, RESULTS.md records."""

from __future__ import annotations

import datetime
import logging
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax


def paired_ratio(first: Callable[[], object], second: Callable[[], object], *, pairs: int,
                 warmup: int = 3) -> dict[str, float]:
  """Times ``first`` and ``second`` alternately; returns medians and the median paired ratio.

  Alternating in one run cancels most of the drift of a shared, noisy machine.
  """
  for _ in range(warmup):
    jax.block_until_ready(first())
    jax.block_until_ready(second())
  a, b = [], []
  for i in range(pairs):
    for fn, out in ((first, a), (second, b)) if i % 2 == 0 else ((second, b), (first, a)):
      start = time.perf_counter()
      jax.block_until_ready(fn())
      out.append(time.perf_counter() - start)
  ratios = [x / y for x, y in zip(a, b)]
  return {"first_s": statistics.median(a), "second_s": statistics.median(b),
          "ratio": statistics.median(ratios),
          "ratio_q1": statistics.quantiles(ratios, n=4)[0],
          "ratio_q3": statistics.quantiles(ratios, n=4)[2]}


def time_against_hand(trainer, state, batch, hand_jit, hand_state, hand_batch, *,
                      pairs: int) -> tuple[dict[str, float], Any, Any]:
  """``paired_ratio`` of ``trainer.train_step`` against ``hand_jit(state, batch) -> (state,
  loss)``, each stepping its own (donated) state; returns the timing and both final states."""
  box = {"epl": state, "hand": hand_state}

  def run_epl():
    box["epl"], metrics = trainer.train_step(box["epl"], batch)
    return metrics["loss"]

  def run_hand():
    box["hand"], loss = hand_jit(box["hand"], hand_batch)
    return loss

  return paired_ratio(run_epl, run_hand, pairs=pairs), box["epl"], box["hand"]


def hand_step(loss_fn: Callable, optimizer) -> Callable:
  """The hand-written training step the benchmarks compare with: ``(params, opt_state), batch
  -> ((params, opt_state), loss)``, value_and_grad and the optax update, nothing else."""

  def step(state, batch):
    params, opt_state = state
    loss, grads = jax.value_and_grad(lambda p: loss_fn({"params": p}, batch))(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  return step


def step_cost(compiled, key: str) -> float:
  """``cost_analysis()[key]`` of a compiled step, each conditional's results counted once
  (``epljax.hlo``). A compile-only executable (``gpu_aot.py``) has no cost analysis: XLA's HLO
  cost analysis, run by the CPU client, reads its optimized module instead."""
  from epljax import hlo

  costs = compiled.cost_analysis()
  costs = costs[0] if isinstance(costs, list) else costs
  if costs is None:
    from jax._src import xla_bridge
    from jax._src.lib import xla_client

    (module,) = compiled.runtime_executable().hlo_modules()
    costs = xla_client._xla.hlo_module_cost_analysis(xla_bridge.get_backend("cpu"), module)
  if key == "bytes accessed":
    return costs[key] - hlo.conditional_result_bytes(compiled.as_text())
  return costs[key]


def machine() -> str:
  devices = jax.devices()
  kind = devices[0].device_kind
  return (f"{platform.node() or 'host'}: {os.cpu_count()} CPU cores, {len(devices)} x {kind} "
          f"({devices[0].platform}), jax {jax.__version__}")


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
  cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
  widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
  line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
  return "\n".join([line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                   + [line(r) for r in cells[1:]])


class MLP(nn.Module):
  """The data-parallel benchmarks' model: ``depth`` ReLU layers of ``width``, 10 classes."""
  width: int
  depth: int

  @nn.compact
  def __call__(self, x):
    for _ in range(self.depth):
      x = nn.relu(nn.Dense(self.width)(x))
    return nn.Dense(10)(x)


def mlp_problem(width: int, depth: int, rows: int) -> tuple[MLP, dict[str, Any], Callable]:
  """The model, a random classification batch of ``rows`` and the mean cross-entropy loss."""
  model = MLP(width, depth)
  rng = np.random.default_rng(0)
  batch = {"x": rng.normal(size=(rows, width)).astype(np.float32),
           "y": rng.integers(0, 10, rows).astype(np.int32)}

  def loss_fn(variables, b):
    logits = model.apply(variables, b["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

  return model, batch, loss_fn


def devices(found: Sequence[Any] | None = None) -> str:
  """The devices a record's key names, with their compiler: ``XLA:CPU, 8 simulated devices``,
  ``8 compile-only H100s`` (a topology compiled for, nothing run), ``XLA:GPU, 1 x NVIDIA
  H200`` (timed on a real GPU). ``found``: the devices the bench compiled for (default
  ``jax.devices()``)."""
  import re

  found = list(jax.devices() if found is None else found)
  first = found[0]
  if first.platform == "cpu":
    return f"XLA:CPU, {len(found)} simulated device{'s' if len(found) > 1 else ''}"
  if first.platform != jax.default_backend():      # a topology's devices: compile-only
    chip = re.search(r"[A-Z]\d{2,3}", first.device_kind)
    return f"{len(found)} compile-only {chip.group(0) if chip else first.device_kind}s"
  return f"XLA:GPU, {len(found)} x {first.device_kind}"


# Set by a script that dispatches subcommands (bench/pipeline.py): the words after the script
# name that a record's command keeps when the bench passes its own ``argv``.
SUBCOMMAND: list[str] = []


def record(title: str, body: str, argv: Sequence[str] | None = None,
           planned_for: str | None = None, used: Sequence[Any] | None = None) -> None:
  """Records a run (``records.write``): replaces the section of this bench (title, command,
  devices) in bench/RESULTS.md and appends it, dated, to bench/RESULTS-archive.md. The command
  is the running script with ``argv`` (default: this process's arguments); the devices named
  are ``used`` (the devices compiled for; default this process's), or ``planned_for`` in
  words (a bench planning for several topologies: ``compile-only H100s``)."""
  import records

  args = list(sys.argv[1:]) if argv is None else [*SUBCOMMAND, *argv]
  command = " ".join(["python", f"bench/{os.path.basename(sys.argv[0])}", *args])
  key = records.record_key(title, command, planned_for or devices(used))
  stamp = datetime.date.today().isoformat()
  records.write(key, stamp, f"Machine: {machine()}  \nCommand: `{command}`\n\n{body}")


class StepCompiles(logging.Handler):
  """Counts jax's "Finished XLA compilation" log records of epljax's step (``epl_step``): the
  searches' compiles, read from jax's logger at DEBUG."""

  def __init__(self):
    super().__init__()
    self.steps = 0

  def emit(self, rec):
    text = rec.getMessage()
    if "Finished XLA compilation" in text and "epl_step" in text:
      self.steps += 1
