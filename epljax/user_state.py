"""The training state in the user's structure: what checkpoints hold.

``TrainState`` is in the trainer's internal layout: with pipeline stages the parameters (and
the optimizer's per-parameter state) are packed into flat per-stage buffers. A checkpoint
must not depend on that layout, or it could not be restored with another number of stages,
mesh or ZeRO level. ``UserState`` converts both ways:

- ``to_user(state)`` -> ``{"step", "params", "opt_state", "model_state", "feature_state"}``
  with ``params`` in the structure ``init_fn`` returned (its ``"params"`` part for Linen),
  ``opt_state`` as ``optimizer.init(params)`` would make it, ``model_state`` the rest;
- ``from_user(tree)`` -> a ``TrainState`` in the trainer's layout and shardings;
- ``abstract()``: the user tree as ``ShapeDtypeStruct``s carrying the shardings to restore
  into (the trainer's own where the layouts agree, replicated for packed parameters).

Without pipeline stages both conversions are the identity on the structure (shardings are
the trainer's business, restore reshards).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

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
               optimizer: Any, feature_state: dict, pipe: Any = None):
    self.state_shardings = state_shardings
    self.pipe = pipe
    self.feature_state = feature_state     # the features' initial state (concrete)
    mesh = jax.tree.leaves(state_shardings.step, is_leaf=_is_sharding)[0].mesh
    replicated = NamedSharding(mesh, P())
    opt_shape = jax.eval_shape(optimizer.init, params_shape)
    shapes = {"step": jax.ShapeDtypeStruct((), "int32"), "params": params_shape,
              "opt_state": opt_shape, "model_state": state_shape,
              "feature_state": jax.eval_shape(lambda: feature_state)}
    if pipe is None:
      shardings = {k: getattr(state_shardings, k) for k in PARTS}
    else:   # packed storage: the user's tree is gathered whole (replicated) on the way out
      shardings = {k: (jax.tree.map(lambda _: replicated, shapes[k])
                       if k in ("params", "opt_state") else getattr(state_shardings, k))
                   for k in PARTS}
    shardings = jax.tree.map(_device_only, shardings, is_leaf=_is_sharding)
    self._abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)
    self._to_user = None if pipe is None else jax.jit(
        self._unpacked, out_shardings=shardings)
    self._from_user = None if pipe is None else jax.jit(
        self._packed, out_shardings=state_shardings)

  def abstract(self) -> dict:
    return self._abstract

  def to_user(self, state: TrainState) -> dict:
    if self._to_user is None:
      return {k: getattr(state, k) for k in PARTS}
    return self._to_user(state)

  def from_user(self, tree: dict) -> TrainState:
    if self._from_user is None:
      return jax.device_put(TrainState(**tree), self.state_shardings)
    return self._from_user(tree)

  # -- pipeline: packed <-> user ----------------------------------------------------------
  def _unpacked(self, state: TrainState) -> dict:
    packed_def = jax.tree.structure(self.pipe.packed_shape)
    out = {k: getattr(state, k) for k in PARTS}
    out["params"] = self.pipe.unpack(state.params)
    out["opt_state"] = _map_param_subtrees(state.opt_state, self.pipe.packed_shape, packed_def,
                                           self.pipe.unpack)
    return out

  def _packed(self, tree: dict) -> TrainState:
    params_shape = self._abstract["params"]
    parts = dict(tree)
    parts["params"] = self.pipe.pack(tree["params"])
    parts["opt_state"] = _map_param_subtrees(tree["opt_state"], params_shape,
                                             jax.tree.structure(params_shape), self.pipe.pack)
    return TrainState(**parts)


def _map_param_subtrees(opt_state: Any, like: Any, like_def: Any,
                        fn: Callable[[Any], Any]) -> Any:
  """``fn`` applied to every subtree of ``opt_state`` shaped like the parameters ``like``
  (an elementwise optimizer's moments), other leaves (step counts) kept."""
  shapes = [tuple(x.shape) for x in jax.tree.leaves(like)]

  def is_params(x) -> bool:
    if jax.tree.structure(x) != like_def:
      return False
    return [tuple(getattr(v, "shape", ())) for v in jax.tree.leaves(x)] == shapes

  return jax.tree.map(lambda x: fn(x) if is_params(x) else x, opt_state, is_leaf=is_params)
