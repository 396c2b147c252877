"""Pieces the example models share, as plain functions: the language-model loss, RMSNorm and
rotary positions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
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
