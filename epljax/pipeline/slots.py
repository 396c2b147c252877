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
from epljax.pipeline.storage import ParamStore, stage_dim


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
            for k, v in {**self._exchange().pack(leaves), **parts}.items()}

  def _gradients(self, packed: Mapping[str, jax.Array]) -> list[Any]:
    keys = set(dict(self.leaf_slots[0].types))
    return self._exchange().gradients({k: v for k, v in packed.items() if k in keys})

  def _exchange(self) -> SlotExchange:
    return SlotExchange(self.mesh, self.avals, self.members, self.leaf_slots,
                        tuple(stage_dim(sh.spec) for sh in self.shardings))

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


@dataclasses.dataclass(frozen=True)
class SlotExchange:
  """The stored leaves (each split over ``stage`` on its dimension ``dims[i]``, or not split)
  <-> the slots, written out per device in a ``shard_map`` over ``stage`` (``model`` and
  ``data`` left to GSPMD, so each piece keeps its split).

  Slot ``k``'s row ``s`` is stage ``s``'s leaf; device ``r`` of the stored leaf holds its
  ``r``-th piece along its stage dimension. In round ``o = 1 .. S-1`` every device sends its
  piece of stage ``r + o``'s leaf to that stage (one ``ppermute``, only to stages that hold a
  leaf in the slot), and each stage puts its leaf together from the pieces, its own and the
  ``S - 1`` received: every byte moves once, a stage receives only its own leaves, and none
  moves zeros. (Left to GSPMD, stacking leaves split over ``stage`` into rows over ``stage``
  replicated every such leaf first, XLA's "Involuntary full rematerialization".) A leaf not
  split over ``stage`` is whole on every device: its row is selected, nothing moves.
  ``gradients`` is the transpose (a leaf held by several stages gets their sum)."""
  mesh: Any
  avals: tuple[Any, ...]
  members: tuple[tuple[int, ...], ...]   # per stage, its leaves (in its layout's order)
  layouts: tuple[SlotLayout, ...]        # per stage, its leaves' slots
  dims: tuple[int | None, ...]           # per leaf, the dimension split over ``stage``

  def holders(self) -> dict[str, dict[int, int]]:
    """Slot -> {stage: the leaf it holds there}."""
    out: dict[str, dict[int, int]] = {k: {} for k, _ in self.layouts[0].types}
    for s, (idx, layout) in enumerate(zip(self.members, self.layouts)):
      for i, k in zip(idx, layout.keys):
        out[k][s] = i
    return out

  def slot_dim(self, held: Mapping[int, int]) -> int | None:
    dims = {self.dims[i] for i in held.values()}
    if len(dims) > 1:   # internal invariant: one slot type, one stored spec (add_axis)
      raise AssertionError(f"leaves of one slot stored split on dimensions {dims}")
    return dims.pop() if dims else None

  def pack(self, leaves: Sequence[Any]) -> dict[str, jax.Array]:
    """The stored leaves -> ``{slot: (S, *shape)}`` over ``stage``."""
    n, types = self.mesh.shape[STAGE], dict(self.layouts[0].types)

    def local(*mine):
      r = lax.axis_index(STAGE)
      out = {}
      for k, held in self.holders().items():
        t, d = types[k], self.slot_dim(held)
        piece = _piece_shape(t.shape, d, n)
        rows = jnp.stack([mine[held[s]].astype(t.dtype) if s in held
                          else jnp.zeros(piece, t.dtype) for s in range(n)])
        if d is None:   # whole on every device: this stage's row
          out[k] = lax.dynamic_index_in_dim(rows, r, keepdims=True)
          continue
        got = [rows[r]] + [_shift(lax.dynamic_index_in_dim(rows, (r + o) % n, keepdims=False),
                                  o, held, n) for o in range(1, n)]   # from r - o
        by_source = jnp.stack(got)[(r - jnp.arange(n)) % n]   # [j]: piece j of my leaf
        out[k] = jnp.concatenate(list(by_source), axis=d)[None]
      return out

    return jax.shard_map(local, mesh=self.mesh, in_specs=tuple(map(_stage_spec, self.dims)),
                         out_specs=P(STAGE), axis_names=frozenset({STAGE}),
                         check_vma=False)(*leaves)

  def gradients(self, packed: Mapping[str, jax.Array]) -> list[Any]:
    """``{slot: (S, *shape)}`` gradients -> per stored leaf, the sum over the stages that hold
    it, in its stored layout (zeros for a leaf no stage holds)."""
    n = self.mesh.shape[STAGE]

    def local(bufs):
      r = lax.axis_index(STAGE)
      sums: list[Any] = [None] * len(self.avals)

      def add(i, x):
        sums[i] = x if sums[i] is None else sums[i] + x

      for k, held in self.holders().items():
        g, d = bufs[k][0], self.slot_dim(held)
        if d is None:   # whole on every stage: the holders' sum
          for s, i in held.items():
            add(i, lax.psum(jnp.where(r == s, g, jnp.zeros_like(g)), STAGE))
          continue
        pieces = jnp.stack(jnp.split(g, n, axis=d))
        # Round o: each holder sends piece s - o of its gradient to device s - o.
        got = jnp.stack([pieces[r]] + [_shift(
            lax.dynamic_index_in_dim(pieces, (r - o) % n, keepdims=False), -o,
            {(s - o) % n: i for s, i in held.items()}, n, sources=set(held)) for o in
            range(1, n)])   # [o]: piece r of stage r + o's gradient
        for s, i in held.items():
          add(i, got[(s - r) % n])
      return tuple(jnp.zeros(_piece_shape(a.shape, d, n), a.dtype) if x is None
                   else x.astype(a.dtype) for x, a, d in zip(sums, self.avals, self.dims))

    return list(jax.shard_map(local, mesh=self.mesh, in_specs=(P(STAGE),),
                              out_specs=tuple(map(_stage_spec, self.dims)),
                              axis_names=frozenset({STAGE}), check_vma=False)(dict(packed)))


def _shift(x: jax.Array, o: int, targets: Mapping[int, Any], n: int,
           sources: set[int] | None = None) -> jax.Array:
  """``x`` of device ``j`` to device ``j + o`` (mod ``n``) over ``stage``, for the targets
  in ``targets`` (and sources in ``sources``) only; zeros elsewhere."""
  pairs = [(j, (j + o) % n) for j in range(n) if (j + o) % n in targets
           and (sources is None or j in sources)]
  return lax.ppermute(x, STAGE, pairs) if pairs else jnp.zeros_like(x)


def _piece_shape(shape: tuple[int, ...], dim: int | None, n: int) -> tuple[int, ...]:
  return tuple(shape) if dim is None else (*shape[:dim], shape[dim] // n, *shape[dim + 1:])


def _stage_spec(dim: int | None) -> P:
  return P(*([None] * dim), STAGE) if dim is not None else P()
