"""Slots: a pipeline's parameters and model state as whole arrays, one row per stage.

Packed buffers flatten a stage's parameters, which loses a ``model`` sharding: a
tensor-parallel stage needs each parameter whole, with its split. There stage parameters of
the same (shape, dtype, spec) share a *slot* (``packing.assign``): one ``(S, *shape)`` array
sharded ``P(stage, *spec)`` whose row ``s`` holds stage ``s``'s leaf (zeros where stage ``s``
has none). Identical stages fill the same slots, so a device holds about ``1/S`` of the
parameters, as with packing; stages that differ hold the union of their slot types.
``exchange`` / ``exchange_gradients`` move the stored leaves there and back (the parameter
store's way for tensor-parallel stages, ``storage.ParamStore``). Model state (BatchNorm
statistics, NNX RNG streams) rides in slots too (``stack`` / ``unstack``), whatever the
parameters use; PRNG keys as their raw key data (``as_data`` / ``as_key``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from epljax.mesh import STAGE
from epljax.pipeline.packing import Layout, SlotType, piece_shape


def stack(leaves: Sequence[Any], members: Sequence[Sequence[int]], layouts: Sequence[Layout],
          types: Mapping[str, SlotType]) -> dict[str, jax.Array]:
  """The user's leaves -> ``{slot: (S, *shape)}``; ``members[s]``: stage ``s``'s leaf indices
  (in its layout's order)."""
  rows = [layout.pack([leaves[i] for i in idx], types) for idx, layout in zip(members, layouts)]
  return {k: jnp.stack([r[k] for r in rows]) for k in types}


def unstack(stacked: Mapping[str, jax.Array], members: Sequence[Sequence[int]],
            layouts: Sequence[Layout], avals: Sequence[Any],
            missing: Sequence[Any] | None = None) -> list[Any]:
  """``{slot: (S, *shape)}`` -> the user's leaves: a leaf held by several stages gets the sum
  of its rows (the transpose of ``stack``); one no stage holds, zeros (or its value in
  ``missing``)."""
  leaves: list[Any] = [None] * len(avals)
  for s, (idx, layout) in enumerate(zip(members, layouts)):
    for i, k in zip(idx, (e.key for e in layout.entries)):
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


def _holders(layouts: Sequence[Layout], members: Sequence[Sequence[int]]
            ) -> dict[str, dict[int, int]]:
  """Slot -> {stage: the leaf it holds there}, for the stages' leaves ``members`` (the first
  entries of their ``layouts``)."""
  out: dict[str, dict[int, int]] = {}
  for s, (idx, layout) in enumerate(zip(members, layouts)):
    for i, e in zip(idx, layout.entries):
      out.setdefault(e.key, {})[s] = i
  return out


def _slot_dim(held: Mapping[int, int], dims: Sequence[int | None]) -> int | None:
  found = {dims[i] for i in held.values()}
  if len(found) > 1:   # internal invariant: one slot type, one stored spec (storage.add_axis)
    raise AssertionError(f"leaves of one slot stored split on dimensions {found}")
  return found.pop() if found else None


def exchange(leaves: Sequence[Any], layouts: Sequence[Layout], members: Sequence[Sequence[int]],
             dims: Sequence[int | None], types: Mapping[str, SlotType],
             mesh: Mesh) -> dict[str, jax.Array]:
  """The stored leaves (each split over ``stage`` on its dimension ``dims[i]``, or not split)
  -> ``{slot: (S, *shape)}`` over ``stage``, written out per device in a ``shard_map`` over
  ``stage`` (``model`` and ``data`` left to GSPMD, so each piece keeps its split).

  Slot ``k``'s row ``s`` is stage ``s``'s leaf; device ``r`` of the stored leaf holds its
  ``r``-th piece along its stage dimension. In round ``o = 1 .. S-1`` every device sends its
  piece of stage ``r + o``'s leaf to that stage (one ``ppermute``, only to stages that hold a
  leaf in the slot), and each stage puts its leaf together from the pieces, its own and the
  ``S - 1`` received: every byte moves once, a stage receives only its own leaves, and none
  moves zeros. (Left to GSPMD, stacking leaves split over ``stage`` into rows over ``stage``
  replicated every such leaf first, XLA's "Involuntary full rematerialization".) A leaf not
  split over ``stage`` is whole on every device: its row is selected, nothing moves."""
  n = mesh.shape[STAGE]

  def local(*mine):
    r = lax.axis_index(STAGE)
    out = {}
    for k, held in _holders(layouts, members).items():
      t, d = types[k], _slot_dim(held, dims)
      piece = piece_shape(t.shape, d, n)
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

  return jax.shard_map(local, mesh=mesh, in_specs=tuple(map(stage_spec, dims)),
                       out_specs=P(STAGE), axis_names=frozenset({STAGE}),
                       check_vma=False)(*leaves)


def exchange_gradients(packed: Mapping[str, jax.Array], layouts: Sequence[Layout],
                       members: Sequence[Sequence[int]], dims: Sequence[int | None],
                       avals: Sequence[Any], mesh: Mesh) -> list[Any]:
  """The transpose of ``exchange``: ``{slot: (S, *shape)}`` gradients -> per stored leaf, the
  sum over the stages that hold it, in its stored layout (zeros for a leaf no stage holds)."""
  n = mesh.shape[STAGE]

  def local(bufs):
    r = lax.axis_index(STAGE)
    sums: list[Any] = [None] * len(avals)

    def add(i, x):
      sums[i] = x if sums[i] is None else sums[i] + x

    for k, held in _holders(layouts, members).items():
      g, d = bufs[k][0], _slot_dim(held, dims)
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
    return tuple(jnp.zeros(piece_shape(a.shape, d, n), a.dtype) if x is None
                 else x.astype(a.dtype) for x, a, d in zip(sums, avals, dims))

  return list(jax.shard_map(local, mesh=mesh, in_specs=(P(STAGE),),
                            out_specs=tuple(map(stage_spec, dims)),
                            axis_names=frozenset({STAGE}), check_vma=False)(dict(packed)))


def tied_rows(bufs: Mapping[str, jax.Array], layouts: Sequence[Layout],
              members: Sequence[Sequence[int]], tied: Sequence[int], mesh: Mesh,
              mode: str) -> dict[str, jax.Array]:
  """``{slot: (S, *shape)}`` with the rows of each ``tied`` leaf (a leaf several stages read,
  held in each of their rows) set by ``mode``; its *owner* is the first stage that reads it:

  - ``"own"``: every row but the owner's zeroed (the train state holds the leaf once, so the
    optimizer and a global norm see it once);
  - ``"fill"``: the owner's row copied to the others (the loop's buffers, before it runs);
  - ``"sum"``: the rows' sum in the owner's row, zeros in the others (their gradients).

  One ``psum`` over ``stage`` per tied leaf (none for ``"own"``)."""
  bufs = dict(bufs)
  if not tied:
    return bufs
  held = _holders(layouts, members)
  copies = {i: {s: k for k, by_stage in held.items() for s, j in by_stage.items() if j == i}
            for i in tied}

  def local(mine):
    r = lax.axis_index(STAGE)
    mine = dict(mine)
    for at in copies.values():
      owner = min(at)
      if mode == "own":
        total = None
      else:
        rows = [s for s in at if mode == "sum" or s == owner]
        total = lax.psum(sum(jnp.where(r == s, mine[at[s]][0], jnp.zeros_like(mine[at[s]][0]))
                             for s in rows), STAGE)
      for s, k in at.items():
        keep = total if (mode == "fill" or s == owner) and total is not None else None
        if mode == "own" and s == owner:
          continue
        value = jnp.zeros_like(mine[k]) if keep is None else keep[None].astype(mine[k].dtype)
        mine[k] = jnp.where(r == s, value, mine[k])
    return mine

  return jax.shard_map(local, mesh=mesh, in_specs=(P(STAGE),), out_specs=P(STAGE),
                       axis_names=frozenset({STAGE}), check_vma=False)(bufs)


def stage_spec(dim: int | None) -> P:
  """A stored leaf's spec inside a ``shard_map`` over ``stage``: split on ``dim``, or whole."""
  return P(*([None] * dim), STAGE) if dim is not None else P()


def _shift(x: jax.Array, o: int, targets: Mapping[int, Any], n: int,
           sources: set[int] | None = None) -> jax.Array:
  """``x`` of device ``j`` to device ``j + o`` (mod ``n``) over ``stage``, for the targets
  in ``targets`` (and sources in ``sources``) only; zeros elsewhere."""
  pairs = [(j, (j + o) % n) for j in range(n) if (j + o) % n in targets
           and (sources is None or j in sources)]
  return lax.ppermute(x, STAGE, pairs) if pairs else jnp.zeros_like(x)
