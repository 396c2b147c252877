"""The parameter store (``ParamStore``, made by ``make_store``): the stored parameters (the
user's leaves, each also sharded over ``stage``) <-> the loop's per-stage buffers.

A leaf is stored in ``S`` pieces, one per stage device (its shard on the dimension ``stage``
splits, or a ``1/S`` slice of its flattened values when no dimension divides). The loop needs
each stage's leaves whole on that stage's devices. ``exchange`` moves them there with one
``all_to_all`` per dtype over ``stage``: device ``r`` sends every stage its ``r``-th piece of
each leaf that stage reads, so every byte moves once and a device never holds more than its own
stage's parameters. A stage's buffer is its pieces as they arrive, ``(S, slot)`` per dtype
(piece ``r`` of every leaf in source ``r``'s slot, a ``packing.Layout`` of ``S`` pieces), and
its ``unpack`` reassembles the leaves inside the stage. ``exchange_gradients`` is the
transpose: one ``all_to_all`` back, and a leaf read by several stages (tied embeddings) gets
the sum of their gradients. Both are a fixed number of collectives and a few static slices per
leaf, however deep the model.
(Tensor-parallel stages keep whole leaves in slots instead, ``slotted``: ``slots.py``.)

A stacked leaf whose stage ``s`` reads only its ``s``-th row chunk (scanned layers split per
stage, ``chunks.py``) is stored split over ``stage`` on its rows, so each stage device already
holds its chunk: it skips the exchange and rides beside the buffers as ``{"part<j>": (S, rows,
...)}`` (its own slot in tensor-parallel stages), a free reshape of the stored leaf, its
gradient likewise. Interleaved (``v`` chunks per stage) stage ``s`` stores chunks
``s v ...`` but runs ``s, s + S, ...``: ``interleave`` moves them there with ``ppermute``, and
``deinterleave`` their gradients back.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from epljax.errors import PlanError
from epljax.mesh import DATA, MODEL, STAGE
from epljax.pipeline import packing, slots
from epljax.pipeline.packing import SlotType
from epljax.pipeline.partition import Stage


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


@dataclasses.dataclass(frozen=True, eq=False)
class ParamStore:
  """The user's parameter leaves as stored (``shardings``: each also split over ``stage``) <->
  the loop's parameter buffers (``buffers``: their type; ``layouts``: per chunk, where its
  parameters sit, its exchanged leaves then its parts, ``packing.Layout``). Exchanged leaves
  are flat pieces moved by ``exchange`` (one ``all_to_all`` per dtype), or whole arrays in
  slots moved by ``slots.exchange`` (``slotted``: tensor-parallel stages, which keep their
  ``model`` split); the stacked leaves' chunks (``parts``) ride beside them (see the module
  doc)."""
  mesh: Mesh
  avals: tuple[Any, ...]                  # the user's leaves
  specs: tuple[P, ...]                    # their specs without ``stage``
  shardings: tuple[NamedSharding, ...]    # as stored
  members: tuple[tuple[int, ...], ...]    # per chunk (in row order), its exchanged leaves
  parts: Mapping[int, int]                # part index (after the leaves) -> its stacked leaf
  part_types: Mapping[str, SlotType]      # part key -> one chunk of its leaf
  layouts: tuple[packing.Layout, ...]     # per chunk
  buffers: packing.Types                  # {dtype: S slot} (packed) or {slot: SlotType}, parts
  virtual: int
  slotted: bool
  split_model: bool                       # tensor-parallel stages: ``model`` left to GSPMD

  @property
  def data_axes(self) -> tuple[str, ...]:
    """The loop's data axes (manual, with ``stage``); tensor-parallel stages leave ``model``
    to GSPMD."""
    return (DATA,) if self.split_model else (DATA, MODEL)

  @property
  def inside(self) -> str:
    """How the parameters are held inside the step, for the plan."""
    if not self.slotted:
      return "packed for the largest stage inside the step"
    return ("in slots (whole arrays, split over model) inside the step" if self.split_model
            else "in slots (whole arrays) inside the step")

  @property
  def dims(self) -> tuple[int | None, ...]:
    """Per leaf, the dimension stored split over ``stage``."""
    return tuple(stage_dim(sh.spec) for sh in self.shardings)

  def pack(self, leaves: Sequence[Any], dtype: Any = None) -> dict[str, jax.Array]:
    """The stored leaves -> the loop's ``(S v, ...)`` buffers (traceable), sharded as the loop
    reads them; slotted, in ``dtype`` instead of the leaves' own (an optimizer's moments in
    theirs)."""
    parts = {part_key(v - len(leaves)): interleave(leaves[i], self.virtual, self.mesh)
             for v, i in self.parts.items()}
    if self.slotted:
      types = self.buffers if dtype is None else {
          k: dataclasses.replace(t, dtype=packing.dtype_name(dtype))
          for k, t in self.buffers.items()}
      moved = slots.exchange(leaves, self.layouts, self.members, self.dims, types, self.mesh)
      return {k: lax.with_sharding_constraint(v, NamedSharding(
          self.mesh, P(STAGE, *self.buffers[k].spec))) for k, v in {**moved, **parts}.items()}
    stage = NamedSharding(self.mesh, P(STAGE))
    return {**exchange(leaves, self._by_row(self.layouts), self._by_row(self.members),
                       self.dims, self._slot_sizes(), self.mesh),
            **{k: lax.with_sharding_constraint(v, stage) for k, v in parts.items()}}

  def gradients_of(self, packed: Mapping[str, jax.Array]) -> list[Any]:
    """The buffers' gradients -> per stored leaf, the sum over the stages that read it (the
    transpose of ``pack``)."""
    keys = {part_key(v - len(self.avals)): i for v, i in self.parts.items()}
    moved = {k: g for k, g in packed.items() if k not in keys}
    if self.slotted:
      leaves = slots.exchange_gradients(moved, self.layouts, self.members, self.dims,
                                        self.avals, self.mesh)
    else:
      leaves = list(exchange_gradients(moved, self._by_row(self.layouts),
                                       self._by_row(self.members), self.dims,
                                       self._slot_sizes(), self.avals, self.mesh))
    for k, i in keys.items():
      leaves[i] = deinterleave(packed[k], tuple(self.avals[i].shape), self.mesh)
    return leaves

  @functools.cached_property
  def homes(self) -> dict[int, tuple[str, int]]:
    """Slotted: each exchanged leaf's slot and row in the first stage that holds it (a leaf
    several stages read, tied, is held there alone: ``slots.tied_rows``)."""
    out: dict[int, tuple[str, int]] = {}
    for row, (member, layout) in enumerate(zip(self.members, self.layouts)):
      for i, e in zip(member, layout.entries):
        out.setdefault(i, (e.key, row))
    return out

  def unpack(self, buffers: Mapping[str, jax.Array]) -> list[Any]:
    """Slots -> the user's leaves, each from its home (``homes``) (traceable; every leaf is
    held by a stage: ``Pipeline.check_stage_layout``)."""
    if not self.slotted:   # internal invariant: only slots hold whole leaves
      raise AssertionError("ParamStore.unpack of packed buffers")
    n = len(self.avals)
    leaves: list[Any] = [None] * n
    for i, (key, row) in self.homes.items():
      leaves[i] = buffers[key][row]
    for v, i in self.parts.items():
      leaves[i] = deinterleave(buffers[part_key(v - n)], tuple(self.avals[i].shape), self.mesh)
    return leaves

  def split_of(self, spec: Sequence[Any]) -> int:
    """Devices a spec splits over."""
    return math.prod(axis_size(self.mesh, e) for e in spec if e is not None)

  def part_bytes(self) -> int:
    """A stage's chunks of stacked leaves per device (``v`` chunks with virtual stages)."""
    return self.virtual * sum(t.nbytes // self.split_of(t.spec)
                              for t in self.part_types.values())

  def bytes_inside(self) -> int:
    """One stage's parameters per device inside the step."""
    if self.slotted:
      return sum(t.nbytes // self.split_of(t.spec) for t in self.buffers.values())
    return packing.nbytes({k: n for k, n in self.buffers.items() if k not in self.part_types}
                          ) + self.part_bytes()

  def stash(self, layouts: list[packing.Layout]) -> tuple[list[packing.Layout], packing.Types]:
    """The branches' residuals (flat layouts) -> their layouts in the stash, and its type:
    flat buffers padded to the largest; tensor-parallel stages, whole residuals in slots, which
    keep GSPMD's ``model`` split (a flat buffer would gather them), shared by the branches like
    their parameters."""
    if not self.split_model:
      return layouts, packing.padded_sizes(layouts)
    return packing.assign([[SlotType(e.shape, e.dtype, (None,) * len(e.shape))
                            for e in lay.entries] for lay in layouts])

  def _slot_sizes(self) -> dict[str, int]:
    """Flat buffers: per dtype, the slot every stage device sends each stage."""
    n = self.mesh.shape[STAGE]
    return {k: t // n for k, t in self.buffers.items() if not isinstance(t, SlotType)}

  def _by_row(self, per_chunk: Sequence[Any]) -> list[Any]:
    """Per chunk -> per buffer row (stage ``s`` holds chunks ``s, s + S, ...`` as its ``v``
    consecutive rows)."""
    n = self.mesh.shape[STAGE]
    return [per_chunk[s + j * n] for s in range(n) for j in range(self.virtual)]


def make_store(stages: Sequence[Stage], avals: Sequence[Any], specs: Sequence[P],
               paths: Sequence[str], mesh: Mesh, split: Sequence[int],
               virtual: int, in_slots: bool = False) -> ParamStore:
  """Where each parameter leaf is stored (its spec with ``stage`` added; a stacked leaf read
  in row chunks: its rows over ``stage``) and how the loop's buffers hold it: packed, or in
  slots when a stage is tensor-parallel or ``in_slots`` (``pipeline.param_layout='stage'``)."""
  size, n = mesh.shape[STAGE], len(avals)
  parts = dict(sorted({v: i for s in stages for v, i in s.parts}.items()))
  if list(parts) != list(range(n, n + len(parts))):  # internal invariant
    raise AssertionError(f"pipeline parts are not numbered after the leaves: {parts}")
  shardings = tuple(NamedSharding(mesh, _rows_over_stage(spec, paths[i], avals[i])
                                  if i in parts.values() else
                                  add_axis(spec, tuple(a.shape), STAGE, size) or spec)
                    for i, (spec, a) in enumerate(zip(specs, avals)))
  members = tuple(tuple(i for i in s.params if i not in parts) for s in stages)
  part_keys = [tuple(part_key(v - n) for v, _ in s.parts) for s in stages]
  part_types = {part_key(v - n): SlotType.of(jax.ShapeDtypeStruct(
      (avals[i].shape[0] // len(stages), *avals[i].shape[1:]), avals[i].dtype), tuple(specs[i]))
      for v, i in parts.items()}
  dims = tuple(stage_dim(sh.spec) for sh in shardings)
  split_model = any(k > 1 for k in split)
  slotted = split_model or in_slots
  if slotted:   # the exchanged leaves in shared slots, then each part its own
    layouts, buffers = packing.assign([[SlotType.of(avals[i], tuple(specs[i]))
                                        for i in leaves] for leaves in members])
  else:   # where each stage's leaves arrive in its buffer (``exchange``)
    layouts = [packing.Layout.of([avals[i] for i in member], size, [dims[i] for i in member],
                                 placement(stage, member))
               for stage, member in zip(stages, members)]
    buffers = {k: size * w for k, w in packing.padded_sizes(layouts).items()}
  return ParamStore(
      mesh=mesh, avals=tuple(avals), specs=tuple(specs), shardings=shardings, members=members,
      parts=parts, part_types=part_types, virtual=virtual, slotted=slotted,
      split_model=split_model,
      layouts=tuple(lay.whole(keys, part_types) for lay, keys in zip(layouts, part_keys)),
      buffers={**buffers, **part_types})


def placement(stage: Stage, member: Sequence[int]) -> list[int]:
  """The order in which a stage's exchanged leaves (``member``) take their places in its
  buffer: its rolled layers' stacks first, each stack's rows side by side, then the rest.

  Stages of the same layers then place them at the same offsets, whatever else a stage holds
  (an embedding before its layers, a head after them), so the slices that unpack them are the
  same in every stage's branch, and a stack's rows are one contiguous range."""
  where = {leaf: j for j, leaf in enumerate(member)}
  order = [where[stage.params[p]] for rows in stage.stacks for p in rows
           if stage.params[p] in where]
  order = list(dict.fromkeys(order))       # a leaf read by several blocks: its first place
  placed = set(order)
  return order + [j for j in range(len(member)) if j not in placed]


def _rows_over_stage(spec: P, path: str, aval: Any) -> P:
  """A chunked leaf's stored spec: its rows (layers) over ``stage``, stage ``s`` holding
  chunk ``s``."""
  if len(spec) and spec[0] is not None:
    raise PlanError(_ROWS_TAKEN.format(path=path, spec=spec, shape=tuple(aval.shape)))
  return P(STAGE, *tuple(spec)[1:])


def part_key(j: int) -> str:
  return f"part{j}"


def exchange(leaves: Sequence[Any], rows: Sequence[packing.Layout],
             members: Sequence[Sequence[int]], dims: Sequence[int | None],
             slot: Mapping[str, int], mesh: Mesh) -> dict[str, jax.Array]:
  """The stored leaves -> ``{dtype: (S v, S slot)}`` over ``stage``: row ``R`` is the buffer of
  ``rows[R]`` (the layout of the chunk in row ``R``, whose leaves are ``members[R]``)."""
  n_stages = mesh.shape[STAGE]
  per = len(rows) // n_stages

  def local(*local_leaves):
    r = lax.axis_index(STAGE)
    send = {}
    for name in slot:
      parts = []
      for layout, member in zip(rows, members):
        mine = [_my_piece(local_leaves[i], e, r, n_stages) for i, e in
                sorted(zip(member, layout.entries), key=lambda x: x[1].offset)
                if e.dtype == name]
        parts.append(packing.fill(mine, slot[name], name))
      send[name] = jnp.stack(parts).reshape(n_stages, per, slot[name])
    got = {k: lax.all_to_all(v, STAGE, 0, 0, tiled=True) for k, v in send.items()}
    return {k: v.transpose(1, 0, 2).reshape(per, n_stages * slot[k]) for k, v in got.items()}

  return jax.shard_map(local, mesh=mesh, in_specs=tuple(map(slots.stage_spec, dims)),
                       out_specs=P(STAGE), axis_names=frozenset({STAGE}), check_vma=False)(*leaves)


def exchange_gradients(packed: Mapping[str, jax.Array], rows: Sequence[packing.Layout],
                       members: Sequence[Sequence[int]], dims: Sequence[int | None],
                       slot: Mapping[str, int], avals: Sequence[Any],
                       mesh: Mesh) -> list[jax.Array]:
  """The transpose of ``exchange``: per stored leaf, the sum of its stages' gradients, in the
  leaf's stored layout (zeros for a leaf no stage reads)."""
  n_stages = mesh.shape[STAGE]
  per = len(rows) // n_stages

  def local(bufs):
    back = {k: lax.all_to_all(v.reshape(per, n_stages, slot[k]).transpose(1, 0, 2), STAGE, 0, 0,
                              tiled=True) for k, v in bufs.items()}   # [s, j]: row s v + j's
    pieces = [(row, i, e) for row, (layout, member) in enumerate(zip(rows, members))
              for i, e in zip(member, layout.entries)]
    offsets = _opaque([e.offset for _, _, e in pieces], mesh)
    sums: list[Any] = [None] * len(avals)
    for (row, i, e), at in zip(pieces, offsets):
      buf = back[e.dtype][row // per, row % per]
      piece = lax.dynamic_slice_in_dim(buf, at, e.size)
      sums[i] = piece if sums[i] is None else sums[i] + piece
    flat = [i for i in range(len(avals)) if sums[i] is not None and dims[i] is None]
    gathered = {}
    for name in {packing.dtype_name(avals[i].dtype) for i in flat}:   # one gather per dtype
      mine = [i for i in flat if packing.dtype_name(avals[i].dtype) == name]
      every = lax.all_gather(jnp.concatenate([sums[i] for i in mine]), STAGE)
      at = 0
      for i in mine:
        n = sums[i].shape[0]
        gathered[i] = every[:, at:at + n].reshape(-1)[:math.prod(avals[i].shape)].reshape(
            avals[i].shape)
        at += n
    out = []
    for i, a in enumerate(avals):
      if sums[i] is None:
        out.append(jnp.zeros(packing.piece_shape(a.shape, dims[i], n_stages), a.dtype))
      elif dims[i] is None:
        out.append(gathered[i])
      else:
        out.append(sums[i].reshape(packing.piece_shape(a.shape, dims[i], n_stages)))
    return tuple(out)

  specs = tuple(map(slots.stage_spec, dims))
  return jax.shard_map(local, mesh=mesh, in_specs=(P(STAGE),), out_specs=specs,
                       axis_names=frozenset({STAGE}), check_vma=False)(dict(packed))


# Platforms whose compiler drops an ``optimization_barrier`` before it simplifies (``_opaque``).
BARRIER_DROPPED = frozenset({"cpu"})


def _opaque(offsets: Sequence[int], mesh: Mesh) -> Sequence[Any]:
  """Offsets as values the compiler does not fold into the slices that read them, so that
  each leaf's gradient is sliced, and its update fused with that slice, by one kernel per
  leaf shape rather than one per offset: compiling a deep model's step is code generation per
  distinct kernel (``bench/pipeline.py compile --baseline 48`` on compile-only H100s: 1164 ->
  434 distinct kernels). XLA:CPU drops the barrier before it simplifies, so it would fold them
  anyway, into larger slices: there they stay plain numbers."""
  if mesh.devices.flat[0].platform in BARRIER_DROPPED:
    return offsets
  return lax.optimization_barrier(tuple(jnp.int32(o) for o in offsets))


def interleave(leaf: jax.Array, virtual: int, mesh: Mesh) -> jax.Array:
  """A stacked leaf stored split over ``stage`` on its rows -> ``(S v, rows, ...)`` split the
  same way, row ``s v + j`` holding row chunk ``s + j S`` (the interleaved schedule's chunk
  ``j`` of stage ``s``). Stored, stage ``s`` holds chunks ``s v, ..., s v + v - 1``; each
  device sends each of those to its stage in one of ``v`` ``ppermute`` rounds
  (``interleave_rounds``), so every chunk moves once, and no device holds more than its own."""
  n_stages = mesh.shape[STAGE]
  if virtual == 1:   # stage s holds chunk s where stored: a free reshape
    return leaf.reshape(n_stages, -1, *leaf.shape[1:])
  stored, running = _places(n_stages, virtual)
  return _route(leaf.reshape(n_stages * virtual, -1, *leaf.shape[1:]), virtual, mesh,
                stored, running)


def deinterleave(parts: jax.Array, shape: tuple[int, ...], mesh: Mesh) -> jax.Array:
  """The transpose of ``interleave``: ``(S v, rows, ...)`` (the chunks' gradients) -> the leaf
  of ``shape``, in its stored layout."""
  n_stages = mesh.shape[STAGE]
  virtual = parts.shape[0] // n_stages
  if virtual == 1:
    return parts.reshape(shape)
  stored, running = _places(n_stages, virtual)
  return _route(parts, virtual, mesh, running, stored).reshape(shape)


def _places(n_stages: int, virtual: int):
  """Chunk -> (stage, row) where it is stored (stage ``s``: chunks ``s v ...``) and where it
  runs (stage ``c % S``, its row ``c // S``)."""
  return (lambda c: divmod(c, virtual)), (lambda c: divmod(c, n_stages)[::-1])


def _route(chunks: jax.Array, virtual: int, mesh: Mesh, source, target) -> jax.Array:
  """``(S v, rows, ...)`` split over ``stage`` (each stage its ``v`` rows) with chunk ``c`` at
  ``source(c) = (stage, row)`` -> the same with every chunk at ``target(c)``, in the
  ``ppermute`` rounds of ``interleave_rounds`` (one chunk sent and one received per stage)."""
  n_stages = mesh.shape[STAGE]

  def local(mine):   # (v, rows, ...)
    s = lax.axis_index(STAGE)
    out = jnp.zeros_like(mine)
    for sent in interleave_rounds(n_stages, virtual):
      # A round is a perfect matching: each stage sends one chunk and receives one.
      out_of = {source(c)[0]: c for c in sent}
      into_of = {target(c)[0]: c for c in sent}
      row = jnp.asarray([source(out_of[t])[1] for t in range(n_stages)])[s]
      moved = _move(lax.dynamic_index_in_dim(mine, row, keepdims=False),
                    [(source(c)[0], target(c)[0]) for c in sent])
      into = jnp.asarray([target(into_of[t])[1] for t in range(n_stages)])[s]
      out = lax.dynamic_update_index_in_dim(out, moved, into, 0)
    return out

  return jax.shard_map(local, mesh=mesh, in_specs=P(STAGE), out_specs=P(STAGE),
                       axis_names=frozenset({STAGE}), check_vma=False)(chunks)


def _move(x: jax.Array, pairs: list[tuple[int, int]]) -> jax.Array:
  """``ppermute`` over ``stage`` of the pairs that change stage; a stage whose pair is its own
  keeps ``x`` (no collective at all when every stage does)."""
  moving = [(a, b) for a, b in pairs if a != b]
  if not moving:
    return x
  moved = lax.ppermute(x, STAGE, moving)
  keeps = [a for a, b in pairs if a == b]
  if not keeps:
    return moved
  return jnp.where(jnp.isin(lax.axis_index(STAGE), jnp.asarray(keeps)), x, moved)


@functools.cache
def interleave_rounds(n_stages: int, virtual: int) -> tuple[tuple[int, ...], ...]:
  """``v`` rounds, each the chunk every stage sends (``round[s]``, one of its stored chunks
  ``s v + j``) to the stage that runs it (``c % S``), no stage receiving two in a round.

  With ``g = gcd(S, v)`` and stage ``s = a S/g + b`` (``a < g``), round ``i`` sends
  ``j = (a + i) mod v``: ``s v mod S`` is ``g`` times a permutation of the ``b`` (``v/g`` and
  ``S/g`` are coprime), and ``j mod g = (a + i) mod g`` tells the ``a`` apart, so the
  receivers ``(s v + j) mod S`` all differ; over the ``v`` rounds ``j`` takes every value once."""
  g = math.gcd(n_stages, virtual)
  return tuple(tuple(s * virtual + (s // (n_stages // g) + i) % virtual for s in range(n_stages))
               for i in range(virtual))


def stage_dim(spec: P) -> int | None:
  """The dimension a stored leaf's ``spec`` splits over ``stage`` (alone), or None."""
  for d, e in enumerate(spec):
    if e == STAGE:
      return d
    if isinstance(e, tuple) and STAGE in e:   # internal invariant: add_axis puts it alone
      raise AssertionError(f"stage shares dimension {d} of {spec}")
  return None


def _my_piece(local: jax.Array, e: packing.Entry, r: jax.Array, stages: int) -> jax.Array:
  """Device ``r``'s piece of a leaf: its shard, or its slice of the (padded) flat values."""
  flat = jnp.ravel(local).astype(e.dtype)
  if e.dim is not None:
    return flat
  flat = jnp.pad(flat, (0, stages * e.size - flat.shape[0]))
  return lax.dynamic_slice_in_dim(flat, r * e.size, e.size)


_ROWS_TAKEN = """\
Parameter '{path}' (shape {shape}) is a stack of layers each pipeline stage reads its own rows
of, so it is stored split over stage on its first dimension, but its spec {spec} already splits
that dimension. Leave the layers axis of scanned layers unsplit (map its logical axis name to
None, or give the parameter an epl.annotate spec that starts with None)."""
