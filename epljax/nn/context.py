"""Attention over a sequence split across the mesh axis ``context`` (context parallelism).

With ``context.parallel_degree = k`` every batch leaf's dimension 1 is split in order over the
``context`` axis (``epljax.batch``): device ``c`` holds chunk ``c`` of each sequence, so the
model's own positions (``jnp.arange(seq)`` for rotary embeddings) stay right and everything but
the attention follows GSPMD. ``epl.nn.dot_product_attention`` then calls ``attention`` here:
a ``shard_map`` over the mesh (batch over the batch axes, sequence over ``context``, heads over
``model`` when the model splits them) in which each device attends its queries to every key:

- ``"ring"``: key/value blocks travel around the axis with ``ppermute`` (k - 1 steps), each
  step's partial output merged by its log-sum-exp (``merge_partials``); a device holds two
  blocks at a time, and XLA can overlap each step's transfer with the previous block's compute.
- ``"gather"``: one ``all_gather`` of the keys and values, then the same blocks read from it.
  The same bytes cross the links, in one collective; a device holds the whole sequence's keys
  and values for the layer.

Causal balance: in order, device ``c`` would attend to ``c + 1`` chunks of keys, so the last
device would work k times as long as the first. Inside the attention the queries (and, for the
ring, the keys and values) are moved into a zig-zag order: the sequence cut into 2k halves,
device ``c`` holds halves ``c`` and ``2k - 1 - c`` (two ``ppermute``s there and two back for
the output). Every step of the loop then computes exactly two half-by-half blocks on every
device: the late half against the visiting early half, and either the early half against it
(visitor from an earlier device) or the late half against the visiting late half (from a later
device), chosen by a ``where`` on the inputs, never by running both. A call with a mask or
bias runs the gather with its queries in order (the mask's rows split as the sequence is):
exact, but its causal work is not balanced.

How it finds the plan while tracing: ``build`` traces the step inside ``attention_over(layout)``
(a ``ContextLayout`` derived from the plan: which axes split the batch, whether ``model``
splits heads); outside that scope (one device, the capture, no ``context`` axis) attention is
local.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from epljax.errors import PlanError
from epljax.mesh import CONTEXT, MODEL
from epljax.nn import blocks

METHODS = ("ring", "gather")


@dataclasses.dataclass(frozen=True)
class ContextLayout:
  """What the attention needs of the plan: the ``context`` axis' size, the mesh axes of the
  batch dimension, and the axis that splits heads (``model`` under ``epl.split``) or None."""
  size: int
  batch_axes: tuple[str, ...]
  heads_axis: str | None = None
  method: str | None = None   # None: chosen per call by ``choose_method``

  def __post_init__(self):
    if self.method is not None and self.method not in METHODS:
      raise PlanError(f"Context attention method {self.method!r}: use one of {METHODS}.")


def layout_of(mesh, batch_axes: tuple[str, ...]) -> ContextLayout | None:
  """The plan's ``ContextLayout`` (None without a ``context`` axis): heads over ``model`` when
  ``model`` has devices and does not split the batch (``epl.split``, Megatron's heads)."""
  sizes = dict(mesh.shape)
  if sizes.get(CONTEXT, 1) == 1:
    return None
  heads = MODEL if sizes.get(MODEL, 1) > 1 and MODEL not in batch_axes else None
  return ContextLayout(sizes[CONTEXT], tuple(batch_axes), heads)


_LAYOUT: contextvars.ContextVar[ContextLayout | None] = contextvars.ContextVar(
    "epljax_context_layout", default=None)


@contextlib.contextmanager
def attention_over(layout: ContextLayout | None) -> Iterator[None]:
  """Attention traced inside runs over ``layout`` (None or size 1: local)."""
  token = _LAYOUT.set(layout if layout is not None and layout.size > 1 else None)
  try:
    yield
  finally:
    _LAYOUT.reset(token)


@dataclasses.dataclass
class Calls:
  """How many times ``epl.nn.dot_product_attention`` was traced (``counting_calls``)."""
  count: int = 0


_CALLS: contextvars.ContextVar[Calls | None] = contextvars.ContextVar(
    "epljax_attention_calls", default=None)


@contextlib.contextmanager
def counting_calls() -> Iterator[Calls]:
  """Counts the attention calls traced inside (what ``describe`` says of the model)."""
  calls = Calls()
  token = _CALLS.set(calls)
  try:
    yield calls
  finally:
    _CALLS.reset(token)


def note_call() -> None:
  """Called once by every ``epl.nn.dot_product_attention`` traced (``counting_calls``)."""
  calls = _CALLS.get()
  if calls is not None:
    calls.count += 1


def current() -> ContextLayout | None:
  """The layout attention runs over now, or None (local attention)."""
  layout = _LAYOUT.get()
  if layout is None or CONTEXT not in jax.sharding.get_abstract_mesh().axis_names:
    return None
  return layout


NOT_SPLIT = (
    "context parallelism over {k} devices: the model computes no epl.nn.dot_product_attention, "
    "so its attention's score matrix is not split over 'context': GSPMD gathers the keys and "
    "values and each device holds [seq/{k}, seq] scores per head. Compute attention with "
    "epl.nn.dot_product_attention(q, k, v, causal=...) to run it over 'context' in memory "
    "linear in the sequence")


def describe(layout: ContextLayout | None, calls: int) -> str:
  """The plan's line for context parallelism: what runs over the axis, or what does not."""
  if layout is None:
    return ""
  if not calls:
    return NOT_SPLIT.format(k=layout.size)
  heads = f", heads over '{layout.heads_axis}'" if layout.heads_axis else ""
  return (f"context parallelism over {layout.size} devices: {calls} "
          f"epl.nn.dot_product_attention call(s) run over 'context' (batch over "
          f"{'/'.join(layout.batch_axes)}{heads}; causal work in zig-zag order)")


def choose_method(q_shape, kv_shape, *, masked: bool) -> str:
  """``"gather"`` when a mask or bias comes with the call (the ring does not carry them) or
  when every device's keys and values together are no larger than its own queries
  (``2 x kv_heads x k <= heads``: grouped-query attention with few key/value heads);
  otherwise ``"ring"``. Why: the gather moves fewer bytes (no zig-zag reorder of keys and
  values; ``bench/context_attention.py``), but holds the whole sequence's keys and values
  for the layer, which the ring never does (two blocks at a time); so it is used where that
  costs no more than the queries a device holds anyway."""
  layout = current()
  k = layout.size if layout is not None else 1
  if masked or kv_shape[2] * 2 * k <= q_shape[2]:
    return "gather"
  return "ring"


def attention(q, k, v, *, causal: bool = False, mask=None, bias=None, scale=None,
              method: str | None = None):
  """``epl.nn.dot_product_attention`` over the current ``ContextLayout`` (see the module doc):
  ``q`` ``[batch, seq, heads, dim]``, ``k``/``v`` ``[batch, seq, kv_heads, dim]`` as the model
  sees them (sequence in order, split over ``context`` by GSPMD)."""
  layout = current()
  if layout is None:
    raise PlanError("epljax.nn.context.attention runs inside a step traced with context "
                    "parallelism (context.parallel_degree > 1); call "
                    "epl.nn.dot_product_attention, which picks the local form elsewhere.")
  n = layout.size
  seq = q.shape[1]
  if k.shape[1] != seq:
    raise PlanError(f"Context parallelism: keys of length {k.shape[1]} for queries of length "
                    f"{seq}; cross-attention over a split sequence is not supported. Give "
                    "keys and values the queries' sequence.")
  if seq % (2 * n if causal else n):
    raise PlanError(
        f"Context parallelism over {n} devices: the attention's sequence of {seq} does not "
        f"divide into {2 * n if causal else n} chunks ({'2 x ' if causal else ''}"
        f"context.parallel_degree{', causal balance' if causal else ''}). Use a sequence "
        f"that is a multiple of {2 * n if causal else n}.")
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  method = method or layout.method or choose_method(
      q.shape, k.shape, masked=mask is not None or bias is not None)
  mesh = jax.sharding.get_abstract_mesh()
  manual = set(getattr(mesh, "manual_axes", ()))
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  batch = tuple(a for a in layout.batch_axes if a not in manual and a in sizes)
  rows = 1
  for a in batch:
    rows *= sizes[a]
  batch = batch if q.shape[0] % rows == 0 else ()
  heads = layout.heads_axis
  if heads is None or heads in manual or q.shape[2] % sizes[heads] or k.shape[2] % sizes[heads]:
    heads = None
  spec = P(batch or None, CONTEXT, heads, None)
  extras, extra_specs = [], []
  for x in (mask, bias):
    if x is not None:
      extras.append(x)
      extra_specs.append(_extra_spec(x, q, batch, heads, seq))
  body = _gather_body if method == "gather" else _ring_body

  def local(q, k, v, *extra):
    it = iter(extra)
    m = next(it) if mask is not None else None
    b = next(it) if bias is not None else None
    return body(q, k, v, n=n, causal=causal, scale=scale, mask=m, bias=b).astype(q.dtype)

  # check_vma=False: the blockwise kernel's loop carries start as unvarying zeros.
  return jax.shard_map(local, in_specs=(spec, spec, spec, *extra_specs), out_specs=spec,
                       check_vma=False)(q, k, v, *extras)


def _extra_spec(x, q, batch, heads, seq) -> P:
  """A mask's or bias' spec ``[batch, heads, q_seq, k_seq]`` (each dim 1 or full): the query
  sequence split over ``context``, the keys whole."""
  if x.ndim != 4:
    raise PlanError(f"Context parallelism: a mask or bias of shape {x.shape}; give it the "
                    "4 dimensions [batch, heads, q_seq, k_seq] (1 where it broadcasts).")
  return P(batch or None if x.shape[0] == q.shape[0] and batch else None,
           heads if x.shape[1] == q.shape[2] else None,
           CONTEXT if x.shape[2] == seq else None, None)


# ---- the per-device bodies (inside the shard_map) ----------------------------------------

def _gather_body(q, k, v, *, n, causal, scale, mask, bias):
  if mask is not None or bias is not None or not causal:
    # Queries in order against every key; a mask's or bias' key dimension is whole.
    c = jax.lax.axis_index(CONTEXT)
    k_all = jax.lax.all_gather(k, CONTEXT, axis=1, tiled=True)
    v_all = jax.lax.all_gather(v, CONTEXT, axis=1, tiled=True)
    out, _ = blocks.attention_block(q, k_all, v_all, q_offset=c * q.shape[1], k_offset=0,
                                       causal=causal, scale=scale, mask=mask, bias=bias)
    return out
  k_all = jax.lax.all_gather(k, CONTEXT, axis=1, tiled=True)   # halves in order
  v_all = jax.lax.all_gather(v, CONTEXT, axis=1, tiled=True)
  half = q.shape[1] // 2
  c = jax.lax.axis_index(CONTEXT)

  def visits():   # device c - t's zig-zag halves, read from the gathered keys and values
    for t in range(n):
      j = (c - t) % n
      yield tuple((_half(k_all, m, half), _half(v_all, m, half)) for m in (j, 2 * n - 1 - j))
  out = _zigzag_causal(to_zigzag(q, n), visits(), n=n, scale=scale)
  return from_zigzag(out, n)


def _half(x, m, half):
  return jax.lax.dynamic_slice_in_dim(x, m * half, half, axis=1)


def _ring_body(q, k, v, *, n, causal, scale, mask, bias):
  del mask, bias   # choose_method sends those to the gather
  shift = [(i, (i + 1) % n) for i in range(n)]
  if not causal:
    acc, kv = None, (k, v)
    for t in range(n):
      part = blocks.attention_block(q, *kv, q_offset=0, k_offset=0, causal=False, scale=scale)
      acc = part if acc is None else blocks.merge_partials(*acc, *part)
      if t < n - 1:
        kv = jax.lax.ppermute(kv, CONTEXT, shift)
    return acc[0]
  half = q.shape[1] // 2

  def visits():   # the ring: at step t the keys and values of device c - t
    kv = to_zigzag((k, v), n)
    for t in range(n):
      if t:
        kv = jax.lax.ppermute(kv, CONTEXT, shift)
      yield tuple((kv[0][:, s], kv[1][:, s]) for s in (slice(0, half), slice(half, None)))
  out = _zigzag_causal(to_zigzag(q, n), visits(), n=n, scale=scale)
  return from_zigzag(out, n)


def _zigzag_causal(q, visits, *, n, scale):
  """Causal attention of zig-zag queries ``[q0; q1]`` (halves ``c`` and ``2n - 1 - c``) to
  every device's zig-zag keys: ``visits`` yields, for step t = 0 .. n-1, device ``c - t``'s
  halves ``((k0, v0), (k1, v1))``. Two half blocks per step after the first."""
  visits = iter(visits)
  c = jax.lax.axis_index(CONTEXT)
  half = q.shape[1] // 2
  q0, q1 = q[:, :half], q[:, half:]
  (k0, v0), (k1, v1) = next(visits)
  diag0 = blocks.attention_block(q0, k0, v0, q_offset=c * half, k_offset=c * half,
                                 causal=True, scale=scale)
  late = (2 * n - 1 - c) * half
  acc1 = blocks.merge_partials(
      *blocks.attention_block(q1, k0, v0, q_offset=0, k_offset=0, causal=False, scale=scale),
      *blocks.attention_block(q1, k1, v1, q_offset=late, k_offset=late, causal=True,
                              scale=scale))
  acc0 = diag0
  for t in range(1, n):
    j = (c - t) % n
    (k0, v0), (k1, v1) = next(visits)
    # Late queries always see the visitor's early half in full.
    acc1 = blocks.merge_partials(*acc1, *blocks.attention_block(
        q1, k0, v0, q_offset=0, k_offset=0, causal=False, scale=scale))
    # An earlier device (j < c): early queries see its early half; a later one: late queries
    # see its late half. One block either way, its inputs chosen, not both computed.
    earlier = j < c
    qs = jnp.where(earlier, q0, q1)
    ks, vs = jnp.where(earlier, k0, k1), jnp.where(earlier, v0, v1)
    out, lse = blocks.attention_block(qs, ks, vs, q_offset=0, k_offset=0, causal=False,
                                      scale=scale)
    none = jnp.full_like(lse, -jnp.inf)
    acc0 = blocks.merge_partials(*acc0, out, jnp.where(earlier, lse, none))
    acc1 = blocks.merge_partials(*acc1, out, jnp.where(earlier, none, lse))
  return jnp.concatenate([acc0[0], acc1[0]], axis=1)


# ---- zig-zag order -----------------------------------------------------------------------

def _zig_pairs(n: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
  """Where device i's early (half 2i) and late (half 2i+1) local halves go: half m to device
  m (m < n) or 2n - 1 - m. Each is a permutation of the devices."""
  home = lambda m: m if m < n else 2 * n - 1 - m   # noqa: E731
  return ([(i, home(2 * i)) for i in range(n)], [(i, home(2 * i + 1)) for i in range(n)])


def to_zigzag(x, n: int):
  """In-order chunks (device c: halves 2c, 2c+1 of dimension 1) -> zig-zag (halves c and
  2n - 1 - c). ``x``: an array or a tuple of arrays."""
  even, odd = _zig_pairs(n)
  c = jax.lax.axis_index(CONTEXT)

  def one(a):
    half = a.shape[1] // 2
    got_even = jax.lax.ppermute(a[:, :half], CONTEXT, even)
    got_odd = jax.lax.ppermute(a[:, half:], CONTEXT, odd)
    first = c % 2 == 0   # an even device's early half came from an even half
    return jnp.concatenate([jnp.where(first, got_even, got_odd),
                            jnp.where(first, got_odd, got_even)], axis=1)
  return jax.tree.map(one, x)


def from_zigzag(x, n: int):
  """``to_zigzag``'s inverse."""
  even, odd = _zig_pairs(n)
  c = jax.lax.axis_index(CONTEXT)
  half = x.shape[1] // 2
  first = c % 2 == 0
  a, b = x[:, :half], x[:, half:]
  back_even = jax.lax.ppermute(jnp.where(first, a, b), CONTEXT, [(d, s) for s, d in even])
  back_odd = jax.lax.ppermute(jnp.where(first, b, a), CONTEXT, [(d, s) for s, d in odd])
  return jnp.concatenate([back_even, back_odd], axis=1)
