"""epl.nn.dot_product_attention and its building blocks against the naive einsum-softmax
attention: values and gradients, float32 1e-5; memory linear in the sequence, read from the
compiled program; cuDNN's fused attention in the program compiled for compile-only H100s."""

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import epljax as epl
from epljax.nn import blocks, flash

TOL = dict(rtol=1e-5, atol=1e-5)


def naive(q, k, v, causal=False, mask=None, bias=None, scale=None):
  """The whole score matrix, float32: the reference."""
  groups = q.shape[2] // k.shape[2]
  k, v = (jnp.repeat(x.astype(jnp.float32), groups, axis=2) for x in (k, v))
  scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
  s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k) * scale
  if bias is not None:
    s = s + bias
  keep = jnp.ones(s.shape, bool)
  if causal:
    keep = keep & jnp.tril(jnp.ones(s.shape[-2:], bool))
  if mask is not None:
    keep = keep & mask
  p = jax.nn.softmax(jnp.where(keep, s, -jnp.inf), axis=-1)
  return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def inputs(seed, batch, q_seq, kv_seq, heads, kv_heads, dim=8, dtype=jnp.float32):
  r = np.random.default_rng(seed)
  q = r.normal(size=(batch, q_seq, heads, dim))
  k, v = (r.normal(size=(batch, kv_seq, kv_heads, dim)) for _ in range(2))
  weights = r.normal(size=(batch, q_seq, heads, dim))   # a loss that reaches every output
  return [jnp.asarray(x, dtype) for x in (q, k, v)] + [jnp.asarray(weights, jnp.float32)]


def value_and_grads(fn, q, k, v, weights, bias=None):
  """One program: the output and the gradients of sum(out * weights) in q, k, v (and bias)."""
  def loss(q, k, v, bias):
    out = fn(q, k, v, bias)
    return jnp.sum(out.astype(jnp.float32) * weights), out
  argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums, has_aux=True))(q, k, v, bias)
  return out, grads


# (name, batch, q_seq, kv_seq, heads, kv_heads, causal, mask, bias, scale, block_q, block_k)
CASES = [
    ("plain", 2, 16, 16, 2, 2, False, False, False, None, 8, 8),
    ("causal", 2, 16, 16, 2, 2, True, False, False, None, 8, 4),
    ("gqa_causal", 1, 16, 16, 4, 2, True, False, False, None, 4, 8),
    ("multi_query", 2, 8, 8, 4, 1, False, False, False, None, 4, 4),
    ("mask", 2, 12, 12, 2, 2, False, True, False, None, 4, 4),
    ("bias", 1, 12, 12, 4, 2, False, False, True, None, 4, 8),
    ("scale", 1, 8, 8, 2, 2, True, False, False, 0.3, 4, 4),
    ("q_seq_neq_kv_seq", 2, 12, 20, 2, 1, True, False, False, None, 4, 8),
    ("not_a_multiple", 2, 13, 11, 4, 2, True, True, True, None, 4, 3),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_blockwise_equals_the_naive_attention(case):
  """Several tiles per sequence (small blocks), the last one overlapping where the sequence is
  not a multiple of the block: forward and backward equal the whole-matrix reference."""
  _, batch, q_seq, kv_seq, heads, kv_heads, causal, masked, biased, scale, bq, bk = case
  q, k, v, weights = inputs(0, batch, q_seq, kv_seq, heads, kv_heads)
  r = np.random.default_rng(1)
  mask = bias = None
  if masked:   # [batch, 1, q_seq, kv_seq], every row keeps key 0 (no empty rows)
    mask = jnp.asarray(r.random((batch, 1, q_seq, kv_seq)) > 0.4).at[..., 0].set(True)
  if biased:
    bias = jnp.asarray(r.normal(size=(1, heads, q_seq, kv_seq)), jnp.float32)

  def blockwise(q, k, v, bias):
    mask5, bias5 = (blocks.as_5d(x, n, q, k) for x, n in ((mask, "mask"), (bias, "bias")))
    scale_ = blocks.default_scale(scale, q)
    return blocks.blockwise(q, k, v, heads // kv_heads, mask5, bias5, 0, 0, causal, scale_,
                                bq, bk)[0]

  out, grads = value_and_grads(blockwise, q, k, v, weights, bias)
  want, want_grads = value_and_grads(
      lambda q, k, v, bias: naive(q, k, v, causal, mask, bias, scale), q, k, v, weights, bias)
  np.testing.assert_allclose(out, want, **TOL)
  for got, expected in zip(grads, want_grads):
    np.testing.assert_allclose(got, expected, **TOL)


def test_the_public_function_with_mask_bias_and_gqa_equals_the_naive_attention():
  q, k, v, weights = inputs(2, 2, 24, 24, 4, 2)
  mask = jnp.asarray(np.random.default_rng(3).random((2, 1, 1, 24)) > 0.3).at[..., 0].set(True)
  bias = jnp.asarray(np.random.default_rng(4).normal(size=(4, 24, 24)), jnp.float32)
  out, grads = value_and_grads(lambda q, k, v, b: epl.nn.dot_product_attention(
      q, k, v, causal=True, mask=mask, bias=b), q, k, v, weights, bias)
  want, want_grads = value_and_grads(lambda q, k, v, b: naive(q, k, v, True, mask, b),
                                     q, k, v, weights, bias)
  assert out.dtype == jnp.float32 and out.shape == q.shape
  np.testing.assert_allclose(out, want, **TOL)
  for got, expected in zip(grads, want_grads):
    np.testing.assert_allclose(got, expected, **TOL)


def test_bfloat16_inputs_give_a_bfloat16_output_close_to_float32():
  q, k, v, weights = inputs(5, 2, 32, 32, 4, 2, dim=16, dtype=jnp.bfloat16)
  out, grads = value_and_grads(
      lambda q, k, v, _: epl.nn.dot_product_attention(q, k, v, causal=True), q, k, v, weights)
  want, want_grads = value_and_grads(lambda q, k, v, _: naive(q, k, v, True), q, k, v, weights)
  assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
  np.testing.assert_allclose(out.astype(np.float32), want, rtol=2e-2, atol=2e-2)
  for got, expected in zip(grads, want_grads):
    scale = float(jnp.max(jnp.abs(expected.astype(jnp.float32))))
    np.testing.assert_allclose(got.astype(np.float32), expected.astype(np.float32),
                               atol=3e-2 * scale)


def test_blocks_cover_the_sequence_evenly():
  assert [flash.block_size(s) for s in (1, 12, 512, 513, 600, 1024, 4096)] == \
      [1, 12, 512, 264, 304, 512, 512]


@pytest.mark.parametrize("causal", [False, True])
def test_blocks_merged_over_two_halves_of_the_keys_equal_full_attention(causal):
  """Context parallelism's parts: attention_block on each half of k/v (offsets traced, as on a
  device of a ring), merge_partials of the two == attention over all keys, values and
  gradients; under causal, the first query rows see nothing of the second half (lse -inf)."""
  q, k, v, weights = inputs(6, 2, 12, 12, 4, 2)
  half = 6

  def merged(q, k, v, first, second):
    a = epl.nn.attention_block(q, k[:, :half], v[:, :half], q_offset=first, k_offset=first,
                               causal=causal, scale=None)
    b = epl.nn.attention_block(q, k[:, half:], v[:, half:], q_offset=first, k_offset=second,
                               causal=causal, scale=None)
    out, lse = epl.nn.merge_partials(*a, *b)
    return jnp.sum(out * weights) + jnp.sum(lse), (out, lse, b[1])

  def reference(q, k, v, *_):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(k, 2, axis=2)) / np.sqrt(q.shape[-1])
    s = jnp.where(jnp.tril(jnp.ones((12, 12), bool)), s, -jnp.inf) if causal else s
    out, lse = naive(q, k, v, causal), jax.nn.logsumexp(s, axis=-1)
    return jnp.sum(out * weights) + jnp.sum(lse), (out, lse, lse)

  @jax.jit
  def both(q, k, v, first, second):   # one program: offsets traced, as on a ring's device
    return [jax.grad(fn, (0, 1, 2), has_aux=True)(q, k, v, first, second)
            for fn in (merged, reference)]

  (grads, (out, lse, second_lse)), (want_grads, (want, want_lse, _)) = both(
      q, k, v, jnp.int32(0), jnp.int32(half))
  np.testing.assert_allclose(out, want, **TOL)
  np.testing.assert_allclose(lse, want_lse, **TOL)
  assert bool(jnp.all(jnp.isinf(second_lse[:, :, :half]))) == causal
  for got, expected in zip(grads, want_grads):
    np.testing.assert_allclose(got, expected, **TOL)


def test_attention_block_in_a_shard_map_with_offsets_from_the_axis_index():
  """Each of 4 devices attends its chunk of queries to all keys, the causal mask placed by
  ``q_offset = axis_index * chunk`` (check_vma on: the kernel's loop carries vary as its
  inputs do): the chunks put together are causal attention, values and gradients."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("context",))
  q, k, v, weights = inputs(10, 1, 16, 16, 2, 1)
  P = jax.sharding.PartitionSpec

  def local(q, k, v):
    offset = jax.lax.axis_index("context") * 4
    return epl.nn.attention_block(q, k, v, q_offset=offset, k_offset=0, causal=True,
                                  scale=None)[0]

  def loss(fn, q, k, v):
    return jnp.sum(fn(q, k, v) * weights)

  split = jax.shard_map(local, mesh=mesh, in_specs=(P(None, "context"), P(), P()),
                        out_specs=P(None, "context"))
  got = jax.jit(jax.value_and_grad(functools.partial(loss, split), (0, 1, 2)))(q, k, v)
  want = jax.jit(jax.value_and_grad(functools.partial(
      loss, lambda q, k, v: naive(q, k, v, True)), (0, 1, 2)))(q, k, v)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, **TOL)


def test_merging_rows_that_saw_no_key_keeps_zeros_and_finite_gradients():
  q, k, v, weights = inputs(7, 1, 4, 4, 2, 2)

  def empty(q, k, v):   # queries 0..3 against keys 4..7: nothing to see under causal
    return epl.nn.attention_block(q, k, v, q_offset=0, k_offset=4, causal=True, scale=None)

  def loss(q, k, v):
    both, both_lse = epl.nn.merge_partials(*empty(q, k, v), *empty(q, k, v))
    return jnp.sum(both * weights), (empty(q, k, v), both, both_lse)

  grads, ((out, lse), both, both_lse) = jax.jit(jax.grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
  assert float(jnp.max(jnp.abs(out))) == 0 and bool(jnp.all(lse == -jnp.inf))
  assert float(jnp.max(jnp.abs(both))) == 0 and bool(jnp.all(both_lse == -jnp.inf))
  assert all(bool(jnp.all(g == 0)) for g in grads)


def test_bad_shapes_are_refused_with_the_shapes_and_the_fix():
  q, k, v, _ = inputs(8, 1, 4, 4, 3, 2)
  with pytest.raises(epl.PlanError, match=r"3 query heads are not a multiple of 2 key/value "
                     r"heads \(got q \(1, 4, 3, 8\), k \(1, 4, 2, 8\)"):
    epl.nn.dot_product_attention(q, k, v)
  q, k, v, _ = inputs(8, 1, 4, 4, 2, 2)
  with pytest.raises(epl.PlanError, match=r"\[batch, seq, heads, head_dim\].*got q \(1, 4, 16\)"):
    epl.nn.dot_product_attention(q.reshape(1, 4, 16), k, v)
  with pytest.raises(epl.PlanError, match=r"k and v of one shape.*v \(1, 3, 2, 8\)"):
    epl.nn.dot_product_attention(q, k, v[:, :3])
  with pytest.raises(epl.PlanError, match=r"mask of shape \(1, 2, 4, 5\) does not broadcast "
                     r"to \[batch, heads, q_seq, kv_seq\] = \[1, 2, 4, 4\]"):
    epl.nn.dot_product_attention(q, k, v, mask=jnp.ones((1, 2, 4, 5), bool))
  with pytest.raises(epl.PlanError, match=r"mask has dtype float32.*bias="):
    epl.nn.dot_product_attention(q, k, v, mask=jnp.ones((4, 4)))
  with pytest.raises(epl.PlanError, match=r"bias of shape \(3, 4, 4\) does not broadcast"):
    epl.nn.dot_product_attention(q, k, v, bias=jnp.ones((3, 4, 4)))


def test_batch_and_heads_split_over_devices_need_no_collective_inside_the_attention():
  """GSPMD with the batch over 2 devices and the heads over 4 (epl.split's layout for heads):
  same numbers as one device, and the only collectives left are the scalar loss's sums."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", None, "model"))
  q, k, v, weights = inputs(9, 2, 32, 32, 8, 4)

  def loss(q, k, v):
    out = blocks.blockwise(q, k, v, 2, None, None, 0, 0, True, 0.3, 8, 8)[0]
    return jnp.sum(out * weights)

  step = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))
  placed = [jax.device_put(x, split) for x in (q, k, v)]
  compiled = step.lower(*placed).compile()
  for got, want in zip(jax.tree.leaves(compiled(*placed)), jax.tree.leaves(step(q, k, v))):
    np.testing.assert_allclose(got, want, **TOL)
  assert {(c.kind, c.bytes) for c in epl.hlo.collectives(compiled.as_text())} == {
      ("all-reduce", 4)}


def _temp_bytes(fn, seq, heads=2, dim=16):
  x = jax.ShapeDtypeStruct((1, seq, heads, dim), jnp.float32)
  step = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v) ** 2), (0, 1, 2)))
  return step.lower(x, x, x).compile().memory_analysis().temp_size_in_bytes


def test_memory_grows_linearly_with_the_sequence_while_the_naive_grows_quadratically():
  """Temp bytes of the compiled value_and_grad at 256 and 1024 tokens (64-token tiles): the
  blockwise program's grow ~4x at most (1.7x on XLA:CPU, jax 0.10), the whole score matrix's
  ~16x (15.8x), so the test can fail."""
  def blockwise(q, k, v):
    return blocks.blockwise(q, k, v, 1, None, None, 0, 0, True, 0.25, 64, 64)[0]

  small, large = _temp_bytes(blockwise, 256), _temp_bytes(blockwise, 1024)
  naive_small, naive_large = (_temp_bytes(lambda q, k, v: naive(q, k, v, True), s)
                              for s in (256, 1024))
  assert large / small < 6, (small, large)
  assert naive_large / naive_small > 12, (naive_small, naive_large)
  assert large < naive_large / 20


def _has_cuda_plugin() -> bool:
  try:
    import jax_plugins.xla_cuda12  # noqa: F401
  except ImportError:
    return False
  return True


@pytest.mark.skipif(not _has_cuda_plugin(), reason=(
    "compile-only GPUs need jax's CUDA plugin: pip install -e '.[cuda12]'"))
def test_h100s_run_cudnn_fused_attention_for_bfloat16_and_the_blockwise_kernel_otherwise():
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  device = epl.topology("h100", hosts=1, per_host=1)[0]
  sharding = jax.sharding.SingleDeviceSharding(device)

  def compiled(dtype, seq, **kwargs):
    q = jax.ShapeDtypeStruct((1, seq, 4, 64), dtype, sharding=sharding)
    kv = jax.ShapeDtypeStruct((1, seq, 2, 64), dtype, sharding=sharding)
    step = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(epl.nn.dot_product_attention(
        q, k, v, causal=True, **kwargs).astype(jnp.float32)), (0, 1, 2)))
    text = step.lower(q, kv, kv).compile().as_text()
    return set(re.findall(r'custom_call_target="([^"]+)"', text)), " while(" in text

  assert compiled(jnp.bfloat16, 256) == ({"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"},
                                         False)
  # 1024 tokens: two 512-token tiles, so the kernel's loops stay loops
  assert compiled(jnp.float32, 1024) == (set(), True)
  assert compiled(jnp.bfloat16, 1024, bias=jnp.zeros((1024, 1024))) == (set(), True)
