"""Blockwise attention in memory linear in the sequence: the XLA kernel behind
``epl.nn.dot_product_attention`` and ``attention_block`` (see ``attention.py`` and ``blocks.py``
for the API).

The forward walks query blocks and, inside each, key/value blocks with an online softmax (a
running maximum and sum per query row), so no more than one ``[block_q, block_k]`` tile of
scores exists at a time. The backward is FlashAttention-2's: it walks key/value blocks,
recomputes each tile's probabilities from the saved log-sum-exp, accumulates the tile's key and
value gradients locally and adds its query gradient into one ``[batch, q_seq, heads, head_dim]``
buffer. The saved residuals are q, k, v, the output and the log-sum-exp: linear too.

A sequence that is not a multiple of its block is not padded: the last block starts earlier
(``seq - block``) and the rows or keys it shares with the block before are masked out, so q, k,
v, mask and bias are only ever sliced, never copied whole. Causal tiles entirely above the
diagonal are skipped by the loops' bounds, which may be traced (a chunk's absolute offsets
under context parallelism).

Layouts inside: queries ``[batch, q_seq, kv_heads, groups, head_dim]`` (head ``h`` is key/value
head ``h // groups``, jax's grouped-query convention), keys and values
``[batch, kv_seq, kv_heads, head_dim]``, mask and bias ``[b, kv_heads, groups, q_seq, kv_seq]``
with each dimension either full or 1 (broadcast).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

DEFAULT_BLOCK = 512


def block_size(seq: int, largest: int = DEFAULT_BLOCK) -> int:
  """The block for a sequence: as few blocks of at most ``largest`` as cover ``seq``, evened
  out and rounded up to a multiple of 8 (600 -> 2 blocks of 304), at most ``seq``."""
  count = -(-seq // largest)
  per_block = -(-seq // count)
  return min(seq, -(-per_block // 8) * 8)


def blockwise_attention(q, k, v, mask, bias, q_offset, k_offset, *, causal: bool, scale: float,
                        block_q: int, block_k: int):
  """``(out, lse)``: out ``[batch, q_seq, kv_heads, groups, head_dim]`` float32 (normalized),
  lse ``[batch, kv_heads, groups, q_seq]`` float32, -inf for a row that saw no key. Layouts
  as in the module docstring; ``q_offset``/``k_offset``: absolute position of the first
  query/key (ints or int32 scalars), read by the causal mask only."""
  block_q, block_k = min(block_q, q.shape[1]), min(block_k, k.shape[1])
  q_offset = jnp.asarray(q_offset, jnp.int32)
  k_offset = jnp.asarray(k_offset, jnp.int32)
  q, k, v, bias = _varying_alike(q, k, v, bias, mask, q_offset, k_offset)
  return _attention(causal, float(scale), block_q, block_k, q, k, v, mask, bias, q_offset,
                    k_offset)


def _varying_alike(q, k, v, bias, *rest):
  """Inside a ``shard_map``: q, k, v and bias made to vary over every manual axis any input
  varies over (keys shared by all devices, queries split, say), so that the custom VJP's
  gradients have their inputs' types; jax sums each over the axes it was made to vary over.
  Elsewhere this adds a constant 0, which XLA removes."""
  zero = _zeros((), q, k, v, bias, *rest)
  return tuple(x if x is None else x + zero.astype(x.dtype) for x in (q, k, v, bias))


def _start(index, block: int, seq: int):
  """Where block ``index`` starts: the last one ends at ``seq`` and overlaps the one before."""
  return jnp.minimum(index * block, seq - block)


def _slice(x, start, size: int, axis: int):
  """A block of ``x`` along ``axis``, or all of it where the axis is broadcast (size 1)."""
  if x is None or x.shape[axis] == 1:
    return x
  return lax.dynamic_slice_in_dim(x, start, size, axis)


def _add_at(x, update, start, axis: int):
  """``x`` with ``update`` added at ``start`` along ``axis`` (nowhere to slice if broadcast)."""
  if x.shape[axis] == 1:
    return x + update
  old = lax.dynamic_slice_in_dim(x, start, update.shape[axis], axis)
  return lax.dynamic_update_slice_in_dim(x, old + update, start, axis)


def _add_tile(x, tile, q_start, k_start):
  """``x`` (a bias gradient) with ``tile`` added at the tile's place."""
  starts = (0, 0, 0, q_start if x.shape[3] > 1 else 0, k_start if x.shape[4] > 1 else 0)
  old = lax.dynamic_slice(x, starts, tile.shape)
  return lax.dynamic_update_slice(x, old + tile, starts)


def _zeros(shape, *like, value=0.0):
  """A float32 ``value``-filled array that varies over the same manual mesh axes as ``like``
  together (inside a ``shard_map`` with ``check_vma``, a loop's carry must match its body)."""
  base = sum(lax.full_like(x, 0, jnp.float32, ()) for x in like if x is not None)
  return jnp.broadcast_to(base + value, shape)


class _Tile:
  """One query block against one key block: which scores are kept, and the scores."""

  def __init__(self, static, q, k, v, mask, bias, q_offset, k_offset, i, j):
    causal, scale, bq, bk = static
    self.q_start = _start(i, bq, q.shape[1])
    self.k_start = _start(j, bk, k.shape[1])
    self.q = lax.dynamic_slice_in_dim(q, self.q_start, bq, 1)
    self.k = lax.dynamic_slice_in_dim(k, self.k_start, bk, 1)
    self.v = lax.dynamic_slice_in_dim(v, self.k_start, bk, 1)
    rows = self.q_start + jnp.arange(bq)
    cols = self.k_start + jnp.arange(bk)
    keep = (cols >= j * bk)[None, :]   # not the keys the block before already had
    if causal:
      keep = keep & ((q_offset + rows)[:, None] >= (k_offset + cols)[None, :])
    self.new_rows = rows >= i * bq     # not the rows the block before already had
    user_mask = _slice(_slice(mask, self.q_start, bq, 3), self.k_start, bk, 4)
    if user_mask is not None:
      keep = keep & user_mask
    s = jnp.einsum("bqhgd,bkhd->bhgqk", self.q, self.k,
                   preferred_element_type=jnp.float32) * scale
    user_bias = _slice(_slice(bias, self.q_start, bq, 3), self.k_start, bk, 4)
    if user_bias is not None:
      s = s + user_bias.astype(jnp.float32)
    self.s = jnp.where(keep, s, -jnp.inf)   # [batch, kv_heads, groups, block_q, block_k]


def _forward(static, q, k, v, mask, bias, q_offset, k_offset):
  causal, _, bq, bk = static
  batch, q_seq, heads, groups, dim = q.shape
  nq, nk = -(-q_seq // bq), -(-k.shape[1] // bk)

  def query_block(i, carry):
    out, lse = carry

    def key_block(j, state):
      m, l, acc = state
      tile = _Tile(static, q, k, v, mask, bias, q_offset, k_offset, i, j)
      m_new = jnp.maximum(m, jnp.max(tile.s, axis=-1))
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)   # a row with no key yet stays at 0
      p = jnp.exp(tile.s - m_safe[..., None])
      alpha = jnp.exp(m - m_safe)
      pv = jnp.einsum("bhgqk,bkhd->bhgqd", p.astype(v.dtype), tile.v,
                      preferred_element_type=jnp.float32)
      return m_new, l * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv

    rows = (batch, heads, groups, bq)
    state = (_zeros(rows, *like, value=-jnp.inf), _zeros(rows, *like),
             _zeros((*rows, dim), *like))
    end = nk
    if causal:
      last_row = q_offset + jnp.minimum((i + 1) * bq, q_seq) - 1
      end = jnp.clip((last_row - k_offset) // bk + 1, 0, nk)
    m, l, acc = lax.fori_loop(0, end, key_block, state)
    seen = l > 0
    block_out = acc / jnp.where(seen, l, 1.0)[..., None]
    block_lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
    start = _start(i, bq, q_seq)   # rows shared with the block before get the same values
    out = lax.dynamic_update_slice_in_dim(out, block_out.transpose(0, 3, 1, 2, 4), start, 1)
    lse = lax.dynamic_update_slice_in_dim(lse, block_lse, start, 3)
    return out, lse

  like = (q, k, v, mask, bias, q_offset, k_offset)
  out = _zeros((batch, q_seq, heads, groups, dim), *like)
  lse = _zeros((batch, heads, groups, q_seq), *like)
  return lax.fori_loop(0, nq, query_block, (out, lse))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _attention(causal, scale, block_q, block_k, q, k, v, mask, bias, q_offset, k_offset):
  return _forward((causal, scale, block_q, block_k), q, k, v, mask, bias, q_offset, k_offset)


def _attention_fwd(causal, scale, block_q, block_k, q, k, v, mask, bias, q_offset, k_offset):
  out, lse = _forward((causal, scale, block_q, block_k), q, k, v, mask, bias, q_offset,
                      k_offset)
  # The output is kept in q's dtype: FlashAttention's choice, exact for float32 inputs.
  residuals = (q, k, v, mask, bias, q_offset, k_offset, out.astype(q.dtype), lse)
  return (out, lse), residuals


def _attention_bwd(causal, scale, block_q, block_k, residuals, cotangents):
  q, k, v, mask, bias, q_offset, k_offset, out, lse = residuals
  d_out, d_lse = cotangents
  static = (causal, scale, block_q, block_k)
  bq, bk = block_q, block_k
  q_seq, k_seq = q.shape[1], k.shape[1]
  nq, nk = -(-q_seq // bq), -(-k_seq // bk)
  # d lse / d s = p, so a cotangent on lse shifts FlashAttention-2's row term D = rowsum(dO*O).
  delta = jnp.einsum("bqhgd,bqhgd->bhgq", d_out, out.astype(jnp.float32)) - d_lse
  lse_safe = jnp.where(lse == -jnp.inf, 0.0, lse)   # such rows have every score at -inf

  def key_block(j, carry):
    dq, dk, dv, dbias = carry
    first_key = k_offset + j * bk
    begin = 0
    if causal:   # the first query block whose last row reaches this block's first new key
      row = first_key - q_offset
      begin = jnp.where(row >= q_seq, nq, jnp.clip(row // bq, 0, nq))

    def query_block(i, state):
      dq, dk_j, dv_j, dbias = state
      tile = _Tile(static, q, k, v, mask, bias, q_offset, k_offset, i, j)
      lse_i = lax.dynamic_slice_in_dim(lse_safe, tile.q_start, bq, 3)
      delta_i = lax.dynamic_slice_in_dim(delta, tile.q_start, bq, 3)
      d_out_i = lax.dynamic_slice_in_dim(d_out, tile.q_start, bq, 1)
      new_rows = tile.new_rows[:, None]
      p = jnp.where(new_rows, jnp.exp(tile.s - lse_i[..., None]), 0.0)
      dv_j = dv_j + jnp.einsum("bhgqk,bqhgd->bkhd", p.astype(q.dtype), d_out_i.astype(q.dtype),
                               preferred_element_type=jnp.float32)
      dp = jnp.einsum("bqhgd,bkhd->bhgqk", d_out_i.astype(q.dtype), tile.v,
                      preferred_element_type=jnp.float32)
      ds = p * (dp - delta_i[..., None])
      dq_i = jnp.einsum("bhgqk,bkhd->bqhgd", ds.astype(q.dtype), tile.k,
                        preferred_element_type=jnp.float32) * scale
      dq = _add_at(dq, dq_i, tile.q_start, 1)
      dk_j = dk_j + jnp.einsum("bhgqk,bqhgd->bkhd", ds.astype(q.dtype), tile.q,
                               preferred_element_type=jnp.float32) * scale
      if dbias is not None:
        summed = tuple(a for a in range(5) if bias.shape[a] == 1 and ds.shape[a] > 1)
        d_tile = jnp.sum(ds, axis=summed, keepdims=True)
        dbias = _add_tile(dbias, d_tile, tile.q_start, tile.k_start)
      return dq, dk_j, dv_j, dbias

    zeros = _zeros((q.shape[0], bk, *k.shape[2:]), *like)
    dq, dk_j, dv_j, dbias = lax.fori_loop(begin, nq, query_block, (dq, zeros, zeros, dbias))
    k_start = _start(j, bk, k_seq)   # keys shared with the block before got no gradient here
    return dq, _add_at(dk, dk_j, k_start, 1), _add_at(dv, dv_j, k_start, 1), dbias

  like = (q, k, v, mask, bias, q_offset, k_offset, d_out, d_lse)
  dq, dk, dv = (_zeros(x.shape, *like) for x in (q, k, v))
  dbias = None if bias is None else _zeros(bias.shape, *like)
  dq, dk, dv, dbias = lax.fori_loop(0, nk, key_block, (dq, dk, dv, dbias))
  dbias = None if bias is None else dbias.astype(bias.dtype)
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, dbias, None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)
