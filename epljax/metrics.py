"""``epl.MetricsWriter``: a step's metrics as TensorBoard event files (tensorboardX).

    with epl.MetricsWriter("runs/exp1") as writer:
      for step in ...:
        state, metrics = trainer.train_step(state, batch)
        if step % 10 == 0:
          writer.write(step, metrics)         # reads the values: a host wait
    # tensorboard --logdir runs

Every scalar of ``metrics`` becomes a scalar series under its name (nested dicts such as
``aux`` as ``aux/name``; ``finite`` as 0/1); arrays with more than one element are left out.
Only process 0 writes; on the others ``write`` does nothing, so every process may call it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np


class MetricsWriter:
  """Writes scalar metrics to TensorBoard event files in ``logdir`` (module doc)."""

  def __init__(self, logdir: str | os.PathLike, *, flush_secs: int = 10):
    self.logdir = str(logdir)
    self._writer = None
    if jax.process_index() == 0:
      from tensorboardX import SummaryWriter
      self._writer = SummaryWriter(self.logdir, flush_secs=flush_secs)

  def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
    """Writes the scalars of ``metrics`` at ``step``; returns what it wrote."""
    scalars = scalars_of(metrics)
    if self._writer is not None:
      for name, value in scalars.items():
        self._writer.add_scalar(name, value, int(step))
    return scalars

  def flush(self) -> None:
    if self._writer is not None:
      self._writer.flush()

  def close(self) -> None:
    if self._writer is not None:
      self._writer.close()
      self._writer = None

  def __enter__(self) -> MetricsWriter:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def scalars_of(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
  """The scalar entries of ``metrics`` as floats, nested mappings flattened with ``/``."""
  out: dict[str, float] = {}
  for name, value in metrics.items():
    key = f"{prefix}{name}"
    if isinstance(value, Mapping):
      out.update(scalars_of(value, key + "/"))
      continue
    if value is None or isinstance(value, str):
      continue
    array = np.asarray(jax.device_get(value))
    if array.size == 1 and (np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_):
      out[key] = float(array.reshape(()))
  return out
