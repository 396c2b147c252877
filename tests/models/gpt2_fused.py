"""GPT-2 as Hugging Face writes it: one fused ``c_attn`` matmul for q, k and v, split in three.

Every projection is a ``Conv1D`` (``c_attn``, ``c_proj``, ``c_fc``): ``x @ W + b`` with ``W``
``(in, out)``, the layout of Hugging Face's PyTorch ``Conv1D`` (``c_attn``: ``(C, 3C)``). With
``transposed`` the kernel is stored ``(out, in)`` and read transposed, as Hugging Face's
``FlaxConv1D`` and nanoGPT's ``nn.Linear`` hold it (``c_attn``: ``(3C, C)``). The attention
splits ``c_attn``'s output in three along the features (``jnp.split(qkv, 3, axis=2)``, as
``FlaxGPT2Attention`` does) and views each part as ``(heads, head_dim)``; GELU is the tanh
approximation (``gelu_new``); the logits reuse the token table.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

import epljax as epl
from models.common import lm_loss
from models.gpt2 import D_MODEL, HEAD_DIM, HEADS, LAYERS, LENGTH, VOCAB

__all__ = ["D_MODEL", "HEADS", "LAYERS", "LENGTH", "VOCAB"]
INIT = nn.initializers.normal(0.1)


class Conv1D(nn.Module):
  features: int
  transposed: bool = False

  @nn.compact
  def __call__(self, x):
    shape = ((self.features, x.shape[-1]) if self.transposed else (x.shape[-1], self.features))
    kernel = self.param("kernel", INIT, shape)
    if self.transposed:
      kernel = kernel.transpose()
    y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
    # A small nonzero bias, so that its split (and its gradient's) is checked too.
    return y + self.param("bias", nn.initializers.normal(0.01), (self.features,))


class Attention(nn.Module):
  transposed: bool
  attention: str = "einsum"   # or "epl": epl.nn.dot_product_attention

  @nn.compact
  def __call__(self, x):
    b, t, _ = x.shape
    qkv = Conv1D(3 * D_MODEL, self.transposed, name="c_attn")(x)
    q, k, v = (part.reshape(b, t, HEADS, HEAD_DIM) for part in jnp.split(qkv, 3, axis=2))
    if self.attention == "epl":
      out = epl.nn.dot_product_attention(q, k, v, causal=True).reshape(b, t, D_MODEL)
    else:
      logits = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(float(HEAD_DIM))
      causal = jnp.tril(jnp.ones((t, t), bool))
      probs = jax.nn.softmax(jnp.where(causal, logits, -1e30), axis=-1)
      out = jnp.einsum("bhts,bshd->bthd", probs, v).reshape(b, t, D_MODEL)
    return Conv1D(D_MODEL, self.transposed, name="c_proj")(out)


class MLP(nn.Module):
  transposed: bool

  @nn.compact
  def __call__(self, x):
    h = nn.gelu(Conv1D(4 * D_MODEL, self.transposed, name="c_fc")(x), approximate=True)
    return Conv1D(D_MODEL, self.transposed, name="c_proj")(h)


class Block(nn.Module):
  transposed: bool
  attention: str = "einsum"

  @nn.compact
  def __call__(self, x):
    x = x + Attention(self.transposed, self.attention, name="attn")(nn.LayerNorm(name="ln_1")(x))
    return x + MLP(self.transposed, name="mlp")(nn.LayerNorm(name="ln_2")(x))


class GPT2(nn.Module):
  transposed: bool = False
  remat: bool = False      # each block under nn.remat (Hugging Face's gradient_checkpointing)
  attention: str = "einsum"   # "epl": epl.nn.dot_product_attention

  @nn.compact
  def __call__(self, ids):
    wte = nn.Embed(VOCAB, D_MODEL, embedding_init=nn.initializers.normal(0.1), name="wte")
    wpe = nn.Embed(LENGTH, D_MODEL, embedding_init=nn.initializers.normal(0.1), name="wpe")
    x = wte(ids) + wpe(jnp.arange(ids.shape[1]))[None]
    block = nn.remat(Block) if self.remat else Block
    for i in range(LAYERS):
      x = block(self.transposed, self.attention, name=f"h_{i}")(x)
    return wte.attend(nn.LayerNorm(name="ln_f")(x))


def init_fn_of(model: GPT2):
  return lambda rng, batch: model.init(rng, batch["x"])


def loss_fn_of(model: GPT2):
  return lambda variables, batch: lm_loss(model.apply(variables, batch["x"]), batch["y"])


def megatron(transposed: bool) -> dict:
  """Megatron's specs: ``c_attn`` and ``c_fc`` column (``c_attn`` over each of q, k and v: the
  fused parameter is held with device d's heads of every part), both ``c_proj`` row."""
  out, inp = (("model", None), (None, "model")) if transposed else (
      (None, "model"), ("model", None))
  return {
      r"params/wte/embedding": ("model", None),
      r"params/wpe/embedding": (),
      r"params/h_\d+/(attn/c_attn|mlp/c_fc)/kernel": out,
      r"params/h_\d+/(attn/c_attn|mlp/c_fc)/bias": ("model",),
      r"params/h_\d+/(attn|mlp)/c_proj/kernel": inp,
      r"params/h_\d+/(attn|mlp)/c_proj/bias": (),
      r"params/(h_\d+/ln_\d|ln_f)/(scale|bias)": (),
  }


ANNOTATE = r"GPT2/(wte|h_\d+/(attn|mlp))"
