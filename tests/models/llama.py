"""Llama-style decoder: layers under ``nn.scan`` and Flax logical axis names on every parameter.

Separate q/k/v/o projections (``DenseGeneral`` kernels ``(d_model, heads, head_dim)`` and
``(heads, head_dim, d_model)``), grouped-query attention, RMSNorm, a SwiGLU MLP, rotary
positions and an untied output head. The scanned layer's parameters carry a leading
``layers`` axis (``metadata_params``), as in MaxText.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.common import lm_loss, rms_norm, rope

VOCAB, D_MODEL, HEADS, KV_HEADS, HEAD_DIM, MLP, LAYERS = 128, 32, 4, 2, 8, 64, 4


def logical(init, *names):
  return nn.with_logical_partitioning(init, names)


DENSE_INIT = nn.initializers.normal(0.15)


class RMSNorm(nn.Module):
  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", logical(nn.initializers.ones_init(), "norm"), (x.shape[-1],))
    return rms_norm(x, scale)


class Attention(nn.Module):
  @nn.compact
  def __call__(self, x):
    def proj(heads, name):
      return nn.DenseGeneral((heads, HEAD_DIM), use_bias=False, name=name, kernel_init=logical(
          DENSE_INIT, "embed", "heads" if heads == HEADS else "kv_heads", "kv"))(x)

    q, k, v = proj(HEADS, "query"), proj(KV_HEADS, "key"), proj(KV_HEADS, "value")
    positions = jnp.arange(x.shape[1])
    q, k = rope(q, positions) * HEAD_DIM ** -0.5, rope(k, positions)
    repeat = HEADS // KV_HEADS
    k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)   # GQA: shared k/v
    logits = jnp.einsum("bthd,bshd->bhts", q, k)
    causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    probs = jax.nn.softmax(jnp.where(causal, logits, -1e30), axis=-1)
    out = jnp.einsum("bhts,bshd->bthd", probs, v)
    return nn.DenseGeneral(D_MODEL, axis=(-2, -1), use_bias=False, name="out",
                           kernel_init=logical(DENSE_INIT, "heads", "kv", "embed"))(out)


class SwiGLU(nn.Module):
  @nn.compact
  def __call__(self, x):
    def dense(features, names, name):
      return nn.Dense(features, use_bias=False, name=name,
                      kernel_init=logical(DENSE_INIT, *names))

    gate = dense(MLP, ("embed", "mlp"), "wi_gate")(x)
    up = dense(MLP, ("embed", "mlp"), "wi_up")(x)
    return dense(D_MODEL, ("mlp", "embed"), "wo")(nn.silu(gate) * up)


class Layer(nn.Module):
  """One decoder layer, written for ``nn.scan``: ``(carry, _) -> (carry, None)``."""

  @nn.compact
  def __call__(self, x, _):
    x = x + Attention(name="attn")(RMSNorm(name="attn_norm")(x))
    return x + SwiGLU(name="mlp")(RMSNorm(name="mlp_norm")(x)), None


class Llama(nn.Module):
  @nn.compact
  def __call__(self, ids):
    x = nn.Embed(VOCAB, D_MODEL, name="embed", embedding_init=logical(
        nn.initializers.normal(1.0), "vocab", "embed"))(ids)
    layers = nn.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True},
                     length=LAYERS, metadata_params={nn.PARTITION_NAME: "layers"})
    x, _ = layers(name="layers")(x, None)
    x = RMSNorm(name="final_norm")(x)
    return nn.Dense(VOCAB, use_bias=False, name="head",
                    kernel_init=logical(DENSE_INIT, "embed", "vocab"))(x)


MODEL = Llama()


def init_fn(rng, batch):
  return MODEL.init(rng, batch["x"])


def loss_fn(variables, batch):
  return lm_loss(MODEL.apply(variables, batch["x"]), batch["y"])


# Flax logical axis rules a MaxText user writes for tensor parallelism over "model".
LOGICAL_RULES = (("vocab", "model"), ("embed", None), ("heads", "model"),
                 ("kv_heads", "model"), ("kv", None), ("mlp", "model"), ("layers", None),
                 ("norm", None))

# Megatron on the scanned parameters (leading layers axis never split).
MEGATRON = {
    r"params/embed/embedding": ("model", None),
    r"params/layers/attn/(query|key|value)/kernel": (None, None, "model", None),
    r"params/layers/attn/out/kernel": (None, "model", None, None),
    r"params/layers/mlp/wi_(gate|up)/kernel": (None, None, "model"),
    r"params/layers/mlp/wo/kernel": (None, "model", None),
    r"params/(layers/)?\w*norm/scale": (),
    r"params/head/kernel": (None, "model"),
}
ANNOTATE = r"Llama/(embed|layers/(attn|mlp)|head)"
