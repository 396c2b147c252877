"""A plain residual MLP stack built in a Python loop inside one module's ``__call__``: no
submodule boundaries between the layers (``Dense_0`` ... ``Dense_16`` of one module)."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

FEATURES, WIDTH, HIDDEN, DEPTH, OUTPUTS = 16, 32, 64, 8, 4
DOWN_INIT = nn.initializers.normal(0.05)   # residual branches start small, as in real stacks


class MLPLoop(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(WIDTH)(x)
    for _ in range(DEPTH):
      x = x + nn.Dense(WIDTH, kernel_init=DOWN_INIT)(nn.gelu(nn.Dense(HIDDEN)(x)))
    return nn.Dense(OUTPUTS)(x)


MODEL = MLPLoop()


def init_fn(rng, batch):
  return MODEL.init(rng, batch["x"])


def loss_fn(variables, batch):
  return jnp.mean(jnp.square(MODEL.apply(variables, batch["x"]) - batch["y"]))


# Dense_0 is the stem, Dense_17 the head. In block i, Flax names the down projection first (it
# is constructed before the up projection it is applied to): Dense_{2i+1} is the down
# (HIDDEN -> WIDTH), Dense_{2i+2} the up (WIDTH -> HIDDEN).
# Megatron: each up column, each down row; stem and head replicated. The one module has no
# submodules to name, so the annotate rule takes the whole model.
def megatron() -> dict:
  specs = {r"params/Dense_(0|17)/(kernel|bias)": ()}
  for i in range(DEPTH):
    down, up = 2 * i + 1, 2 * i + 2
    specs[rf"params/Dense_{up}/kernel"] = (None, "model")
    specs[rf"params/Dense_{up}/bias"] = ("model",)
    specs[rf"params/Dense_{down}/kernel"] = ("model", None)
    specs[rf"params/Dense_{down}/bias"] = ()
  return specs


MEGATRON = megatron()
ANNOTATE = r"MLPLoop"
