"""GPT-2-style decoder: Dense q/k/v, LayerNorm, GELU MLP, learned positions, tied embedding.

Module names follow GPT-2's (``wte``, ``wpe``, ``h_i``, ``ln_1``, ``c_fc``, ``c_proj``,
``ln_f``); q, k and v are three ``(d_model, d_model)`` Dense layers whose outputs are viewed as
``(heads, head_dim)``, and the logits reuse the token table (``Embed.attend``).

``Size`` holds the shape: ``SMALL`` (the zoo's: float32, blocks ``h_0``, ``h_1`` in a Python
loop) and ``SIZES["xl"]``, GPT-2-XL (1.5B; vocabulary padded to 50304 as nanoGPT does), whose
blocks run under ``nn.scan`` (one ``h`` with a leading layers axis), each rematerialized,
computing in bfloat16 over float32 parameters (LayerNorm statistics, softmax and the loss in
float32).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import epljax as epl
from models.common import lm_fns

INIT = nn.initializers.normal(0.1)


@dataclasses.dataclass(frozen=True)
class Size:
  vocab: int
  d_model: int
  heads: int
  length: int
  layers: int
  dtype: Any = jnp.float32     # compute dtype; parameters are float32 whatever it is
  scan: bool = False           # blocks under nn.scan ("h", leading layers axis) or "h_i"
  remat: bool = False          # each block under nn.remat
  attention: str = "einsum"    # or "epl": epl.nn.dot_product_attention

  @property
  def head_dim(self) -> int:
    return self.d_model // self.heads

  @property
  def params(self) -> int:
    """Parameters: both tables, per block q/k/v/c_proj, the MLP and two LayerNorms, ln_f."""
    d = self.d_model
    block = 4 * (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d) + 4 * d
    return (self.vocab + self.length) * d + self.layers * block + 2 * d


SMALL = Size(vocab=64, d_model=32, heads=4, length=16, layers=2)
SIZES = {
    "small": SMALL,
    # The XL preset's program (nn.scan, bfloat16, remat) at a size 8 CPU devices compile fast.
    "tiny": Size(256, 64, 8, 32, 2, jnp.bfloat16, scan=True, remat=True),
    # GPT-2-XL: 48 layers, 1600 wide, 25 heads, 1024 positions.
    "xl": Size(50304, 1600, 25, 1024, 48, jnp.bfloat16, scan=True, remat=True),
}
VOCAB, D_MODEL, HEADS, LENGTH, LAYERS = (SMALL.vocab, SMALL.d_model, SMALL.heads,
                                         SMALL.length, SMALL.layers)
HEAD_DIM = SMALL.head_dim


class Attention(nn.Module):
  size: Size = SMALL

  @nn.compact
  def __call__(self, x):
    s = self.size
    b, t, _ = x.shape
    q, k, v = (nn.Dense(s.d_model, kernel_init=INIT, dtype=s.dtype, name=n)(x)
               .reshape(b, t, s.heads, s.head_dim) for n in ("q", "k", "v"))
    if s.attention == "epl":
      out = epl.nn.dot_product_attention(q, k, v, causal=True).reshape(b, t, s.d_model)
    else:
      logits = jnp.einsum("bthd,bshd->bhts", q, k).astype(jnp.float32) / jnp.sqrt(
          float(s.head_dim))
      causal = jnp.tril(jnp.ones((t, t), bool))
      probs = jax.nn.softmax(jnp.where(causal, logits, -1e30), axis=-1).astype(s.dtype)
      out = jnp.einsum("bhts,bshd->bthd", probs, v).reshape(b, t, s.d_model)
    return nn.Dense(s.d_model, kernel_init=INIT, dtype=s.dtype, name="c_proj")(out)


class MLP(nn.Module):
  size: Size = SMALL

  @nn.compact
  def __call__(self, x):
    s = self.size
    h = nn.gelu(nn.Dense(4 * s.d_model, kernel_init=INIT, dtype=s.dtype, name="c_fc")(x))
    return nn.Dense(s.d_model, kernel_init=INIT, dtype=s.dtype, name="c_proj")(h)


class Block(nn.Module):
  size: Size = SMALL
  scanned: bool = False    # written for nn.scan: (carry, _) -> (carry, None)

  @nn.compact
  def __call__(self, x, _=None):
    s = self.size
    x = x + Attention(s, name="attn")(nn.LayerNorm(dtype=s.dtype, name="ln_1")(x))
    x = x + MLP(s, name="mlp")(nn.LayerNorm(dtype=s.dtype, name="ln_2")(x))
    return (x, None) if self.scanned else x


class GPT2(nn.Module):
  size: Size = SMALL

  @nn.compact
  def __call__(self, ids):
    s = self.size
    wte = nn.Embed(s.vocab, s.d_model, embedding_init=nn.initializers.normal(0.1),
                   dtype=s.dtype, name="wte")
    wpe = nn.Embed(s.length, s.d_model, embedding_init=nn.initializers.normal(0.1),
                   dtype=s.dtype, name="wpe")
    x = wte(ids) + wpe(jnp.arange(ids.shape[1]))[None]
    if s.scan:
      block = nn.remat(Block, prevent_cse=False) if s.remat else Block
      x, _ = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                     length=s.layers)(s, scanned=True, name="h")(x, None)
    else:
      block = nn.remat(Block) if s.remat else Block
      for i in range(s.layers):
        x = block(s, name=f"h_{i}")(x)
    return wte.attend(nn.LayerNorm(dtype=s.dtype, name="ln_f")(x)).astype(jnp.float32)


@functools.cache
def fns(size: Size = SMALL):
  """``(init_fn, loss_fn)`` of the GPT-2 of ``size`` on batches ``{"x": ids, "y": targets}``."""
  return lm_fns(GPT2(size))


MODEL = GPT2()
init_fn, loss_fn = fns(SMALL)

# Megatron: q/k/v column (= by heads, the heads being the major part of the features), the
# output projection and c_proj row, c_fc column, the token table by vocabulary; positions and
# norms replicated. ``h_\d+`` are the looped blocks, ``h`` the scanned ones (a leading layers
# axis, never split).
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
    r"params/h/attn/(q|k|v)/kernel": (None, None, "model"),
    r"params/h/attn/(q|k|v)/bias": (None, "model"),
    r"params/h/(attn|mlp)/c_proj/kernel": (None, "model", None),
    r"params/h/(attn|mlp)/c_proj/bias": (),
    r"params/h/mlp/c_fc/kernel": (None, None, "model"),
    r"params/h/mlp/c_fc/bias": (None, "model"),
    r"params/h/ln_\d/(scale|bias)": (),
}
ANNOTATE = r"GPT2/(wte|h(_\d+)?/(attn|mlp))"
