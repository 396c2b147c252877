"""ViT: patches embedded by a strided convolution, a class token, learned positions, pre-norm
encoder blocks (Flax's ``MultiHeadDotProductAttention``, GELU MLP), a classification head on
the class token."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from models.common import classification_loss

SIZE, PATCH, CHANNELS, D_MODEL, HEADS, HIDDEN, LAYERS, CLASSES = 16, 4, 3, 32, 4, 64, 2, 10
TOKENS = (SIZE // PATCH) ** 2 + 1


class EncoderBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(name="ln_1")(x)
    x = x + nn.MultiHeadDotProductAttention(HEADS, name="attn")(h, h)
    h = nn.LayerNorm(name="ln_2")(x)
    h = nn.Dense(HIDDEN, name="mlp_in")(h)
    return x + nn.Dense(D_MODEL, name="mlp_out")(nn.gelu(h))


class ViT(nn.Module):
  @nn.compact
  def __call__(self, images):
    x = nn.Conv(D_MODEL, (PATCH, PATCH), strides=(PATCH, PATCH), padding="VALID",
                name="patch_embed")(images)
    x = x.reshape(x.shape[0], -1, D_MODEL)
    cls = self.param("cls", nn.initializers.normal(0.02), (1, 1, D_MODEL))
    x = jnp.concatenate([jnp.broadcast_to(cls, (x.shape[0], 1, D_MODEL)), x], axis=1)
    x = x + self.param("pos_embedding", nn.initializers.normal(0.02), (1, TOKENS, D_MODEL))
    for i in range(LAYERS):
      x = EncoderBlock(name=f"encoder_{i}")(x)
    return nn.Dense(CLASSES, name="head")(nn.LayerNorm(name="ln_f")(x[:, 0]))


MODEL = ViT()


def init_fn(rng, batch):
  return MODEL.init(rng, batch["x"])


def loss_fn(variables, batch):
  return classification_loss(MODEL.apply(variables, batch["x"]), batch["y"])


# Megatron inside the encoder blocks: attention by heads (out = row), MLP column then row;
# patch embedding, tokens, norms and the 10-class head replicated.
MEGATRON = {
    r"params/encoder_\d+/attn/(query|key|value)/kernel": (None, "model", None),
    r"params/encoder_\d+/attn/(query|key|value)/bias": ("model", None),
    r"params/encoder_\d+/attn/out/kernel": ("model", None, None),
    r"params/encoder_\d+/attn/out/bias": (),
    r"params/encoder_\d+/mlp_in/kernel": (None, "model"),
    r"params/encoder_\d+/mlp_in/bias": ("model",),
    r"params/encoder_\d+/mlp_out/kernel": ("model", None),
    r"params/encoder_\d+/mlp_out/bias": (),
    r"params/(encoder_\d+/)?ln_\w+/(scale|bias)": (),
    r"params/(patch_embed|head)/(kernel|bias)": (),
    r"params/(cls|pos_embedding)": (),
}
ANNOTATE = r"ViT/encoder_\d+/(attn|mlp_in|mlp_out)"
