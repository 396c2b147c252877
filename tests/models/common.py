"""Pieces every zoo model uses: losses, RMSNorm and rotary positions as plain functions (those
the examples' models use too live in ``examples/example_models/layers.py``), and deterministic
numpy batches."""

from __future__ import annotations

import numpy as np
import optax
from example_models.layers import lm_fns, lm_loss, rms_norm, rope  # noqa: F401


def classification_loss(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def token_batch(rows: int, length: int, vocab: int, seed: int = 0):
  """``rows`` sequences of ``length`` tokens: inputs ``x`` and next-token targets ``y``."""
  ids = np.random.default_rng(seed).integers(0, vocab, (rows, length + 1)).astype(np.int32)
  return {"x": ids[:, :-1], "y": ids[:, 1:]}


def image_batch(rows: int, size: int, channels: int, classes: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  return {"x": rng.normal(size=(rows, size, size, channels)).astype(np.float32),
          "y": rng.integers(0, classes, rows).astype(np.int32)}


def regression_batch(rows: int, features: int, outputs: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(rows, features)).astype(np.float32)
  w = rng.normal(size=(features, outputs)).astype(np.float32) / np.sqrt(features)
  return {"x": x, "y": np.tanh(x @ w).astype(np.float32)}
