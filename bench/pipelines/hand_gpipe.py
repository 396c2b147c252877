"""The hand-written ``shard_map`` GPipe the pipeline benches and ``tests/test_cost.py`` compare
epljax with (``compile.py``: compile time and HLO; ``memory.py``: bytes).

Parameters ``{"stem", "blocks", "head"}``: the blocks stacked ``(S, L/S, ...)`` and stored over
``stage`` (so each stage device holds its own layers where they run), stem and head replicated.
The loss runs the stem on every micro batch, a loop of ``M + S - 1`` ticks in a ``shard_map``
over ``(data, stage)`` (each tick: a ``lax.scan`` over the stage's blocks, then one ``ppermute``
to the next stage), the head, and the mean cross-entropy; ``jax.grad`` differentiates through
it all (GPipe: every forward, then every backward).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def mesh_of(devices, stages: int) -> Mesh:
  """2 replicas x ``stages`` stages."""
  return Mesh(np.array(devices[:2 * stages]).reshape(2, stages), ("data", "stage"))


def shardings(params, mesh: Mesh):
  """``blocks`` over ``stage`` (each stage its own ``L/S`` layers), the rest replicated."""
  return {k: jax.tree.map(lambda _, k=k: NamedSharding(mesh, P("stage" if k == "blocks"
                                                                 else None)), v)
          for k, v in params.items()}


def gpipe_loss(stem, block, head, mesh: Mesh, micro: int):
  """``loss(params, batch)`` of the hand-written GPipe (see the module doc): ``stem(p, x)``,
  ``block(p, h)`` (one layer) and ``head(p, h)`` applied to one micro batch; ``batch``:
  ``{"x", "y"}`` with ``micro`` micro batches of both replicas' rows."""
  stages = mesh.shape["stage"]

  def pipeline(blocks, h):          # h: (M, rows, ...) per replica; stage-local blocks
    stage = lax.axis_index("stage")
    blocks = jax.tree.map(lambda a: a[0], blocks)

    def tick(carry, t):
      inbox, outs = carry
      x = jnp.where(stage == 0, h[jnp.minimum(t, micro - 1)], inbox)
      y = lax.scan(lambda c, p: (block(p, c), None), x, blocks)[0]
      m = t - (stages - 1)
      outs = jnp.where((stage == stages - 1) & (m >= 0),
                       outs.at[jnp.clip(m, 0, micro - 1)].set(y), outs)
      return (lax.ppermute(y, "stage", [(i, (i + 1) % stages) for i in range(stages)]),
              outs), None

    (_, outs), _ = lax.scan(tick, (jnp.zeros_like(h[0]), jnp.zeros_like(h)),
                            jnp.arange(micro + stages - 1))
    return lax.psum(jnp.where(stage == stages - 1, outs, 0.0), "stage")

  run = jax.shard_map(pipeline, mesh=mesh, in_specs=(P("stage"), P(None, "data")),
                      out_specs=P(None, "data"), check_vma=False)

  def loss(p, bt):
    x = bt["x"].reshape(micro, -1, *bt["x"].shape[1:])
    h = jax.vmap(lambda xm: stem(p["stem"], xm))(x)
    logits = jax.vmap(lambda hm: head(p["head"], hm))(run(p["blocks"], h))
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, bt["y"].reshape(micro, -1, *bt["y"].shape[1:])).mean()

  return loss
