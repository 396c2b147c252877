"""epl.progress (loss, steps/s, tokens/s, MFU) and epl.MetricsWriter (TensorBoard events)."""

from __future__ import annotations

import glob
import struct
import types

import jax
import numpy as np
import optax
import pytest

import epljax as epl
from epljax.progress import peak_tflops, step_flops
from helpers import MLP, classification_batch, linen_fns


@pytest.mark.parametrize("kind, peak", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200", 989.0),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("TPU v5 lite", 197.0), ("cpu", None)])
def test_peak_comes_from_the_table_of_known_chips(kind, peak):
  assert peak_tflops(types.SimpleNamespace(device_kind=kind)) == peak


class Clock:
  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def test_rates_and_mfu_over_the_steps_since_the_last_redraw():
  clock = Clock()
  bar = epl.progress(total=20, peak_tflops=100.0, flops_per_step=2e12, clock=clock,
                     mininterval=1.0, disable=True)
  for _ in range(8):
    clock.now += 0.125
    bar.update({"loss": np.float32(2.5), "tokens": 1000})
  # 8 steps in 1 s: 8 steps/s, 8k tokens/s, 2e12 x 8 / 100e12 = 16% of the peak.
  assert bar.postfix == {"loss": "2.5", "steps/s": "8", "tokens/s": "8k", "MFU": "16.0%"}
  for _ in range(5):
    clock.now += 0.5
    bar.update({"loss": np.float32(1.25)})
  assert bar.postfix["steps/s"] == "2" and bar.postfix["loss"] == "1.25"
  bar.close()


@pytest.fixture(scope="module")
def trained():
  epl.init()
  epl.set_default_strategy(epl.replicate(1))
  init_fn, loss_fn = linen_fns(MLP())
  trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(0.1))
  batch = classification_batch(32)
  state = trainer.init(jax.random.key(0), batch)
  steps = []
  for _ in range(3):
    state, metrics = trainer.train_step(state, batch)
    steps.append(metrics)
  return trainer, steps


def test_flops_are_those_of_one_device_from_the_compiled_step(trained):
  trainer, _ = trained
  flops = step_flops(trainer)
  # 8 replicas, 4 rows each: the matmuls of one device, forward (2 x rows x 20x16 + 16x10)
  # and backward (twice that, less the input gradient), plus the elementwise work.
  matmuls = 2 * 4 * (20 * 16 + 16 * 10)
  assert 2 * matmuls < flops < 4 * matmuls, flops


def test_no_mfu_on_cpu_without_a_peak_and_mfu_with_one(trained):
  trainer, steps = trained
  clock = Clock()
  bar = epl.progress(trainer=trainer, clock=clock, disable=True)
  clock.now = 1.0
  bar.update(steps[0])
  assert "MFU" not in bar.postfix and "tokens/s" not in bar.postfix
  bar = epl.progress(trainer=trainer, clock=clock, disable=True, peak_tflops=1e-6)
  clock.now = 2.0
  bar.update(steps[0])
  expected = step_flops(trainer) * 1.0 / 1e6
  assert bar.postfix["MFU"] == f"{100 * expected:.1f}%"


def read_scalars(logdir):
  """{tag: [(step, value)]} from tensorboardX event files (TFRecord framing)."""
  from tensorboardX.proto import event_pb2
  out = {}
  for path in glob.glob(f"{logdir}/events.out.tfevents.*"):
    data = open(path, "rb").read()
    pos = 0
    while pos < len(data):
      (length,) = struct.unpack("<Q", data[pos:pos + 8])
      event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
      pos += 12 + length + 4
      for v in event.summary.value:
        out.setdefault(v.tag, []).append((event.step, v.simple_value))
  return out


def test_metrics_writer_writes_every_scalar_as_a_tensorboard_series(trained, tmp_path):
  _, steps = trained
  with epl.MetricsWriter(tmp_path) as writer:
    for i, m in enumerate(steps):
      wrote = writer.write(i + 1, {**m, "aux": {"acc": np.float32(0.5 + i)},
                                   "rows": np.zeros(3)})
  assert set(wrote) == {"loss", "grad_norm", "finite", "step", "examples", "step_time",
                        "aux/acc"}
  scalars = read_scalars(tmp_path)
  assert [s for s, _ in scalars["loss"]] == [1, 2, 3]
  np.testing.assert_allclose([v for _, v in scalars["loss"]],
                             [float(m["loss"]) for m in steps], rtol=1e-6)
  assert [v for _, v in scalars["finite"]] == [1.0, 1.0, 1.0]
  assert [v for _, v in scalars["aux/acc"]] == [0.5, 1.5, 2.5]
  assert "rows" not in scalars


def test_the_plan_search_and_the_progress_bar_read_one_peak():
  """One table of peaks: the MFU of the bar and the search's chip agree (an H100 PCIe is not
  an SXM H100)."""
  from epljax import chips
  for kind in ("NVIDIA H100 PCIe", "NVIDIA H100 80GB HBM3", "NVIDIA H200", "TPU v5 lite"):
    device = types.SimpleNamespace(device_kind=kind, platform="gpu", memory_stats=dict)
    chip = chips.chip_of(device, epl.Config().auto)
    assert chip.peak_flops == peak_tflops(device) * 1e12, kind


def test_a_compile_only_device_takes_the_chip_tables_memory():
  """A compile-only device (jax's deviceless compile, bench/gpu_aot.py) has no memory_stats:
  the search's chip keeps the table's memory instead of failing."""
  from epljax import chips

  def no_stats():
    raise jax.errors.JaxRuntimeError("MemoryStats is only supported for addressable devices")

  device = types.SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3", platform="gpu",
                                 memory_stats=no_stats)
  assert chips.chip_of(device, epl.Config().auto).memory_bytes == chips.CHIPS["H100"].memory_bytes
