"""Pieces every zoo model uses: losses, RMSNorm and rotary positions as plain functions, and
deterministic numpy batches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax


def lm_loss(logits, targets):
  """Next-token cross entropy, averaged over every position of every row."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def lm_fns(model):
  """``(init_fn, loss_fn)`` of a language model on batches ``{"x": ids, "y": next ids}``."""
  def init_fn(rng, batch):
    return model.init(rng, batch["x"])

  def loss_fn(variables, batch):
    return lm_loss(model.apply(variables, batch["x"]), batch["y"])

  return init_fn, loss_fn


def classification_loss(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def rms_norm(x, scale, eps=1e-6):
  return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps) * scale


def rope(x, positions, base=10_000.0):
  """Rotary position embedding of ``x`` ``(batch, length, heads, dim)``: rotates pairs of
  features (first half, second half) by an angle growing with the position."""
  half = x.shape[-1] // 2
  freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle = positions[:, None].astype(jnp.float32) * freq[None, :]     # (length, half)
  sin, cos = jnp.sin(angle)[None, :, None, :], jnp.cos(angle)[None, :, None, :]
  first, second = x[..., :half], x[..., half:]
  return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


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
