"""A mixture-of-experts decoder: causal self-attention (separate q/k/v, RMSNorm), every
feed-forward layer an ``epljax.nn.MoE`` (8 experts, top-2 routing with capacity), the
experts' load-balancing loss added to the next-token loss with weight 0.01, an untied head."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from epljax.nn.moe import MoE

NAME = "moe"
VOCAB, LENGTH, D_MODEL, HEADS, EXPERTS, HIDDEN, LAYERS = 96, 16, 32, 4, 8, 64, 2
AUX_WEIGHT = 0.01


class RMSNorm(nn.Module):
  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


class Attention(nn.Module):
  @nn.compact
  def __call__(self, x):
    b, t, c = x.shape
    q, k, v = (nn.Dense(c, use_bias=False, name=n)(x).reshape(b, t, HEADS, c // HEADS)
               for n in ("q", "k", "v"))
    logits = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(c // HEADS)
    logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -1e9)
    out = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(logits, -1), v).reshape(b, t, c)
    return nn.Dense(c, use_bias=False, name="o")(out)


class Layer(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = x + Attention(name="attn")(RMSNorm(name="attn_norm")(x))
    y, aux = MoE(EXPERTS, HIDDEN, name="moe")(RMSNorm(name="moe_norm")(x))
    return x + y, aux


class Decoder(nn.Module):
  @nn.compact
  def __call__(self, ids):
    x = nn.Embed(VOCAB, D_MODEL, name="embed")(ids)
    aux = 0.0
    for i in range(LAYERS):
      x, a = Layer(name=f"layer_{i}")(x)
      aux = aux + a
    return nn.Dense(VOCAB, use_bias=False, name="head")(RMSNorm(name="norm")(x)), aux


MODEL = Decoder()


def init_fn(rng, batch):
  return MODEL.init(rng, batch["x"])


def loss_fn(variables, batch):
  logits, aux = MODEL.apply(variables, batch["x"])
  lm = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
  return lm + AUX_WEIGHT * aux / LAYERS


def make_batch(rows: int, seed: int = 0) -> dict:
  ids = np.random.default_rng(seed).integers(0, VOCAB, (rows, LENGTH + 1)).astype(np.int32)
  return {"x": ids[:, :-1], "y": ids[:, 1:]}
