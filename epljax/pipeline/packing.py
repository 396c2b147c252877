"""Buffers: a stage's values (parameters, activations, residuals, model state) in one buffer
type shared by every stage.

Stages differ in their values, but an SPMD program needs one type for all of them. A
``Layout`` says where each of a stage's values sits in a dict of buffers, and ``pack`` /
``unpack`` / ``accumulate`` are its only ways in and out; the buffer type (``types``) is the
same for every stage:

- flat ``{dtype: size}``: a stage's values of a dtype side by side in one 1-D buffer padded to
  the largest stage (activations, residuals, packed parameters). Packing is a concatenation and
  unpacking slices, so a gradient taken with respect to the unpacked values is packed again
  without the ``O(values x size)`` cost of differentiating through the slices. An exchanged
  parameter (``storage.py``) is ``pieces`` rows of such a buffer, one piece of it per row;
- whole ``{key: SlotType}``: a value kept as the array it is, with its ``model`` split, in a
  *slot* (``assign``: stages share the slots of a type), or a stacked leaf's chunk (a *part*).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SlotType:
  """A whole array of a buffer (a slot, or a stacked leaf's chunk, ``storage.py``)."""
  shape: tuple[int, ...]
  dtype: str
  spec: tuple[Any, ...]     # the leaf's PartitionSpec entries (model axis), without ``stage``

  @staticmethod
  def of(aval: Any, spec: tuple[Any, ...] = ()) -> SlotType:
    return SlotType(tuple(aval.shape), dtype_name(aval.dtype),
                    tuple(spec) + (None,) * (len(aval.shape) - len(spec)))

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * jnp.dtype(self.dtype).itemsize

  def zeros(self, lead: tuple[int, ...] = ()) -> jax.Array:
    return jnp.zeros((*lead, *self.shape), self.dtype)


@dataclasses.dataclass(frozen=True)
class Stacks:
  """A rolled stage's stacks (``rows`` of its values, one block's leaf per row), decided once
  for its layout (``Layout.stacks_of``): which sit side by side (``side``: one slice each), and
  which values the stage's program also reads itself (``direct``)."""
  rows: tuple[tuple[int, ...], ...] = ()
  side: tuple[bool, ...] = ()
  direct: frozenset[int] = frozenset()


Types = Mapping[str, int | SlotType]   # a buffer type: flat {dtype: size}, whole {key: SlotType}


@dataclasses.dataclass(frozen=True)
class Entry:
  """Where one value sits: buffer ``key`` whole (``offset`` None), or ``size`` elements of its
  dtype's flat buffer from ``offset`` (in each of the layout's ``pieces`` rows: the dimension
  ``dim`` split, or slices of the flat values when None)."""
  key: str
  dtype: str
  shape: tuple[int, ...]
  offset: int | None
  size: int
  dim: int | None = None


@dataclasses.dataclass(frozen=True)
class Layout:
  """A stage's values in a dict of buffers (see the module doc); ``pieces``: rows of its flat
  buffers, each holding one piece of every flat value."""
  entries: tuple[Entry, ...]
  pieces: int = 1

  @staticmethod
  def of(avals: Sequence[Any], pieces: int = 1, dims: Sequence[int | None] | None = None,
         order: Sequence[int] | None = None) -> Layout:
    """Flat: values side by side in their dtypes' buffers, each in ``pieces`` pieces (split on
    its dimension ``dims[i]``, or slices of its flat values), placed in ``order`` (default:
    as given; the entries stay in the values' order)."""
    dims = dims or [None] * len(avals)
    at: dict[str, int] = {}
    entries: dict[int, Entry] = {}
    for i in range(len(avals)) if order is None else order:
      a = avals[i]
      name, size = dtype_name(a.dtype), -(-math.prod(a.shape) // pieces)
      entries[i] = Entry(name, name, tuple(a.shape), at.get(name, 0), size, dims[i])
      at[name] = at.get(name, 0) + size
    if sorted(entries) != list(range(len(avals))):   # internal invariant
      raise AssertionError(f"placement order {order} is not a permutation of {len(avals)} values")
    return Layout(tuple(entries[i] for i in range(len(avals))), pieces)

  def whole(self, keys: Sequence[str], types: Mapping[str, SlotType]) -> Layout:
    """This layout, then values kept whole in buffers ``keys``."""
    return dataclasses.replace(self, entries=self.entries + tuple(
        Entry(k, types[k].dtype, types[k].shape, None, math.prod(types[k].shape)) for k in keys))

  @property
  def sizes(self) -> dict[str, int]:
    """Elements per row of each flat buffer (before padding)."""
    out: dict[str, int] = {}
    for e in self.entries:
      if e.offset is not None:
        out[e.key] = max(out.get(e.key, 0), e.offset + e.size)
    return out

  @property
  def nbytes(self) -> int:
    """Bytes of the values."""
    return sum(math.prod(e.shape) * jnp.dtype(e.dtype).itemsize for e in self.entries)

  def pack(self, values: Sequence[Any], types: Types, *, skip_missing: bool = False,
           stacks: Sequence[tuple[Sequence[int], Any]] = ()) -> dict[str, jax.Array]:
    """Values -> every buffer of ``types``: a flat one its values' pieces side by side then
    zeros, a whole one its value, or zeros where this stage has none.

    With ``skip_missing`` values whose buffer is not in ``types`` are left out (the integer
    activations of a gradient payload, whose cotangents are ``float0``). ``stacks``: (rows,
    stacked value) of values that sit side by side (``side_by_side``), packed as one piece;
    their own entries in ``values`` are None.
    """
    flat: dict[str, list[tuple[int, jax.Array]]] = {k: [] for k, t in types.items()
                                                    if not isinstance(t, SlotType)}
    out = {}
    for e, v in zip(self.entries, values, strict=True):
      if v is None or (skip_missing and e.key not in types):
        continue
      if e.offset is None:
        out[e.key] = jnp.asarray(v, types[e.key].dtype)
      else:
        flat[e.key].append((e.offset, self._pieces(v, e)))
    for rows, v in stacks:
      e = self.entries[rows[0]]
      flat[e.key].append((e.offset, self._stack_pieces(v, e)))
    lead = (self.pieces,) if self.pieces > 1 else ()
    for k, parts in flat.items():
      placed, at = [], 0
      for offset, p in sorted(parts, key=lambda x: x[0]):   # values left out: zeros
        placed += [jnp.zeros((*lead, offset - at), k)] if offset > at else []
        placed.append(p)
        at = offset + p.shape[-1]
      out[k] = self._fill(placed, types[k], k)
    return {k: out[k] if k in out else t.zeros() for k, t in types.items()}

  def unpack(self, buffers: Mapping[str, jax.Array]) -> list[Any]:
    """Buffers -> values; values of a dtype without a buffer (the integer activations of a
    gradient payload, ``skip_missing``) get ``float0`` zeros, their cotangents."""
    rows = {k: buffers[k].reshape(self.pieces, -1) for k in self.sizes
            if k in buffers and self.pieces > 1}
    out = []
    for e in self.entries:
      if e.offset is None:
        out.append(buffers[e.key])
      elif e.key not in buffers:
        out.append(np.zeros(e.shape, jax.dtypes.float0))
      elif self.pieces == 1:
        out.append(jax.lax.slice(buffers[e.key], (e.offset,), (e.offset + e.size,)
                                 ).reshape(e.shape))
      else:
        out.append(self._whole(jax.lax.slice_in_dim(rows[e.key], e.offset, e.offset + e.size,
                                                    axis=1), e))
    return out

  def stacks_of(self, rows: Sequence[Sequence[int]], direct: frozenset[int] = frozenset()
                ) -> Stacks:
    """A rolled stage's stacks in this layout (see ``Stacks``)."""
    return Stacks(tuple(map(tuple, rows)), tuple(self.side_by_side(r, rows) for r in rows),
                  direct)

  def unpack_stacked(self, buffers: Mapping[str, jax.Array], stacks: Stacks) -> list[Any]:
    """``unpack``, then each stack (a rolled stage's stacked layers): one slice of its buffer
    where its rows sit side by side, else stacked from the values."""
    values = self.unpack(buffers)
    return [*values, *(self._unpack_stack(buffers, rows) if side
                       else jnp.stack([values[i] for i in rows])
                       for rows, side in zip(stacks.rows, stacks.side))]

  def side_by_side(self, rows: Sequence[int], stacks: Sequence[Sequence[int]]) -> bool:
    """Whether values ``rows`` sit side by side in that order in one flat buffer, of one shape
    and split, and in no other stack of ``stacks``: a stack of them is one slice."""
    first = self.entries[rows[0]]
    others = {i for other in stacks if other is not rows for i in other}
    return (first.offset is not None and len(set(rows)) == len(rows)
            and not others & set(rows)
            and all(e.key == first.key and e.shape == first.shape and e.dim == first.dim
                    and e.offset == first.offset + j * first.size
                    for j, e in enumerate(self.entries[i] for i in rows)))

  def uniform(self, rows: Sequence[int]) -> bool:
    """Whether values ``rows`` (a stack's) sit in one flat buffer with one shape and split, so
    that each is one dynamic slice of it (``row``, ``add_row``)."""
    first = self.entries[rows[0]]
    return all(e.offset is not None and (e.key, e.shape, e.dim) == (first.key, first.shape,
                                                                     first.dim)
               for e in (self.entries[i] for i in rows))

  def row(self, buffers: Mapping[str, jax.Array], rows: Sequence[int], l: jax.Array) -> jax.Array:
    """Value ``rows[l]`` (``l`` traced) of ``uniform`` values ``rows``."""
    e, at = self._row(rows, l)
    part = jax.lax.dynamic_slice_in_dim(buffers[e.key].reshape(self.pieces, -1), at, e.size,
                                        axis=1)
    return self._whole(part, e)

  def add_row(self, acc: Mapping[str, jax.Array], rows: Sequence[int], l: jax.Array,
              g: jax.Array) -> dict[str, jax.Array]:
    """``acc`` with ``g`` added to value ``rows[l]`` (``row``'s): one slice updated in place."""
    e, at = self._row(rows, l)
    return {**acc, e.key: self._add_at(acc[e.key], e, at, g)}

  def add_each(self, acc: Mapping[str, jax.Array], values: Sequence[Any]) -> dict[str, jax.Array]:
    """``acc`` with each value that is not None added to its own slice: updates in place,
    for a few values beside a buffer that was just written (``accumulate`` adds the whole
    buffer in one pass)."""
    acc = dict(acc)
    for e, v in zip(self.entries, values, strict=True):
      if v is None:
        continue
      if e.offset is None:
        acc[e.key] = acc[e.key] + jnp.asarray(v, acc[e.key].dtype)
        continue
      acc[e.key] = self._add_at(acc[e.key], e, e.offset, v)
    return acc

  def _add_at(self, buffer: jax.Array, e: Entry, at: Any, value: Any) -> jax.Array:
    """``buffer`` with ``value``'s pieces added at ``at`` in each row: one slice, in place."""
    rows = buffer.reshape(self.pieces, -1)
    part = jax.lax.dynamic_slice_in_dim(rows, at, e.size, axis=1)
    part = part + self._pieces(value, e).reshape(part.shape)
    return jax.lax.dynamic_update_slice_in_dim(rows, part, at, axis=1).reshape(buffer.shape)

  def _row(self, rows: Sequence[int], l: jax.Array) -> tuple[Entry, jax.Array]:
    offsets = np.array([self.entries[i].offset for i in rows], np.int32)
    return self.entries[rows[0]], jnp.asarray(offsets)[l]

  def accumulate(self, acc: Mapping[str, jax.Array], values: Sequence[Any], types: Types,
                 stacks: Stacks = Stacks()) -> dict[str, jax.Array]:
    """``acc + pack(values, types)``, touching only the buffers this stage fills: its
    gradients added into the accumulator where the backward makes them (one elementwise pass
    that XLA:GPU writes into ``acc`` in place, its matmuls accumulating there; no buffer of the
    stage's gradients of its own).

    With ``stacks`` (``unpack_stacked``'s), ``values`` ends with each stack's gradient. One
    whose rows sit side by side is added as one piece, its rows' own gradients joining it only
    for the values in ``stacks.direct`` (read outside the stack too; the others' are zeros);
    any other is added to its rows' gradients."""
    n = len(self.entries)
    own, whole = list(values[:n]), []
    for rows, side, g in zip(stacks.rows, stacks.side, values[n:], strict=True):
      if side:
        for j, i in enumerate(rows):
          if i in stacks.direct:
            g = g.at[j].add(own[i].astype(g.dtype))
          own[i] = None
        whole.append((rows, g))
      else:
        for j, i in enumerate(rows):
          own[i] = own[i] + g[j].astype(own[i].dtype)
    flat = {k: t for k, t in types.items() if not isinstance(t, SlotType)}
    mine = {e.key for e in self.entries if e.offset is None}
    packed = self.pack(own, {**flat, **{k: types[k] for k in mine}}, stacks=whole)
    return {k: acc[k] + packed[k].reshape(acc[k].shape) if k in packed else acc[k] for k in acc}

  def _unpack_stack(self, buffers: Mapping[str, jax.Array], rows: Sequence[int]) -> jax.Array:
    """Side-by-side values ``rows`` -> ``(len(rows), *shape)``: one slice, each row then
    reassembled as ``unpack`` does."""
    e, k = self.entries[rows[0]], len(rows)
    part = jax.lax.slice_in_dim(buffers[e.key].reshape(self.pieces, -1), e.offset,
                                e.offset + k * e.size, axis=1)
    return jax.vmap(lambda p: self._whole(p, e), in_axes=1)(part.reshape(self.pieces, k, e.size))

  def _stack_pieces(self, value: Any, e: Entry) -> jax.Array:
    """``(k, *shape)`` -> its rows' ``_pieces`` side by side: ``(k size,)``, or ``(pieces, k
    size)`` (the transpose of ``_unpack_stack``)."""
    pieces = jax.vmap(lambda v: self._pieces(v, e), out_axes=-2)(value)
    return pieces.reshape(*pieces.shape[:-2], -1)

  def _fill(self, parts: Sequence[jax.Array], size: int, dtype: str) -> jax.Array:
    if self.pieces == 1:
      return fill(parts, size, dtype)
    return fill(parts, size // self.pieces, dtype, (self.pieces,)).reshape(size)

  def _pieces(self, value: Any, e: Entry) -> jax.Array:
    """A value -> its flat ``(size,)``, or its ``(pieces, size)`` pieces (the transpose of
    ``_whole``), of its entry's dtype."""
    n = self.pieces
    if n == 1:
      return jnp.ravel(value).astype(e.dtype)
    value = jnp.asarray(value).astype(e.dtype)
    if e.dim is None:
      flat = jnp.ravel(value)
      return jnp.pad(flat, (0, n * e.size - flat.shape[0])).reshape(n, e.size)
    d = e.dim
    split = value.reshape(*e.shape[:d], n, e.shape[d] // n, *e.shape[d + 1:])
    return jnp.moveaxis(split, d, 0).reshape(n, e.size)

  @staticmethod
  def _whole(pieces: jax.Array, e: Entry) -> jax.Array:
    """``(pieces, size)`` -> the value."""
    n = pieces.shape[0]
    if e.dim is None:
      return pieces.reshape(-1)[:math.prod(e.shape)].reshape(e.shape)
    shards = pieces.reshape(n, *piece_shape(e.shape, e.dim, n))
    return jnp.moveaxis(shards, 0, e.dim).reshape(e.shape)


def assign(stage_leaves: Sequence[Sequence[SlotType]]) -> tuple[list[Layout], dict[str, SlotType]]:
  """Per stage, its values' types -> its ``Layout`` over shared slots (a value takes the first
  slot of its type that its stage does not use yet), and the slots' types."""
  types: dict[str, SlotType] = {}
  keys_of: list[list[str]] = []
  for leaves in stage_leaves:
    keys: list[str] = []
    for t in leaves:
      key = next((k for k, u in types.items() if u == t and k not in keys), None)
      if key is None:
        key = f"slot{len(types)}"
        types[key] = t
      keys.append(key)
    keys_of.append(keys)
  return [Layout(()).whole(keys, types) for keys in keys_of], types


def piece_shape(shape: tuple[int, ...], dim: int | None, n: int) -> tuple[int, ...]:
  """One of ``n`` pieces of ``shape`` split on ``dim`` (None: not split)."""
  return tuple(shape) if dim is None else (*shape[:dim], shape[dim] // n, *shape[dim + 1:])


def fill(parts: Sequence[jax.Array], size: int, dtype: str, lead: tuple[int, ...] = ()
         ) -> jax.Array:
  """``(*lead, n_k)`` parts side by side on their last axis, zeros after them up to ``size``."""
  used = sum(p.shape[-1] for p in parts)
  parts = [*parts, jnp.zeros((*lead, size - used), dtype)] if used < size or not parts else parts
  return jnp.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]


def dtype_name(dtype: Any) -> str:
  return jnp.dtype(dtype).name


def padded_sizes(layouts: Sequence[Layout], *, inexact_only: bool = False) -> dict[str, int]:
  """Per dtype, the largest size any layout needs (the common buffer type)."""
  out: dict[str, int] = {}
  for layout in layouts:
    for name, size in layout.sizes.items():
      if inexact_only and not jnp.issubdtype(name, jnp.inexact):
        continue
      out[name] = max(out.get(name, 0), size)
  return dict(sorted(out.items()))


def zeros(sizes: Types, lead: tuple[int, ...] = ()) -> dict[str, jax.Array]:
  """Zero buffers of a buffer type, ``lead`` in front."""
  return {k: t.zeros(lead) if isinstance(t, SlotType) else jnp.zeros((*lead, t), k)
          for k, t in sizes.items()}


def nbytes(sizes: Types) -> int:
  """Bytes of buffers of a buffer type."""
  return sum(t.nbytes if isinstance(t, SlotType) else t * jnp.dtype(k).itemsize
             for k, t in sizes.items())
