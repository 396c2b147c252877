"""The training state in the user's structure: what checkpoints hold.

A checkpoint must not depend on the trainer's layout, or it could not be restored with another
number of stages, mesh or ZeRO level. ``TrainState`` keeps the user's trees in every layout
(pipeline stages store the user's parameter leaves sharded over ``stage`` and pack them only
inside the step), so ``UserState`` converts by name and sharding only:

- ``to_user(state)`` -> ``{"step", "params", "opt_state", "model_state", "feature_state"}``
  with ``params`` in the structure ``init_fn`` returned (its ``"params"`` part for Linen),
  ``opt_state`` as ``optimizer.init(params)`` would make it, ``model_state`` the rest;
- ``from_user(tree)`` -> a ``TrainState`` in the trainer's shardings;
- ``abstract()``: the user tree as ``ShapeDtypeStruct``s carrying the shardings to restore
  into (in device memory; ``from_user`` moves what lives on the host, offload, there).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding

from epljax.sharding.fused import FusedLayouts
from epljax.step import TrainState

PARTS = ("step", "params", "opt_state", "model_state", "feature_state")


def _is_sharding(x) -> bool:
  return isinstance(x, jax.sharding.Sharding)


def _device_only(sh: NamedSharding) -> NamedSharding:
  # Restored into device memory; from_user moves what lives on the host (offload) there.
  return NamedSharding(sh.mesh, sh.spec)


class UserState:
  """Conversions between ``TrainState`` and the user's structure (module doc)."""

  def __init__(self, *, state_shardings: TrainState, params_shape: Any, state_shape: Any,
               optimizer: Any, feature_state: dict, fused: FusedLayouts | None = None):
    self.state_shardings = state_shardings
    self.optimizer, self.params_shape = optimizer, params_shape
    self.fused = fused or FusedLayouts({}, 0)   # stored part by part: the user's order here
    self.feature_state = feature_state     # the features' initial state (concrete)
    shapes = {"step": jax.ShapeDtypeStruct((), "int32"), "params": params_shape,
              "opt_state": jax.eval_shape(optimizer.init, params_shape),
              "model_state": state_shape, "feature_state": jax.eval_shape(lambda: feature_state)}
    shardings = {k: getattr(state_shardings, k) for k in PARTS}
    shardings = jax.tree.map(_device_only, shardings, is_leaf=_is_sharding)
    self._abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)

  def abstract(self) -> dict:
    return self._abstract

  def to_user(self, state: TrainState) -> dict:
    tree = {k: getattr(state, k) for k in PARTS}
    return self._reorder(tree, to_internal=False)

  def from_user(self, tree: dict) -> TrainState:
    tree = self._reorder(dict(tree), to_internal=True)
    return jax.device_put(TrainState(**tree), self.state_shardings)

  def _reorder(self, tree: dict, to_internal: bool) -> dict:
    """Fused parameters (and their optimizer state) between the stored order and the user's
    (``sharding.fused``)."""
    if not self.fused:
      return tree
    fused = self.fused
    tree["params"] = fused.to_internal(tree["params"]) if to_internal else fused.to_user(
        tree["params"])
    tree["opt_state"] = fused.opt_state(self.optimizer, tree["opt_state"], self.params_shape,
                                        to_internal)
    return tree
