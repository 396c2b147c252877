"""A ConvNeXt-style convolutional net: a patchifying stem (a 2x2 convolution of stride 2),
blocks of a depthwise 7x7 convolution (``feature_group_count`` = channels), LayerNorm, an
inverted-bottleneck MLP (4x, GELU) with layer scale and a residual, a LayerNorm and strided
2x2 convolution between the two stages, global average pooling and a classifier."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax

NAME = "convnext"
SIZE, CHANNELS, CLASSES = 16, 3, 10
WIDTHS, DEPTHS = (16, 32), (2, 2)


class Block(nn.Module):
  width: int

  @nn.compact
  def __call__(self, x):
    h = nn.Conv(self.width, (7, 7), padding="SAME", feature_group_count=self.width,
                name="dwconv")(x)
    h = nn.LayerNorm(epsilon=1e-6, name="norm")(h)
    h = nn.Dense(4 * self.width, name="pwconv1")(h)
    h = nn.Dense(self.width, name="pwconv2")(nn.gelu(h))
    gamma = self.param("gamma", nn.initializers.constant(1e-6), (self.width,))
    return x + gamma * h


class ConvNeXt(nn.Module):
  @nn.compact
  def __call__(self, images):
    x = nn.Conv(WIDTHS[0], (2, 2), strides=(2, 2), padding="VALID", name="stem")(images)
    x = nn.LayerNorm(epsilon=1e-6, name="stem_norm")(x)
    for s, (width, depth) in enumerate(zip(WIDTHS, DEPTHS)):
      if s:
        x = nn.LayerNorm(epsilon=1e-6, name=f"down_norm_{s}")(x)
        x = nn.Conv(width, (2, 2), strides=(2, 2), padding="VALID", name=f"down_{s}")(x)
      for i in range(depth):
        x = Block(width, name=f"stage_{s}_block_{i}")(x)
    x = nn.LayerNorm(epsilon=1e-6, name="head_norm")(jnp.mean(x, axis=(1, 2)))
    return nn.Dense(CLASSES, name="head")(x)


MODEL = ConvNeXt()


def init_fn(rng, batch):
  return MODEL.init(rng, batch["x"])


def loss_fn(variables, batch):
  return optax.softmax_cross_entropy_with_integer_labels(
      MODEL.apply(variables, batch["x"]), batch["y"]).mean()


def make_batch(rows: int, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  return {"x": rng.normal(size=(rows, SIZE, SIZE, CHANNELS)).astype(np.float32),
          "y": rng.integers(0, CLASSES, rows).astype(np.int32)}
