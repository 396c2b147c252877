"""GPT-2-style decoder: Dense q/k/v, LayerNorm, GELU MLP, learned positions, tied embedding.

Module names follow GPT-2's (``wte``, ``wpe``, ``h_i``, ``ln_1``, ``c_fc``, ``c_proj``,
``ln_f``); q, k and v are three ``(d_model, d_model)`` Dense layers whose outputs are viewed as
``(heads, head_dim)``, and the logits reuse the token table (``Embed.attend``).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.common import lm_loss

VOCAB, D_MODEL, HEADS, LENGTH, LAYERS = 64, 32, 4, 16, 2
HEAD_DIM = D_MODEL // HEADS
INIT = nn.initializers.normal(0.1)


class Attention(nn.Module):
  @nn.compact
  def __call__(self, x):
    b, t, _ = x.shape
    q, k, v = (nn.Dense(D_MODEL, kernel_init=INIT, name=n)(x).reshape(b, t, HEADS, HEAD_DIM)
               for n in ("q", "k", "v"))
    logits = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(float(HEAD_DIM))
    causal = jnp.tril(jnp.ones((t, t), bool))
    probs = jax.nn.softmax(jnp.where(causal, logits, -1e30), axis=-1)
    out = jnp.einsum("bhts,bshd->bthd", probs, v).reshape(b, t, D_MODEL)
    return nn.Dense(D_MODEL, kernel_init=INIT, name="c_proj")(out)


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.gelu(nn.Dense(4 * D_MODEL, kernel_init=INIT, name="c_fc")(x))
    return nn.Dense(D_MODEL, kernel_init=INIT, name="c_proj")(h)


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = x + Attention(name="attn")(nn.LayerNorm(name="ln_1")(x))
    return x + MLP(name="mlp")(nn.LayerNorm(name="ln_2")(x))


class GPT2(nn.Module):
  @nn.compact
  def __call__(self, ids):
    wte = nn.Embed(VOCAB, D_MODEL, embedding_init=nn.initializers.normal(0.1), name="wte")
    wpe = nn.Embed(LENGTH, D_MODEL, embedding_init=nn.initializers.normal(0.1), name="wpe")
    x = wte(ids) + wpe(jnp.arange(ids.shape[1]))[None]
    for i in range(LAYERS):
      x = Block(name=f"h_{i}")(x)
    return wte.attend(nn.LayerNorm(name="ln_f")(x))


MODEL = GPT2()


def init_fn(rng, batch):
  return MODEL.init(rng, batch["x"])


def loss_fn(variables, batch):
  return lm_loss(MODEL.apply(variables, batch["x"]), batch["y"])


# Megatron: q/k/v column (= by heads, the heads being the major part of the features), the
# output projection and c_proj row, c_fc column, the token table by vocabulary; positions and
# norms replicated.
MEGATRON = {
    r"params/wte/embedding": ("model", None),
    r"params/wpe/embedding": (),
    r"params/h_\d+/attn/(q|k|v)/kernel": (None, "model"),
    r"params/h_\d+/attn/(q|k|v)/bias": ("model",),
    r"params/h_\d+/(attn|mlp)/c_proj/kernel": ("model", None),
    r"params/h_\d+/(attn|mlp)/c_proj/bias": (),
    r"params/h_\d+/mlp/c_fc/kernel": (None, "model"),
    r"params/h_\d+/mlp/c_fc/bias": ("model",),
    r"params/(h_\d+/ln_\d|ln_f)/(scale|bias)": (),
}
ANNOTATE = r"GPT2/(wte|h_\d+/(attn|mlp))"
