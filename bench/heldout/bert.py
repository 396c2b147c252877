"""A BERT-style encoder: token, position and segment embeddings, post-LayerNorm blocks with
one fused q/k/v kernel ``(C, 3C)`` split in three, GELU MLP, and a masked-language-model head
(a dense transform, LayerNorm, logits tied to the token table, a bias) on masked positions."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

NAME = "bert"
VOCAB, LENGTH, D_MODEL, HEADS, HIDDEN, LAYERS = 96, 16, 48, 4, 192, 3
MASK_ID = 1
INIT = nn.initializers.truncated_normal(0.02)


class SelfAttention(nn.Module):
  @nn.compact
  def __call__(self, x, pad):
    b, t, c = x.shape
    qkv = nn.Dense(3 * c, kernel_init=INIT, name="qkv")(x).reshape(b, t, 3, HEADS, c // HEADS)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    logits = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(c // HEADS)
    logits = jnp.where(pad[:, None, None, :], logits, -1e9)
    out = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(logits, -1), v).reshape(b, t, c)
    return nn.Dense(c, kernel_init=INIT, name="out")(out)


class Layer(nn.Module):
  @nn.compact
  def __call__(self, x, pad):
    x = nn.LayerNorm(name="attn_norm")(x + SelfAttention(name="attention")(x, pad))
    h = nn.gelu(nn.Dense(HIDDEN, kernel_init=INIT, name="intermediate")(x))
    return nn.LayerNorm(name="out_norm")(x + nn.Dense(D_MODEL, kernel_init=INIT,
                                                      name="output")(h))


class Bert(nn.Module):
  @nn.compact
  def __call__(self, ids, segments):
    tokens = nn.Embed(VOCAB, D_MODEL, embedding_init=INIT, name="word_embeddings")
    x = (tokens(ids) + nn.Embed(LENGTH, D_MODEL, embedding_init=INIT,
                                name="position_embeddings")(jnp.arange(ids.shape[1]))[None]
         + nn.Embed(2, D_MODEL, embedding_init=INIT, name="token_type_embeddings")(segments))
    x = nn.LayerNorm(name="embeddings_norm")(x)
    pad = ids != 0
    for i in range(LAYERS):
      x = Layer(name=f"layer_{i}")(x, pad)
    h = nn.LayerNorm(name="mlm_norm")(nn.gelu(nn.Dense(D_MODEL, kernel_init=INIT,
                                                       name="mlm_transform")(x)))
    return tokens.attend(h) + self.param("mlm_bias", nn.initializers.zeros, (VOCAB,))


MODEL = Bert()


def init_fn(rng, batch):
  return MODEL.init(rng, batch["x"], batch["segments"])


def loss_fn(variables, batch):
  logits = MODEL.apply(variables, batch["x"], batch["segments"])
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
  weights = batch["masked"].astype(jnp.float32)
  return jnp.sum(losses * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def make_batch(rows: int, seed: int = 0) -> dict:
  """Token ids (0: padding at the tail of some rows), two segments, 15% of the tokens masked."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(2, VOCAB, (rows, LENGTH)).astype(np.int32)
  lengths = rng.integers(LENGTH // 2, LENGTH + 1, rows)
  ids[np.arange(LENGTH)[None] >= lengths[:, None]] = 0
  segments = (np.arange(LENGTH)[None] >= lengths[:, None] // 2).astype(np.int32)
  masked = (rng.random((rows, LENGTH)) < 0.15) & (ids != 0)
  return {"x": np.where(masked, MASK_ID, ids).astype(np.int32), "segments": segments,
          "y": ids, "masked": masked}
