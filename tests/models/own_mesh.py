"""A 2-layer GPT that brings its own ``Mesh``, as MaxText's decoder does: its blocks constrain
activations with ``with_sharding_constraint(x, NamedSharding(own_mesh, P(...)))`` on a mesh its
own config builds (``data x fsdp x tensor`` over the same 8 devices), not on epljax's.

``OwnMeshGPT(spec=...)`` picks the constraint; the default names only axes epljax's logical
rules map (``data``, ``fsdp`` -> data; ``tensor`` -> model). ``bare=True`` passes the bare
``PartitionSpec`` under ``with own_mesh:`` instead of a ``NamedSharding``.
"""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.common import lm_loss

VOCAB, D_MODEL, HEADS, LENGTH, LAYERS = 32, 16, 2, 8, 2
HEAD_DIM = D_MODEL // HEADS
INIT = nn.initializers.normal(0.1)
AXES = ("data", "fsdp", "tensor")
SPEC = P(("data", "fsdp"), None, "tensor")


def own_mesh(shape=(2, 2, 2), axes=AXES) -> Mesh:
  """The model's own mesh over every device, shaped unlike epljax's (its config's choice)."""
  return Mesh(np.asarray(jax.devices()).reshape(shape), axes)


class Block(nn.Module):
  spec: P
  mesh_shape: tuple
  axes: tuple
  bare: bool

  def constrain(self, x):
    mesh = own_mesh(self.mesh_shape, self.axes)
    if self.bare:
      with warnings.catch_warnings():   # jax 0.10 deprecates `with mesh:`; MaxText still uses it
        warnings.simplefilter("ignore", DeprecationWarning)
        with mesh:
          return jax.lax.with_sharding_constraint(x, self.spec)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, self.spec))

  @nn.compact
  def __call__(self, x):
    b, t, _ = x.shape
    h = self.constrain(nn.LayerNorm(use_bias=False, name="ln_1")(x))
    q, k, v = (nn.Dense(D_MODEL, use_bias=False, kernel_init=INIT, name=n)(h)
               .reshape(b, t, HEADS, HEAD_DIM) for n in ("q", "k", "v"))
    logits = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(float(HEAD_DIM))
    probs = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -1e30), -1)
    out = jnp.einsum("bhts,bshd->bthd", probs, v).reshape(b, t, D_MODEL)
    x = x + nn.Dense(D_MODEL, use_bias=False, kernel_init=INIT, name="o")(out)
    h = nn.gelu(nn.Dense(2 * D_MODEL, use_bias=False, kernel_init=INIT, name="fc")(
        nn.LayerNorm(use_bias=False, name="ln_2")(x)))
    return self.constrain(x + nn.Dense(D_MODEL, use_bias=False, kernel_init=INIT,
                                       name="proj")(h))


class OwnMeshGPT(nn.Module):
  spec: P = SPEC
  mesh_shape: tuple = (2, 2, 2)
  axes: tuple = AXES
  bare: bool = False

  @nn.compact
  def __call__(self, ids):
    wte = nn.Embed(VOCAB, D_MODEL, embedding_init=nn.initializers.normal(0.1), name="wte")
    x = wte(ids)
    for i in range(LAYERS):
      x = Block(self.spec, self.mesh_shape, self.axes, self.bare, name=f"h_{i}")(x)
    return wte.attend(nn.LayerNorm(use_bias=False, name="ln_f")(x))


def fns(model: OwnMeshGPT | None = None):
  """``(init_fn, loss_fn)`` of ``model`` (default: ``OwnMeshGPT()``) for ``epl.Trainer``."""
  model = OwnMeshGPT() if model is None else model
  def init_fn(rng, batch):
    return model.init(rng, batch["x"])

  def loss_fn(variables, batch):
    return lm_loss(model.apply(variables, batch["x"]), batch["y"])

  return init_fn, loss_fn
