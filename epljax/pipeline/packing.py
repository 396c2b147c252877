"""Flat buffers: a list of arrays of any shapes as one 1-D buffer per dtype.

Stages differ in their parameters, activations and stashed residuals, but an SPMD program
needs one type for all of them: each stage's values are packed into ``{dtype: (size,)}``
buffers padded to the largest stage, so one ``(num_stages, size)`` array sharded over the
``stage`` axis holds every stage's parameters, and one buffer type crosses every stage
boundary. Packing is a concatenation (unpacking slices), so a gradient taken with respect to
the unpacked values is packed again without the ``O(leaves x size)`` cost of differentiating
through the slices.
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
  """A whole array of a buffer (a slot, ``slots.py``; a stacked leaf's chunk, ``storage.py``)."""
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
class Entry:
  dtype: str
  shape: tuple[int, ...]
  offset: int

  @property
  def size(self) -> int:
    return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where each value sits in its dtype's buffer, and the buffer sizes (before padding)."""
  entries: tuple[Entry, ...]
  sizes: Mapping[str, int]

  @staticmethod
  def of(avals: Sequence[Any]) -> Layout:
    sizes: dict[str, int] = {}
    entries = []
    for a in avals:
      name = dtype_name(a.dtype)
      entries.append(Entry(name, tuple(a.shape), sizes.get(name, 0)))
      sizes[name] = sizes.get(name, 0) + math.prod(a.shape)
    return Layout(tuple(entries), sizes)

  def pack(self, values: Sequence[Any], padded: Mapping[str, int], *,
           skip_missing: bool = False) -> dict[str, jax.Array]:
    """Values -> ``{dtype: (padded[dtype],)}``; every dtype of ``padded`` is present.

    With ``skip_missing`` values whose dtype has no buffer are left out (the integer
    activations of a gradient payload, whose cotangents are ``float0``).
    """
    parts: dict[str, list[jax.Array]] = {name: [] for name in padded}
    for entry, v in zip(self.entries, values, strict=True):
      if skip_missing and entry.dtype not in padded:
        continue
      parts[entry.dtype].append(jnp.ravel(v).astype(entry.dtype))
    return {name: fill(parts[name], size, name) for name, size in padded.items()}

  def unpack(self, buffers: Mapping[str, jax.Array]) -> list[Any]:
    """Buffers -> values; values of a dtype without a buffer (the integer activations of a
    gradient payload, ``skip_missing``) get ``float0`` zeros, their cotangents."""
    return [jax.lax.slice(buffers[e.dtype], (e.offset,), (e.offset + e.size,)).reshape(e.shape)
            if e.dtype in buffers else np.zeros(e.shape, jax.dtypes.float0)
            for e in self.entries]


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


def zeros(sizes: Mapping[str, int | SlotType], lead: tuple[int, ...] = ()) -> dict[str, jax.Array]:
  """Zero buffers of packed sizes (``{dtype: size}``) or slot types, ``lead`` in front."""
  return {k: t.zeros(lead) if isinstance(t, SlotType) else jnp.zeros((*lead, t), k)
          for k, t in sizes.items()}


def nbytes(sizes: Mapping[str, int | SlotType]) -> int:
  """Bytes of buffers of packed sizes or slot types."""
  return sum(t.nbytes if isinstance(t, SlotType) else t * jnp.dtype(k).itemsize
             for k, t in sizes.items())
