"""MLP-Mixer: non-overlapping patches embedded by one Dense layer, blocks of a token-mixing
MLP (applied over the patches, on the transposed activations) and a channel-mixing MLP, each
pre-LayerNorm with a residual, global average pooling and a zero-initialized classifier."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax

NAME = "mixer"
SIZE, PATCH, CHANNELS, CLASSES = 16, 4, 3, 10
D_MODEL, TOKENS_HIDDEN, CHANNELS_HIDDEN, LAYERS = 32, 32, 128, 4
PATCHES = (SIZE // PATCH) ** 2


class MlpBlock(nn.Module):
  hidden: int

  @nn.compact
  def __call__(self, x):
    h = nn.gelu(nn.Dense(self.hidden, name="fc1")(x))
    return nn.Dense(x.shape[-1], name="fc2")(h)


class MixerBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = jnp.swapaxes(nn.LayerNorm(name="norm1")(x), 1, 2)
    x = x + jnp.swapaxes(MlpBlock(TOKENS_HIDDEN, name="token_mixing")(h), 1, 2)
    return x + MlpBlock(CHANNELS_HIDDEN, name="channel_mixing")(nn.LayerNorm(name="norm2")(x))


class Mixer(nn.Module):
  @nn.compact
  def __call__(self, images):
    b = images.shape[0]
    n = SIZE // PATCH
    patches = images.reshape(b, n, PATCH, n, PATCH, CHANNELS).transpose(0, 1, 3, 2, 4, 5)
    x = nn.Dense(D_MODEL, name="stem")(patches.reshape(b, PATCHES, -1))
    for i in range(LAYERS):
      x = MixerBlock(name=f"block_{i}")(x)
    x = jnp.mean(nn.LayerNorm(name="pre_head_norm")(x), axis=1)
    return nn.Dense(CLASSES, kernel_init=nn.initializers.zeros, name="head")(x)


MODEL = Mixer()


def init_fn(rng, batch):
  return MODEL.init(rng, batch["x"])


def loss_fn(variables, batch):
  return optax.softmax_cross_entropy_with_integer_labels(
      MODEL.apply(variables, batch["x"]), batch["y"]).mean()


def make_batch(rows: int, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  return {"x": rng.normal(size=(rows, SIZE, SIZE, CHANNELS)).astype(np.float32),
          "y": rng.integers(0, CLASSES, rows).astype(np.int32)}
