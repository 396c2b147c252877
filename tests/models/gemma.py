"""Gemma-style decoder: the weight layouts of Gemma's Flax code, written here at toy size.

Fused einsum kernels (q ``(heads, d_model, head_dim)``, kv ``(2, kv_heads, d_model, head_dim)``,
output ``(heads, head_dim, d_model)``), grouped-query attention, RMSNorm, a gated MLP
``(2, d_model, hidden)`` + ``(hidden, d_model)``, rotary positions, an embedding table reused
for the logits, and layers alternating between sliding-window (local) and global attention.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

import epljax as epl
from models.common import lm_loss, rms_norm, rope

VOCAB, D_MODEL, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, LAYERS, WINDOW = 128, 32, 4, 2, 8, 64, 4, 4


class RMSNorm(nn.Module):
  @nn.compact
  def __call__(self, x):
    return rms_norm(x, 1.0 + self.param("scale", nn.initializers.zeros_init(), (x.shape[-1],)))


class Einsum(nn.Module):
  """A weight ``w`` of a fixed shape contracted with the input by an einsum equation."""
  shape: tuple[int, ...]

  @nn.compact
  def __call__(self, equation: str, x):
    w = self.param("w", nn.initializers.normal(0.2), self.shape)
    return jnp.einsum(equation, x, w)


class Embedder(nn.Module):
  """One table: ``encode`` reads rows of it, ``decode`` multiplies by it (tied logits)."""

  def setup(self):
    self.input_embedding = self.param("input_embedding", nn.initializers.normal(0.2),
                                      (VOCAB, D_MODEL))

  def encode(self, ids):
    return self.input_embedding[ids] * jnp.sqrt(float(D_MODEL))

  def decode(self, x):
    return jnp.dot(x, self.input_embedding.T)


class Attention(nn.Module):
  window: int | None   # None: global attention; k: each position sees the k latest
  attention: str = "einsum"   # or "epl": epl.nn.dot_product_attention (a mask for the window)

  @nn.compact
  def __call__(self, x):
    groups = HEADS // KV_HEADS
    q = Einsum((HEADS, D_MODEL, HEAD_DIM), name="q_einsum")("btd,hdk->bthk", x)
    k, v = Einsum((2, KV_HEADS, D_MODEL, HEAD_DIM), name="kv_einsum")("btd,ckdh->cbtkh", x)
    positions = jnp.arange(x.shape[1])
    q, k = rope(q, positions) * HEAD_DIM ** -0.5, rope(k, positions)
    if self.attention == "epl":
      t, s = positions[:, None], positions[None, :]
      window = None if self.window is None else (t - s < self.window)[None, None]
      encoded = epl.nn.dot_product_attention(q, k, v, causal=True, mask=window, scale=1.0)
      return Einsum((HEADS, HEAD_DIM, D_MODEL), name="attn_vec_einsum")("bthk,hkd->btd",
                                                                        encoded)
    q = q.reshape(*q.shape[:2], KV_HEADS, groups, HEAD_DIM)
    logits = jnp.einsum("btkgh,bskh->bkgts", q, k)
    t, s = positions[:, None], positions[None, :]
    visible = s <= t
    if self.window is not None:
      visible &= t - s < self.window
    logits = jnp.where(visible, logits, -1e30)
    probs = jax.nn.softmax(logits, axis=-1)
    encoded = jnp.einsum("bkgts,bskh->btkgh", probs, v).reshape(*x.shape[:2], HEADS, HEAD_DIM)
    return Einsum((HEADS, HEAD_DIM, D_MODEL), name="attn_vec_einsum")("bthk,hkd->btd", encoded)


class FeedForward(nn.Module):
  @nn.compact
  def __call__(self, x):
    gating = self.param("gating_einsum", nn.initializers.normal(0.2), (2, D_MODEL, HIDDEN))
    linear = self.param("linear", nn.initializers.normal(0.1), (HIDDEN, D_MODEL))
    gate, up = jnp.einsum("btd,cdf->cbtf", x, gating)
    return jnp.einsum("btf,fd->btd", nn.gelu(gate) * up, linear)


class Layer(nn.Module):
  window: int | None
  attention: str = "einsum"

  @nn.compact
  def __call__(self, x):
    x = x + Attention(self.window, self.attention, name="attn")(RMSNorm(name="pre_attention_norm")(x))
    return x + FeedForward(name="mlp")(RMSNorm(name="pre_ffw_norm")(x))


class Gemma(nn.Module):
  attention: str = "einsum"   # "epl": epl.nn.dot_product_attention

  @nn.compact
  def __call__(self, ids):
    embedder = Embedder(name="embedder")
    x = embedder.encode(ids)
    for i in range(LAYERS):
      x = Layer(WINDOW if i % 2 == 0 else None, self.attention, name=f"layer_{i}")(x)   # local, global, ...
    logits = embedder.decode(RMSNorm(name="final_norm")(x))
    return jnp.tanh(logits / 30.0) * 30.0   # final logit soft-capping (Gemma 2)


MODEL = Gemma()


def init_fn(rng, batch):
  return MODEL.init(rng, batch["x"])


def loss_fn(variables, batch):
  return lm_loss(MODEL.apply(variables, batch["x"]), batch["y"])


# Megatron: heads for q/kv/out (out = row), hidden for the gated MLP (column then row), the
# table on the vocabulary; norms replicated.
MEGATRON = {
    r"params/embedder/input_embedding": ("model", None),
    r"params/layer_\d+/attn/q_einsum/w": ("model", None, None),
    r"params/layer_\d+/attn/kv_einsum/w": (None, "model", None, None),
    r"params/layer_\d+/attn/attn_vec_einsum/w": ("model", None, None),
    r"params/layer_\d+/mlp/gating_einsum": (None, None, "model"),
    r"params/layer_\d+/mlp/linear": ("model", None),
    r"params/.*norm/scale": (),
}
ANNOTATE = r"Gemma/(embedder|layer_\d+/(attn|mlp))"
