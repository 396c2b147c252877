"""Parameter slots: a pipeline's parameters as whole arrays, one row per stage.

Packed buffers (``packing.py``) flatten a stage's parameters, which loses a ``model`` sharding:
a tensor-parallel stage needs each parameter whole, with its split. Here stage parameters of
the same (shape, dtype, spec) share a *slot*: one ``(S, *shape)`` array sharded
``P(stage, *spec)`` whose row ``s`` holds stage ``s``'s leaf (zeros where stage ``s`` has none).
Identical stages fill the same slots, so a device holds about ``1/S`` of the parameters, as
with packing; stages that differ hold the union of their slot types. Model state (BatchNorm
statistics, NNX RNG streams) rides in slots too, whatever the parameters use; PRNG keys as
their raw key data (``as_data`` / ``as_key``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from epljax.mesh import DATA, STAGE
from epljax.pipeline.packing import SlotType
from epljax.pipeline.storage import ParamStore


@dataclasses.dataclass(frozen=True)
class SlotLayout:
  """One stage's leaves -> their slots; ``types``: every slot of the pipeline (the buffer
  type, the same for all stages). A stage layout for the runtime (``storage.ParamStore``)."""
  keys: tuple[str, ...]
  types: tuple[tuple[str, SlotType], ...]

  def unpack(self, slots: Mapping[str, jax.Array]) -> list[jax.Array]:
    return [slots[k] for k in self.keys]

  def pack(self, values: Sequence[Any], types: Mapping[str, SlotType]) -> dict[str, jax.Array]:
    """Values -> every slot of ``types`` (zeros in those this stage does not use)."""
    out = {k: t.zeros() for k, t in types.items()}
    for k, v in zip(self.keys, values, strict=True):
      out[k] = jnp.asarray(v, types[k].dtype)
    return out

  def accumulate(self, acc: Mapping[str, jax.Array], values: Sequence[Any]
                 ) -> dict[str, jax.Array]:
    """``acc + pack(values)``, touching only this stage's slots."""
    out = dict(acc)
    for k, v in zip(self.keys, values, strict=True):
      out[k] = acc[k] + jnp.asarray(v, acc[k].dtype)
    return out

  @property
  def sizes(self) -> dict[str, int]:
    """Elements per dtype of this stage's own leaves (as ``packing.Layout.sizes``)."""
    out: dict[str, int] = {}
    types = dict(self.types)
    for k in self.keys:
      t = types[k]
      out[t.dtype] = out.get(t.dtype, 0) + math.prod(t.shape)
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class SlotStore(ParamStore):
  """Tensor-parallel stages' parameters: ``{slot: (S, *shape)}`` sharded ``P(stage, *spec)``,
  so each keeps its ``model`` split inside the loop (``v = 1``); ``leaf_slots``: per stage,
  the slots of its exchanged leaves (``layouts`` add its parts)."""
  leaf_slots: tuple[SlotLayout, ...]

  inside = "in slots (whole arrays, split over model) inside the step"
  data_axes = (DATA,)   # ``model`` is left to GSPMD

  def _pack(self, leaves: Sequence[Any], parts: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return {k: lax.with_sharding_constraint(v, NamedSharding(
        self.mesh, P(STAGE, *self.buffers[k].spec)))
            for k, v in {**stack(leaves, self.members, self.leaf_slots), **parts}.items()}

  def _gradients(self, packed: Mapping[str, jax.Array]) -> list[Any]:
    return unstack(packed, self.members, self.leaf_slots, self.avals)

  def stash(self, layouts: list[Any]) -> tuple[list[SlotLayout], dict[str, SlotType]]:
    """Whole residuals in slots, which keep GSPMD's ``model`` split (a packed buffer would
    gather them), shared by the branches like their parameters."""
    slotted = assign([[SlotType(e.shape, e.dtype, (None,) * len(e.shape)) for e in lay.entries]
                      for lay in layouts])
    return slotted, dict(slotted[0].types)

  def bytes_inside(self) -> int:
    return sum(t.nbytes // self.split_of(t.spec) for t in self.buffers.values())


def assign(stage_leaves: Sequence[Sequence[SlotType]]) -> list[SlotLayout]:
  """Per stage, its leaves' types -> a ``SlotLayout`` per stage over shared slots: a leaf takes
  the first slot of its type that its stage does not use yet."""
  types: dict[str, SlotType] = {}
  keys_of: list[tuple[str, ...]] = []
  for leaves in stage_leaves:
    used: set[str] = set()
    keys = []
    for t in leaves:
      key = next((k for k, u in types.items() if u == t and k not in used), None)
      if key is None:
        key = f"slot{len(types)}"
        types[key] = t
      used.add(key)
      keys.append(key)
    keys_of.append(tuple(keys))
  frozen = tuple(types.items())
  return [SlotLayout(keys, frozen) for keys in keys_of]


def stack(leaves: Sequence[Any], members: Sequence[Sequence[int]],
          layouts: Sequence[SlotLayout]) -> dict[str, jax.Array]:
  """The user's leaves -> ``{slot: (S, *shape)}``; ``members[s]``: stage ``s``'s leaf indices
  (in its layout's order)."""
  types = dict(layouts[0].types)
  rows = [layout.pack([leaves[i] for i in idx], types) for idx, layout in zip(members, layouts)]
  return {k: jnp.stack([r[k] for r in rows]) for k in types}


def unstack(stacked: Mapping[str, jax.Array], members: Sequence[Sequence[int]],
            layouts: Sequence[SlotLayout], avals: Sequence[Any],
            missing: Sequence[Any] | None = None) -> list[Any]:
  """``{slot: (S, *shape)}`` -> the user's leaves: a leaf held by several stages gets the sum
  of its rows (the transpose of ``stack``); one no stage holds, zeros (or its value in
  ``missing``)."""
  leaves: list[Any] = [None] * len(avals)
  for s, (idx, layout) in enumerate(zip(members, layouts)):
    for i, k in zip(idx, layout.keys):
      leaves[i] = stacked[k][s] if leaves[i] is None else leaves[i] + stacked[k][s]
  missing = missing or [jnp.zeros(a.shape, a.dtype) for a in avals]
  return [m if x is None else x.astype(a.dtype) for x, a, m in zip(leaves, avals, missing)]


def is_key(aval: Any) -> bool:
  return jnp.issubdtype(aval.dtype, jax.dtypes.prng_key)


def data_aval(aval: Any) -> Any:
  """A state leaf's aval in a slot: PRNG keys as their raw key data."""
  return jax.eval_shape(jax.random.key_data, aval) if is_key(aval) else aval


def as_data(x: Any) -> Any:
  return jax.random.key_data(x) if is_key(x) else x


def as_key(x: Any, aval: Any) -> Any:
  """Raw key data back to a key of ``aval``'s implementation (the key dtype names it)."""
  return jax.random.wrap_key_data(x, impl=aval.dtype._impl) if is_key(aval) else x
