"""The single-device building blocks of attention: ``attention_block`` (queries against one
block of keys/values, ``(out, lse)``), ``merge_partials`` (two such results into one, exactly),
and the checks and layouts that ``dot_product_attention`` (``attention.py``) and context
parallelism (``context.py``) share. The kernel itself is ``flash.py``'s.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from epljax.errors import PlanError
from epljax.nn import flash

SHAPES = ("q, k and v are [batch, seq, heads, head_dim] with k and v of one shape, the same "
           "batch and head_dim as q, and q's heads a multiple of k's (grouped-query attention)")


def attention_block(q, k, v, *, q_offset, k_offset, causal: bool, scale: float | None,
                    mask=None, bias=None) -> tuple[jax.Array, jax.Array]:
  """``q`` against one block of keys/values: ``(out, lse)`` to be merged with other blocks.

  The building block of context parallelism (``epljax/nn/context.py``): a device holding a
  chunk of the queries computes them against each chunk of keys/values it sees, and
  ``merge_partials`` combines the results exactly.

  - Shapes, ``mask``, ``bias`` and ``scale`` (``None``: ``1 / sqrt(head_dim)``) as in
    ``dot_product_attention``; mask and bias cover this block's ``[q_seq, kv_seq]`` only.
  - ``q_offset``, ``k_offset``: absolute positions (ints or int32 scalars, may be traced) of
    the first query and first key here; the causal mask compares ``q_offset + i`` with
    ``k_offset + j``, and tiles wholly above the diagonal are skipped.
  - ``out``: ``[batch, q_seq, heads, head_dim]`` float32, attention normalized over this
    block's keys only; ``lse``: ``[batch, heads, q_seq]`` float32, the log-sum-exp of the
    scaled scores, ``-inf`` (and ``out`` 0) where a row saw no key.

  Differentiable in ``q``, ``k``, ``v`` (and ``bias``), cotangents on ``lse`` included, in
  memory linear in the block (the kernel of ``dot_product_attention``, without cuDNN).
  """
  q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
  groups = check_qkv(q, k, v)
  return blockwise(q, k, v, groups, as_5d(mask, "mask", q, k), as_5d(bias, "bias", q, k),
                    q_offset, k_offset, causal, default_scale(scale, q))


def merge_partials(out_a, lse_a, out_b, lse_b) -> tuple[jax.Array, jax.Array]:
  """Attention over keys A and B from attention over A and over B: ``(out, lse)``.

  ``out_*``: ``[batch, q_seq, heads, head_dim]``, ``lse_*``: ``[batch, heads, q_seq]`` as
  ``attention_block`` returns them. Exact (each side reweighted by ``exp(lse_side - lse)``),
  associative, and a row that saw no key on one side (``lse = -inf``) takes the other side
  as it is; on both sides, it stays 0 with ``lse = -inf``. Gradients stay finite there too.
  """
  top = lax.stop_gradient(jnp.maximum(lse_a, lse_b))   # the result does not depend on it
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  weight_a, weight_b = jnp.exp(lse_a - top), jnp.exp(lse_b - top)
  total = weight_a + weight_b
  seen = total > 0
  total = jnp.where(seen, total, 1.0)
  lse = jnp.where(seen, top + jnp.log(total), -jnp.inf)

  def rows(weight):   # [batch, heads, q_seq] -> [batch, q_seq, heads, 1]
    return jnp.transpose(weight / total, (0, 2, 1))[..., None]

  out = rows(weight_a) * out_a + rows(weight_b) * out_b
  return out, lse


def blockwise(q, k, v, groups, mask5, bias5, q_offset, k_offset, causal, scale,
               block_q=None, block_k=None):
  """The XLA kernel on the public layouts: ``(out [b, q_seq, heads, d] float32, lse [b, heads,
  q_seq] float32)``. ``block_q``/``block_k``: the tile, ``flash.block_size`` by default."""
  batch, q_seq, heads, dim = q.shape
  q5 = q.reshape(batch, q_seq, heads // groups, groups, dim)
  out, lse = flash.blockwise_attention(
      q5, k, v, mask5, bias5, q_offset, k_offset, causal=causal, scale=scale,
      block_q=block_q or flash.block_size(q_seq), block_k=block_k or flash.block_size(k.shape[1]))
  return out.reshape(q.shape), lse.reshape(batch, heads, q_seq)


def check_qkv(q, k, v) -> int:
  """Grouped-query factor ``heads // kv_heads`` of valid shapes; a PlanError otherwise."""
  shapes = f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise PlanError(f"dot_product_attention: {SHAPES}; {shapes} (add a heads axis of 1 for "
                    "single-head attention).")
  if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
    raise PlanError(f"dot_product_attention: {SHAPES}; {shapes}.")
  if q.shape[2] % k.shape[2]:
    raise PlanError(f"dot_product_attention: {q.shape[2]} query heads are not a multiple of "
                    f"{k.shape[2]} key/value heads ({shapes}); grouped-query attention needs "
                    "heads = kv_heads x groups.")
  return q.shape[2] // k.shape[2]


def default_scale(scale, q) -> float:
  return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def as_5d(x, name: str, q, k):
  """A mask or bias broadcastable to ``[batch, heads, q_seq, kv_seq]`` as the kernel's
  ``[b, kv_heads, groups, q_seq, kv_seq]``, each axis full or 1; None stays None."""
  if x is None:
    return None
  x = jnp.asarray(x)
  batch, q_seq, heads, _ = q.shape
  target = (batch, heads, q_seq, k.shape[1])
  shape = (1,) * (4 - x.ndim) + tuple(x.shape)
  if x.ndim > 4 or any(n not in (1, t) for n, t in zip(shape, target)):
    raise PlanError(f"dot_product_attention: {name} of shape {tuple(x.shape)} does not "
                    f"broadcast to [batch, heads, q_seq, kv_seq] = {list(target)}; give each "
                    "axis its full size or 1.")
  if name == "mask" and x.dtype != jnp.bool_:
    raise PlanError(f"dot_product_attention: mask has dtype {x.dtype}; it is boolean (True = "
                    "attend). Pass additive scores as bias=.")
  kv_heads = k.shape[2]
  head_axes = (kv_heads, heads // kv_heads) if shape[1] == heads else (1, 1)
  return x.reshape(shape[0], *head_axes, *shape[2:])
