"""``epl.progress``: a progress bar (tqdm) with loss, steps/s, tokens/s and MFU.

    with epl.progress(total=1000, trainer=trainer) as bar:
      for step in range(1000):
        state, metrics = trainer.train_step(state, next(batches))
        bar.update(metrics)
    # 1000/1000 [00:41<00:00, 24.1step/s, loss=1.873, steps/s=24.1, tokens/s=98.7k, MFU=41.2%]

The bar reads the loss only when it redraws (``mininterval``, 0.5 s by default), so it adds
one host wait per redraw, not per step. Rates are over the steps since the last redraw.
``tokens/s`` needs ``metrics["tokens"]`` (``Trainer(tokens_key=...)`` or integer token ids in
the batch). Only process 0 draws.

MFU (model FLOPs utilization) = FLOPs per step per device x steps/s / the device's peak:
- FLOPs per step: ``cost_analysis()["flops"]`` of the compiled step (``trainer.plan.compiled``,
  compiled once and shared with the plan), per device since the step is one SPMD program; it
  counts what the compiled program computes, recomputation of rematerialized blocks included;
- peak: ``peak_tflops=`` when given, else the table ``epljax.chips.SPECS`` (dense bfloat16
  of known accelerators, by ``device.device_kind``). No peak (a CPU, an unknown chip): no MFU.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import jax

from epljax import chips


def peak_tflops(device: jax.Device | None = None) -> float | None:
  """The table's peak for ``device`` (default: the first device), or None when unknown."""
  device = device or jax.devices()[0]
  peak = chips.peak_flops(str(getattr(device, "device_kind", "")))
  return peak / 1e12 if peak else None


def step_flops(trainer: Any) -> float | None:
  """FLOPs of one step on one device, from the compiled step's ``cost_analysis``."""
  analysis = trainer.plan.compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):   # older jax: one dict per program
    analysis = analysis[0] if analysis else None
  flops = (analysis or {}).get("flops")
  return float(flops) if flops and flops > 0 else None


class Progress:
  """A tqdm bar fed with each step's metrics (module doc). Use ``epl.progress(...)``."""

  def __init__(self, total: int | None = None, *, trainer: Any = None,
               peak_tflops: float | None = None, flops_per_step: float | None = None,
               initial: int = 0, desc: str | None = None, disable: bool | None = None,
               mininterval: float = 0.5, clock=time.perf_counter, **tqdm_kwargs):
    from tqdm.auto import tqdm
    self.trainer = trainer
    self.peak = peak_tflops
    self._flops = flops_per_step
    self._clock = clock
    if disable is None:
      disable = jax.process_index() != 0
    # Where the bar cannot redraw in place (not a terminal, not a Jupyter widget), its stream
    # is watched for a partial line, which ``write`` ends before printing.
    stream = tqdm_kwargs.pop("file", None) or sys.stderr
    self._in_place = tqdm.__module__.startswith("tqdm.notebook") or _isatty(stream)
    self._bar_stream = stream if self._in_place else _LineTracker(stream)
    self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step", disable=disable,
                    mininterval=mininterval, dynamic_ncols=True, file=self._bar_stream,
                    **tqdm_kwargs)
    self.mininterval = mininterval
    self._since = clock()
    self._steps = 0
    self._tokens = 0
    self._has_tokens = False
    self._last: dict[str, Any] | None = None
    self.postfix: dict[str, str] = {}

  def update(self, metrics: dict[str, Any] | None = None, n: int = 1) -> None:
    """One more step (or ``n``); ``metrics`` of the last one."""
    self._steps += n
    if metrics is not None:
      self._last = metrics
      if "tokens" in metrics:
        self._tokens += int(metrics["tokens"]) * n
        self._has_tokens = True
    self.bar.update(n)
    now = self._clock()
    if now - self._since >= self.mininterval:
      self.refresh(now)

  def refresh(self, now: float | None = None) -> dict[str, str]:
    """Recomputes the figures over the steps since the last refresh, and shows them."""
    now = self._clock() if now is None else now
    elapsed = max(now - self._since, 1e-9)
    rate = self._steps / elapsed
    out: dict[str, str] = {}
    if self._last is not None and "loss" in self._last:
      out["loss"] = f"{float(self._last['loss']):.4g}"   # the one host wait of a redraw
    out["steps/s"] = f"{rate:.3g}"
    if self._has_tokens:
      out["tokens/s"] = _si(self._tokens / elapsed)
    mfu = self.mfu(rate)
    if mfu is not None:
      out["MFU"] = f"{100 * mfu:.1f}%"
    self.postfix = out
    if not self.bar.disable:
      self.bar.set_postfix(out, refresh=True)
    self._since, self._steps, self._tokens = now, 0, 0
    return out

  def mfu(self, steps_per_second: float) -> float | None:
    """The fraction of the device's peak the steps use, or None without FLOPs or peak."""
    peak = self.peak if self.peak is not None else peak_tflops()
    if peak is None:
      return None
    if self._flops is None and self.trainer is not None:
      self._flops = step_flops(self.trainer)
    if not self._flops:
      return None
    return self._flops * steps_per_second / (peak * 1e12)

  def write(self, line: str) -> None:
    """Prints ``line`` (to stdout) above the bar, never inside it. On a terminal or in Jupyter
    the bar is cleared and drawn again below the line (``tqdm.write``). In a log (a pipe, a
    file, the launcher's ``[worker i]`` lines) ``\\r`` cannot clear it, so the bar's partial line
    is ended first: the printed line stands on a line of its own, with no bar text on it."""
    if self.bar.disable or self._in_place:
      self.bar.write(line)
      return
    if self._bar_stream.open:
      self._bar_stream.write("\n")
    self._bar_stream.flush()
    print(line, flush=True)

  def close(self) -> None:
    if self._steps:
      self.refresh()
    self.bar.close()

  def __enter__(self) -> Progress:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def progress(total: int | None = None, **kwargs) -> Progress:
  """A progress bar for a training loop (module doc); arguments as ``Progress``."""
  return Progress(total, **kwargs)


def _isatty(stream) -> bool:
  try:
    return bool(stream.isatty())
  except (AttributeError, ValueError):   # no isatty, or a closed stream
    return False


class _LineTracker:
  """A stream that remembers whether its last write left a line open (a bar drawn with ``\\r``
  and no newline)."""

  def __init__(self, stream):
    self.stream = stream
    self.open = False

  def write(self, text: str) -> int:
    if text:
      self.open = not text.endswith("\n")
    return self.stream.write(text)

  def flush(self) -> None:
    self.stream.flush()

  def __getattr__(self, name):
    return getattr(self.stream, name)


def _si(x: float) -> str:
  for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
    if x >= scale:
      return f"{x / scale:.3g}{unit}"
  return f"{x:.3g}"
