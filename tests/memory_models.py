"""Small models for the memory-feature tests: deep enough for activations to dominate."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import epljax as epl
from helpers import cross_entropy


class Block(nn.Module):
  """A transformer-style MLP block: Dense -> gelu -> Dense, residual, LayerNorm."""
  width: int = 32
  hidden: int = 128
  dropout: float = 0.0

  @nn.compact
  def __call__(self, x):
    h = nn.gelu(nn.Dense(self.hidden)(x))
    if self.dropout:
      h = nn.Dropout(self.dropout, deterministic=False)(h)
    return nn.LayerNorm()(x + nn.Dense(self.width)(h))


class Deep(nn.Module):
  """Embed -> ``depth`` blocks named ``layers_i`` -> head."""
  depth: int = 8
  width: int = 32
  hidden: int = 128
  classes: int = 16
  dropout: float = 0.0

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(self.width)(x)
    for i in range(self.depth):
      x = Block(self.width, self.hidden, self.dropout, name=f"layers_{i}")(x)
    return nn.Dense(self.classes)(x)


class TaggedDeep(Deep):
  """``Deep`` with every second block's output tagged for gradient_checkpoint "collection",
  using the returned value or (``style="tf"``) calling add_to_collection for its effect."""
  style: str = "returned"

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(self.width)(x)
    for i in range(self.depth):
      x = Block(self.width, self.hidden, name=f"layers_{i}")(x)
      if i % 2 == 1 and i < self.depth - 1:
        if self.style == "returned":
          x = epl.add_to_collection(x, "checkpoints")
        else:
          epl.add_to_collection(x, "checkpoints")
    return nn.Dense(self.classes)(x)


class TwoGraphs(Deep):
  """``Deep`` in two named task graphs, half the blocks each."""

  @nn.compact
  def __call__(self, x):
    with epl.replicate(1, name="low"):
      x = nn.Dense(self.width)(x)
      for i in range(self.depth // 2):
        x = Block(self.width, self.hidden, name=f"layers_{i}")(x)
    with epl.replicate(1, name="high"):
      for i in range(self.depth // 2, self.depth):
        x = Block(self.width, self.hidden, name=f"layers_{i}")(x)
      return nn.Dense(self.classes)(x)


class LoopStack(nn.Module):
  """Layers built in a loop inside one module (no submodule per layer): Flax names the
  Dense layers ``Dense_0, Dense_1, ...``, so no name marks where a layer starts."""
  depth: int = 8
  width: int = 32
  hidden: int = 128
  classes: int = 16

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(self.width)(x)
    for _ in range(self.depth):
      x = nn.LayerNorm()(x + nn.Dense(self.width)(nn.gelu(nn.Dense(self.hidden)(x))))
    return nn.Dense(self.classes)(x)


class ScanBlock(Block):
  """``Block`` with the (carry, x) -> (carry, y) signature of ``nn.scan``."""

  def __call__(self, x, _):
    return super().__call__(x), None


class Scanned(nn.Module):
  """``depth`` blocks under ``nn.scan``: parameters stacked on a leading layer axis."""
  depth: int = 8
  width: int = 32
  hidden: int = 128
  classes: int = 16
  remat: bool = False    # the hand-written alternative: nn.remat of the scanned block

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(self.width)(x)
    block = nn.remat(ScanBlock, prevent_cse=False) if self.remat else ScanBlock
    x, _ = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                   length=self.depth)(self.width, self.hidden, name="layers")(x, None)
    return nn.Dense(self.classes)(x)


class Attention(nn.Module):
  """Single-head self-attention over the rows of a (tokens, width) sequence, local (a band
  of ``window`` tokens) or global, with a pre-norm residual MLP after it."""
  width: int = 32
  window: int = 0        # 0: global

  @nn.compact
  def __call__(self, x):
    h = nn.RMSNorm()(x)
    q, k, v = (nn.Dense(self.width, use_bias=False)(h) for _ in range(3))
    scores = jnp.einsum("...qd,...kd->...qk", q, k) / jnp.sqrt(self.width)
    if self.window:
      t = x.shape[-2]
      band = jnp.abs(jnp.arange(t)[:, None] - jnp.arange(t)[None, :]) < self.window
      scores = jnp.where(band, scores, -1e9)
    x = x + nn.Dense(self.width, use_bias=False)(
        jnp.einsum("...qk,...kd->...qd", jax.nn.softmax(scores), v))
    h = nn.RMSNorm()(x)
    return x + nn.Dense(self.width)(nn.gelu(nn.Dense(4 * self.width)(h)))


class Alternating(nn.Module):
  """Gemma-style: ``pairs`` x (2 local + 2 global) attention layers; the two kinds differ in
  their operations, so no op histogram repeats four times."""
  pairs: int = 1
  width: int = 32
  tokens: int = 16
  classes: int = 16

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(self.width)(x).reshape(x.shape[0] // self.tokens, self.tokens, self.width)
    for i in range(4 * self.pairs):
      x = Attention(self.width, window=4 if i % 4 < 2 else 0, name=f"layers_{i}")(x)
    return nn.Dense(self.classes)(x.reshape(-1, self.width))


def deep_fns(model: Deep, *, dropout_key: int | None = None):
  """(init_fn, loss_fn) for ``model``; dropout uses a fixed key so runs can be compared."""

  def init_fn(rng, batch):
    return model.init(rng, batch["x"])

  def loss_fn(variables, batch):
    rngs = {"dropout": jax.random.key(dropout_key)} if dropout_key is not None else None
    return cross_entropy(model.apply(variables, batch["x"], rngs=rngs), batch["y"])

  return init_fn, loss_fn


def plain_mlp_fns(depth: int = 9, width: int = 32, classes: int = 16):
  """A plain-JAX pytree MLP: no module names, so "auto" falls back to sqrt(L) segments."""

  def init_fn(rng, batch):
    keys = jax.random.split(rng, depth + 1)
    sizes = [batch["x"].shape[1]] + [width] * depth
    layers = [{"w": jax.random.normal(k, (a, b)) / jnp.sqrt(a), "b": jnp.zeros(b)}
              for k, a, b in zip(keys, sizes[:-1], sizes[1:])]
    head = jax.random.normal(keys[-1], (width, classes)) / jnp.sqrt(width)
    return {"layers": layers, "head": head}

  def loss_fn(params, batch):
    x = batch["x"]
    for layer in params["layers"]:
      x = jnp.tanh(x @ layer["w"] + layer["b"])
    return optax.softmax_cross_entropy_with_integer_labels(x @ params["head"], batch["y"]).mean()

  return init_fn, loss_fn


def plain_blocks_fns(depth: int = 6, width: int = 32, hidden: int = 128, classes: int = 16):
  """Plain JAX, transformer-like: ``depth`` residual MLP blocks, no module names at all (the
  parameters under a "params" key, so the single-device reference of helpers applies)."""

  def init_fn(rng, batch):
    keys = jax.random.split(rng, 2 * depth + 2)
    dense = lambda k, a, b: jax.random.normal(k, (a, b)) / jnp.sqrt(a)  # noqa: E731
    blocks = [{"w1": dense(keys[2 * i], width, hidden), "w2": dense(keys[2 * i + 1], hidden,
                                                                     width)}
              for i in range(depth)]
    return {"params": {"embed": dense(keys[-2], batch["x"].shape[1], width), "blocks": blocks,
                       "head": dense(keys[-1], width, classes)}}

  def loss_fn(variables, batch):
    params = variables["params"]
    x = batch["x"] @ params["embed"]
    for b in params["blocks"]:
      h = x - x.mean(-1, keepdims=True)
      x = x + jax.nn.gelu(h @ b["w1"]) @ b["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(x @ params["head"], batch["y"]).mean()

  return init_fn, loss_fn


# -- trained once per test session, shared by the test modules --------------------------------

DEEP_ROWS = 1024
_CACHE: dict = {}


def deep_batch():
  from helpers import classification_batch
  return classification_batch(DEEP_ROWS, features=32, classes=16)


def deep_optimizer():
  return optax.sgd(0.1, momentum=0.9)


def deep_reference():
  """The single-device reference of ``Deep(depth=6)`` on ``deep_batch()``: 2 steps."""
  if "reference" not in _CACHE:
    from helpers import reference_run
    init_fn, loss_fn = deep_fns(Deep(depth=6))
    _CACHE["reference"] = reference_run(init_fn, loss_fn, deep_optimizer(), jax.random.key(0),
                                        deep_batch(), 2)
  return _CACHE["reference"]


def deep_run(name: str, config: dict):
  """``Deep(depth=6)`` trained 2 steps with ``config``: (trainer, state, (loss, grads) of the
  first step, step losses). The gradient is read from SGD's momentum trace after the first
  step (``g + 0.9 * 0``: what ``trainer.loss_and_grads`` gives before it), so no second
  program as large as the step is compiled."""
  if name not in _CACHE:
    from helpers import momentum_grads
    epl.init(config)
    init_fn, loss_fn = deep_fns(Deep(depth=6))
    batch = deep_batch()
    trainer = epl.Trainer(init_fn, loss_fn, deep_optimizer())
    state = trainer.init(jax.random.key(0), batch)
    losses = []
    for step in range(2):
      state, metrics = trainer.train_step(state, batch)
      losses.append(metrics["loss"])
      if step == 0:   # before the next step donates the state
        first = (metrics["loss"], jax.device_get(momentum_grads(trainer, state)))
    _CACHE[name] = (trainer, state, first, losses)
  return _CACHE[name]
