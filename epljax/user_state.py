"""The training state in the user's structure: what checkpoints hold.

A checkpoint must not depend on the trainer's layout, or it could not be restored with another
number of stages, mesh or ZeRO level. ``TrainState`` keeps the user's trees in every layout but
two (pipeline stages store the user's parameter leaves sharded over ``stage`` and pack them only
inside the step), so ``UserState`` converts by name and sharding, and for those two by value:
fused parameters stored part by part (``sharding.fused``), and ``pipeline.param_layout='stage'``,
whose parameters and optimizer state are the loop's slots (``Pipeline.to_user``):

- ``to_user(state)`` -> ``{"step", "params", "opt_state", "model_state", "feature_state"}``
  with ``params`` in the structure ``init_fn`` returned (its ``"params"`` part for Linen),
  ``opt_state`` as ``optimizer.init(params)`` would make it, ``model_state`` the rest;
- ``from_user(tree)`` -> a ``TrainState`` in the trainer's shardings;
- ``abstract()``: the user tree as ``ShapeDtypeStruct``s carrying the shardings to restore
  into (in device memory; ``from_user`` moves what lives on the host, offload, there);
- ``start(variables)``: a first state from given variables (``Trainer.init(...,
  variables=)``, pretrained weights): each leaf placed in its sharding, a fresh optimizer state.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from epljax.errors import StateError
from epljax.sharding.fused import FusedLayouts
from epljax.step import TrainState
from epljax.variables import Model, _paths

PARTS = ("step", "params", "opt_state", "model_state", "feature_state")


def _is_sharding(x) -> bool:
  return isinstance(x, jax.sharding.Sharding)


def _device_only(sh: NamedSharding) -> NamedSharding:
  # Restored into device memory; from_user moves what lives on the host (offload) there.
  return NamedSharding(sh.mesh, sh.spec)


class UserState:
  """Conversions between ``TrainState`` and the user's structure (module doc)."""

  def __init__(self, *, state_shardings: TrainState, params_shape: Any, state_shape: Any,
               optimizer: Any, feature_state: dict, fused: FusedLayouts | None = None,
               stages: Any = None, user_shardings: Any = None):
    self.state_shardings = state_shardings
    self.optimizer, self.params_shape = optimizer, params_shape
    self.fused = fused or FusedLayouts({}, 0)   # stored part by part: the user's order here
    self.stages = stages    # a Pipeline whose slots are TrainState.params, or None
    self.feature_state = feature_state     # the features' initial state (concrete)
    shapes = {"step": jax.ShapeDtypeStruct((), "int32"), "params": params_shape,
              "opt_state": jax.eval_shape(optimizer.init, params_shape),
              "model_state": state_shape, "feature_state": jax.eval_shape(lambda: feature_state)}
    shardings = {k: getattr(state_shardings, k) for k in PARTS}
    if user_shardings is not None:   # the slots' user tree: its leaves as the user's layout
      shardings.update(params=user_shardings.params, opt_state=user_shardings.opt_state)
    shardings = jax.tree.map(_device_only, shardings, is_leaf=_is_sharding)
    self._abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)
    if stages is not None:   # the slots <-> the user's trees, each one program (compiled once)
      user = {k: jax.tree.map(lambda x: x.sharding, self._abstract[k])
              for k in ("params", "opt_state")}
      self._slots_to_user = jax.jit(
          lambda p, o: (stages.to_user(p), stages.opt_to_user(o)),
          out_shardings=(user["params"], user["opt_state"]))
      self._user_to_slots = jax.jit(
          lambda p, o: (stages.to_internal(p), stages.opt_to_internal(o)),
          out_shardings=(state_shardings.params, state_shardings.opt_state))

  def abstract(self) -> dict:
    return self._abstract

  def start(self, variables: Any) -> TrainState:
    """A first state from ``variables`` in the structure ``init_fn`` returns (pretrained
    weights): step 0, ``optimizer.init`` of those parameters, the features' initial state.
    Each leaf goes straight to its sharding (a host array is never whole on one device), as a
    copy: the caller's arrays outlive the steps, which donate the state's buffers."""
    _, params, model_state = Model.split(variables)
    given = {"params": params, "model_state": model_state}
    want = {k: self._abstract[k] for k in given}
    _check_like(given, want)
    shardings = lambda tree: jax.tree.map(lambda x: x.sharding, tree)  # noqa: E731
    placed = jax.device_put(given, shardings(want))
    # device_put may hand back the caller's own buffers (even with may_alias=False: a
    # single-device array replicated keeps its buffer as device 0's shard), and the step
    # donates the state: one small program copies every leaf and makes the optimizer state.
    # From host arrays alone the placed buffers are ours, donated to that program.
    ours = not any(isinstance(x, jax.Array) for x in jax.tree.leaves(given))
    placed, opt_state = jax.jit(
        lambda tree: (jax.tree.map(jnp.copy, tree), self.optimizer.init(tree["params"])),
        out_shardings=(shardings(want), shardings(self._abstract["opt_state"])),
        donate_argnums=0 if ours else ())(placed)
    return self.from_user({"step": np.zeros((), np.int32), **placed, "opt_state": opt_state,
                           "feature_state": self.feature_state})

  def to_user(self, state: TrainState) -> dict:
    tree = {k: getattr(state, k) for k in PARTS}
    if self.stages is not None:
      tree["params"], tree["opt_state"] = self._slots_to_user(tree["params"], tree["opt_state"])
    return self._reorder(tree, to_internal=False)

  def from_user(self, tree: dict) -> TrainState:
    tree = self._reorder(dict(tree), to_internal=True)
    if self.stages is not None:
      tree["params"], tree["opt_state"] = self._user_to_slots(tree["params"], tree["opt_state"])
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


def _check_like(given: dict, want: dict) -> None:
  """``Trainer.init(..., variables=)``: the same leaves, shapes and dtypes as ``init_fn``
  makes for this batch, or a ``StateError`` naming the first leaves that differ."""
  fix = ("pass the variables of the same model definition, as init_fn returns them (a Linen "
         "model.init dict, an nnx.Module, or the pytree), cast to the dtypes init_fn makes")

  def by_path(part, tree):
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    prefix = "params/" if part == "params" else ""
    return dict(zip(_paths(tree, prefix), (x for _, x in flat)))

  for part in want:
    got, expected = by_path(part, given[part]), by_path(part, want[part])
    missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    if missing or extra:
      raise StateError(f"variables: the {part} differ from what init_fn makes; missing "
                       f"{_some(missing)}, not in the model {_some(extra)}: {fix}.")
    wrong = [f"{path}: {np.shape(x)} {_dtype(x)}, init_fn makes "
             f"{expected[path].shape} {expected[path].dtype}" for path, x in got.items()
             if (np.shape(x), _dtype(x)) != (expected[path].shape, expected[path].dtype)]
    if wrong:
      raise StateError(f"variables: {len(wrong)} of the {part} leaves differ in shape or "
                       f"dtype from what init_fn makes ({_some(wrong, '; ')}): {fix}.")


def _some(items: list[str], sep: str = ", ", first: int = 3) -> str:
  return sep.join(items[:first]) + (f"{sep}... ({len(items)} in all)" if len(items) > first
                                    else "") if items else "none"


def _dtype(x: Any) -> Any:
  return x.dtype if hasattr(x, "dtype") else np.result_type(x)   # (typed PRNG keys: .dtype)
