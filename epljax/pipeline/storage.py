"""The stored parameters (the user's leaves, each also sharded over ``stage``) and the loop's
packed per-stage buffers: ``pack`` copies a leaf into every stage that reads it, ``unpack``
(with ``total``) is its transpose, summing a tied leaf's gradients."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P


def pack(leaves, stages, layouts, sizes) -> dict[str, jax.Array]:
  rows = [layout.pack([leaves[i] for i in s.params], sizes) for s, layout in zip(stages, layouts)]
  return {k: jnp.stack([r[k] for r in rows]) for k in sizes}


def unpack(packed, stages, layouts, avals, *, total: bool) -> list[Any]:
  """Row ``r`` of ``packed`` holds ``stages[r]`` (in row order: with virtual stages a device's
  chunks are consecutive rows, ``Pipeline.rows``)."""
  leaves: list[Any] = [None] * len(avals)
  for row, (s, layout) in enumerate(zip(stages, layouts)):
    for i, value in zip(s.params, layout.unpack({k: v[row] for k, v in packed.items()})):
      if leaves[i] is None:
        leaves[i] = value
      elif total:
        leaves[i] = leaves[i] + value
  # A leaf no stage holds (a parameter the loss never reads) has a zero gradient.
  return [jnp.zeros(a.shape, a.dtype) if x is None else x for x, a in zip(leaves, avals)]


def axis_size(mesh, entry) -> int:
  names = entry if isinstance(entry, tuple) else (entry,)
  return int(np.prod([mesh.shape[n] for n in names]))


def add_axis(spec: P, shape: tuple[int, ...], axis: str, size: int) -> P | None:
  """``spec`` with ``axis`` on the largest free dimension ``size`` divides, or None."""
  entries = list(spec) + [None] * (len(shape) - len(spec))
  free = [d for d, e in enumerate(entries) if e is None and shape[d] % size == 0
          and shape[d] >= size]
  if size == 1 or not free:
    return None
  dim = max(free, key=lambda d: (shape[d], -d))
  entries[dim] = axis
  return P(*entries)
