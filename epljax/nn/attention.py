"""Dot-product attention in memory linear in the sequence, and the two building blocks context
parallelism composes it from (``attention_block``, ``merge_partials``).

On NVIDIA GPUs, bfloat16/float16 attention without a mask or bias runs cuDNN's fused flash
attention (``jax.nn.dot_product_attention(implementation="cudnn")``); everything else runs the
blockwise XLA kernel of ``flash.py``. The choice is made when the program is lowered for its
devices' platform (``lax.platform_dependent``), so the same traced model compiles for CPUs and
for compile-only H100s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from epljax.nn import blocks, context

def dot_product_attention(q, k, v, *, causal: bool = False, mask=None, bias=None,
                          scale: float | None = None) -> jax.Array:
  """Softmax attention of ``q`` over ``k``/``v``, never holding the ``[q_seq, kv_seq]`` scores.

  ``jax.nn.dot_product_attention``'s shapes and numbers, in memory linear in the sequence:

  - ``q``: ``[batch, q_seq, heads, head_dim]``; ``k``, ``v``: ``[batch, kv_seq, kv_heads,
    head_dim]``. ``heads`` a multiple of ``kv_heads`` is grouped-query attention (query head
    ``h`` reads key/value head ``h // (heads // kv_heads)``).
  - ``causal``: query ``i`` sees keys ``j <= i`` (positions counted from 0 in both, as jax's
    ``is_causal``).
  - ``mask``: boolean, broadcastable to ``[batch, heads, q_seq, kv_seq]``, True = attend.
  - ``bias``: added to the scores, same broadcast (its gradient is computed too).
  - ``scale``: a Python number that multiplies the scores, ``1 / sqrt(head_dim)`` by default.

  Returns ``[batch, q_seq, heads, head_dim]`` in ``q``'s dtype; the softmax statistics are
  float32. A query row that sees no key (everything masked) gets zeros.

  How: the scores are computed one ``[512, 512]`` tile at a time with an online softmax, and
  the backward (a ``jax.custom_vjp``) recomputes each tile from the saved log-sum-exp
  (FlashAttention-2), so forward and backward hold O(seq) bytes, and causal tiles above the
  diagonal cost nothing. A full ``[.., q_seq, kv_seq]`` mask or bias is read a tile at a time.
  On NVIDIA GPUs, bfloat16/float16 inputs with ``head_dim`` a multiple of 8 up to 128, no mask
  and no bias (and ``q_seq == kv_seq`` when causal) run cuDNN's fused attention instead.

  >>> q = jnp.ones((2, 4096, 8, 64), jnp.bfloat16)      # doctest: +SKIP
  >>> k = v = jnp.ones((2, 4096, 2, 64), jnp.bfloat16)  # 2 key/value heads: GQA
  >>> epl.nn.dot_product_attention(q, k, v, causal=True).shape
  (2, 4096, 8, 64)

  Under context parallelism (``context.parallel_degree``) the same call runs over the
  ``context`` mesh axis; ``attention_block`` and ``merge_partials`` are its parts.
  """
  q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
  groups = blocks.check_qkv(q, k, v)
  context.note_call()
  if context.current() is not None:   # context parallelism: over the "context" mesh axis
    return context.attention(q, k, v, causal=causal, mask=mask, bias=bias, scale=scale)
  scale = blocks.default_scale(scale, q)
  mask5 = blocks.as_5d(mask, "mask", q, k)
  bias5 = blocks.as_5d(bias, "bias", q, k)

  def blockwise(q, k, v):
    out, _ = blocks.blockwise(q, k, v, groups, mask5, bias5, 0, 0, causal, scale)
    return out.astype(q.dtype)

  if not _cudnn_fits(q, k, v, mask, bias, causal):
    return blockwise(q, k, v)

  def cudnn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                        implementation="cudnn")

  return lax.platform_dependent(q, k, v, cuda=cudnn, default=blockwise)


def _cudnn_fits(q, k, v, mask, bias, causal: bool) -> bool:
  """Whether cuDNN's fused attention takes these inputs (and jax has it: the CUDA plugin)."""
  try:
    from jax._src.lib import cuda_versions
  except ImportError:
    return False
  dim = q.shape[-1]
  return (cuda_versions is not None and mask is None and bias is None
          and q.dtype in (jnp.bfloat16, jnp.float16) and k.dtype == v.dtype == q.dtype
          and dim % 8 == 0 and dim <= 128 and (not causal or q.shape[1] == k.shape[1]))
