"""A T5-style encoder-decoder: a shared token table, pre-RMSNorm blocks without biases whose
attention kernels are heads-shaped (``DenseGeneral``: q/k/v ``(C, heads, head_dim)``, out
``(heads, head_dim, C)``), encoder self-attention, decoder causal self-attention and
cross-attention to the encoder's output, ReLU MLPs, a separate output head; inputs and
targets of different lengths."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

NAME = "t5"
VOCAB, SOURCE, TARGET, D_MODEL, HEADS, HIDDEN, LAYERS = 96, 16, 8, 32, 4, 64, 2
HEAD_DIM = D_MODEL // HEADS


class RMSNorm(nn.Module):
  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


class Attention(nn.Module):
  causal: bool = False

  @nn.compact
  def __call__(self, x, memory):
    dense = lambda name: nn.DenseGeneral((HEADS, HEAD_DIM), use_bias=False,  # noqa: E731
                                         name=name)
    q, k, v = dense("query")(x), dense("key")(memory), dense("value")(memory)
    logits = jnp.einsum("bthd,bshd->bhts", q, k)
    if self.causal:
      t = x.shape[1]
      logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -1e9)
    out = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(logits, -1), v)
    return nn.DenseGeneral(D_MODEL, axis=(-2, -1), use_bias=False, name="out")(out)


class Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(HIDDEN, use_bias=False, name="wi")(x))
    return nn.Dense(D_MODEL, use_bias=False, name="wo")(h)


class EncoderLayer(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = RMSNorm(name="attn_norm")(x)
    x = x + Attention(name="self_attention")(h, h)
    return x + Mlp(name="mlp")(RMSNorm(name="mlp_norm")(x))


class DecoderLayer(nn.Module):
  @nn.compact
  def __call__(self, y, memory):
    h = RMSNorm(name="self_norm")(y)
    y = y + Attention(causal=True, name="self_attention")(h, h)
    y = y + Attention(name="cross_attention")(RMSNorm(name="cross_norm")(y), memory)
    return y + Mlp(name="mlp")(RMSNorm(name="mlp_norm")(y))


class T5(nn.Module):
  @nn.compact
  def __call__(self, source, target_in):
    embed = nn.Embed(VOCAB, D_MODEL, embedding_init=nn.initializers.normal(1.0), name="shared")
    x = embed(source)
    for i in range(LAYERS):
      x = EncoderLayer(name=f"encoder_{i}")(x)
    memory = RMSNorm(name="encoder_norm")(x)
    y = embed(target_in)
    for i in range(LAYERS):
      y = DecoderLayer(name=f"decoder_{i}")(y, memory)
    return nn.Dense(VOCAB, use_bias=False, name="lm_head")(RMSNorm(name="decoder_norm")(y))


MODEL = T5()


def init_fn(rng, batch):
  return MODEL.init(rng, batch["x"], batch["y_in"])


def loss_fn(variables, batch):
  logits = MODEL.apply(variables, batch["x"], batch["y_in"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def make_batch(rows: int, seed: int = 0) -> dict:
  """Source sequences and targets (the decoder reads the targets shifted right, 0 first)."""
  rng = np.random.default_rng(seed)
  source = rng.integers(1, VOCAB, (rows, SOURCE)).astype(np.int32)
  target = rng.integers(1, VOCAB, (rows, TARGET)).astype(np.int32)
  shifted = np.concatenate([np.zeros((rows, 1), np.int32), target[:, :-1]], axis=1)
  return {"x": source, "y_in": shifted, "y": target}
