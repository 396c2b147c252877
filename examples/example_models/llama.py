"""Llama-style decoder: layers under ``nn.scan`` and Flax logical axis names on every parameter.

Separate q/k/v/o projections (einsum kernels ``(d_model, heads, head_dim)`` and
``(heads, head_dim, d_model)``), grouped-query attention, RMSNorm, a SwiGLU MLP, rotary
positions and an untied output head. The scanned layer's parameters carry a leading
``layers`` axis (``metadata_params``), as in MaxText.

``Size`` holds the shape: ``SMALL`` (the test zoo's, float32) and the real presets of ``SIZES``
(Llama-3-8B, Llama-2-70B), which compute in bfloat16 over float32 parameters (every kernel is
cast at use; norms, softmax and the loss stay in float32) and rematerialize each layer. The
parameters are float32 in every size: the optimizer sees master weights.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import epljax as epl
from example_models.layers import lm_fns, rms_norm, rope


@dataclasses.dataclass(frozen=True)
class Size:
  vocab: int
  d_model: int
  heads: int
  kv_heads: int
  head_dim: int
  mlp: int
  layers: int
  dtype: Any = jnp.float32     # compute dtype; parameters are float32 whatever it is
  remat: bool = False          # each scanned layer under nn.remat (saves its input alone)
  # "einsum": scores, causal mask and softmax written out (the whole score matrix);
  # "epl": epl.nn.dot_product_attention (linear memory; runs over context parallelism).
  attention: str = "einsum"

  @property
  def params(self) -> int:
    """Parameters: embedding, head, and per layer q/k/v/o, three MLP kernels, two norms."""
    attn = self.d_model * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
    layer = attn + 3 * self.d_model * self.mlp + 2 * self.d_model
    return 2 * self.vocab * self.d_model + self.layers * layer + self.d_model


SMALL = Size(vocab=128, d_model=32, heads=4, kv_heads=2, head_dim=8, mlp=64, layers=4)
SIZES = {
    "small": SMALL,
    # The real presets' program (bfloat16, remat) at a size 8 CPU devices compile in seconds.
    "tiny": Size(256, 64, 8, 8, 16, 128, 2, jnp.bfloat16, remat=True),
    # Llama-3-8B (Meta's params.json: dim 4096, 32 layers, 32 heads, 8 kv heads, ffn 14336).
    "8b": Size(128256, 4096, 32, 8, 128, 14336, 32, jnp.bfloat16, remat=True),
    # Llama-2-70B (dim 8192, 80 layers, 64 heads, 8 kv heads, ffn 28672, vocab 32000).
    "70b": Size(32000, 8192, 64, 8, 128, 28672, 80, jnp.bfloat16, remat=True),
}
def logical(init, *names):
  return nn.with_logical_partitioning(init, names)


DENSE_INIT = nn.initializers.normal(0.15)


class RMSNorm(nn.Module):
  """In float32 whatever the compute dtype; returns the input's dtype."""

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", logical(nn.initializers.ones_init(), "norm"), (x.shape[-1],))
    return rms_norm(x.astype(jnp.float32), scale).astype(x.dtype)


class Projection(nn.Module):
  """A kernel of its full shape with logical names, contracted by an einsum (MaxText's
  DenseGeneral creates its kernel this way; Flax's reshapes a flat one)."""
  shape: tuple[int, ...]
  names: tuple[str, ...]
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, equation: str, x):
    kernel = self.param("kernel", logical(DENSE_INIT, *self.names), self.shape)
    return jnp.einsum(equation, x.astype(self.dtype), kernel.astype(self.dtype))


class Attention(nn.Module):
  size: Size

  @nn.compact
  def __call__(self, x):
    s = self.size

    def proj(heads, name):
      names = ("embed", "heads" if heads == s.heads else "kv_heads", "kv")
      return Projection((s.d_model, heads, s.head_dim), names, s.dtype,
                        name=name)("btd,dhk->bthk", x)

    q, k, v = proj(s.heads, "query"), proj(s.kv_heads, "key"), proj(s.kv_heads, "value")
    positions = jnp.arange(x.shape[1])
    q = (rope(q, positions) * s.head_dim ** -0.5).astype(s.dtype)
    k = rope(k, positions).astype(s.dtype)
    if s.attention == "epl":   # (q is scaled above)
      out = epl.nn.dot_product_attention(q, k, v, causal=True, scale=1.0).astype(s.dtype)
    else:
      repeat = s.heads // s.kv_heads
      k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)   # GQA: shared k/v
      logits = jnp.einsum("bthd,bshd->bhts", q, k).astype(jnp.float32)
      causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
      probs = jax.nn.softmax(jnp.where(causal, logits, -1e30), axis=-1).astype(s.dtype)
      out = jnp.einsum("bhts,bshd->bthd", probs, v)
    return Projection((s.heads, s.head_dim, s.d_model), ("heads", "kv", "embed"), s.dtype,
                      name="out")("bthk,hkd->btd", out)


class SwiGLU(nn.Module):
  size: Size

  @nn.compact
  def __call__(self, x):
    s = self.size

    def dense(features, names, name):
      return nn.Dense(features, use_bias=False, name=name, dtype=s.dtype,
                      kernel_init=logical(DENSE_INIT, *names))

    gate = dense(s.mlp, ("embed", "mlp"), "wi_gate")(x)
    up = dense(s.mlp, ("embed", "mlp"), "wi_up")(x)
    return dense(s.d_model, ("mlp", "embed"), "wo")(nn.silu(gate) * up)


class Layer(nn.Module):
  """One decoder layer, written for ``nn.scan``: ``(carry, _) -> (carry, None)``."""
  size: Size

  @nn.compact
  def __call__(self, x, _):
    x = x + Attention(self.size, name="attn")(RMSNorm(name="attn_norm")(x))
    return x + SwiGLU(self.size, name="mlp")(RMSNorm(name="mlp_norm")(x)), None


class Llama(nn.Module):
  size: Size = SMALL

  @nn.compact
  def __call__(self, ids):
    s = self.size
    x = nn.Embed(s.vocab, s.d_model, name="embed", dtype=s.dtype, embedding_init=logical(
        nn.initializers.normal(1.0), "vocab", "embed"))(ids)
    layer = nn.remat(Layer, prevent_cse=False) if s.remat else Layer
    layers = nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True},
                     length=s.layers, metadata_params={nn.PARTITION_NAME: "layers"})
    x, _ = layers(s, name="layers")(x, None)
    x = RMSNorm(name="final_norm")(x)
    logits = nn.Dense(s.vocab, use_bias=False, name="head", dtype=s.dtype,
                      kernel_init=logical(DENSE_INIT, "embed", "vocab"))(x)
    return logits.astype(jnp.float32)


@functools.cache
def fns(size: Size = SMALL):
  """``(init_fn, loss_fn)`` of the Llama of ``size`` on batches ``{"x": ids, "y": targets}``."""
  return lm_fns(Llama(size))


# Flax logical axis rules a MaxText user writes for tensor parallelism over "model".
LOGICAL_RULES = (("vocab", "model"), ("embed", None), ("heads", "model"),
                 ("kv_heads", "model"), ("kv", None), ("mlp", "model"), ("layers", None),
                 ("norm", None))
