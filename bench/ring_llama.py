"""A hand-written context-parallel Llama step, what ``bench/long_context.py`` holds epljax's
``context.parallel_degree`` against: the zoo's Llama as plain jax functions, its attention a
``shard_map`` ring written here.

What a JAX user writes for long sequences (Megatron's ``--context-parallel-size`` layout):

- Mesh ``data x context`` (``context`` inner: the ring stays inside a host where it fits).
  Parameters and optimizer state split over every device along their largest dimension
  (FSDP); each layer's kernels cast to bfloat16 and gathered inside the rematerialized layer.
- The batch arrives already in zig-zag order, as Megatron's data loader cuts it
  (``get_batch_on_this_cp_rank``): the sequence in ``2k`` halves, device ``c`` holding halves
  ``c`` and ``2k - 1 - c``, the rotary positions given in the same order. So the causal work is
  balanced and the attention moves nothing but the ring's keys and values; epljax instead keeps
  the model's sequence in order and reorders inside the attention (what that costs is the
  difference this bench measures).
- The ring: ``k - 1`` ``ppermute`` steps of the keys and values; at each step two half-blocks
  of work (``epl.nn.attention_block``, the library's blockwise kernel, merged by
  ``epl.nn.merge_partials``: the per-block arithmetic is shared so that only the parallel
  program differs).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import epljax as epl
import hand_layouts
from hand_layouts import Figures

BATCH_AXES, CTX = "data", "context"


def zigzag_positions(length: int, k: int) -> np.ndarray:
  """Positions of a sequence in zig-zag order: halves ``c, 2k - 1 - c`` for c = 0 .. k-1."""
  half = length // (2 * k)
  order = [m for c in range(k) for m in (c, 2 * k - 1 - c)]
  return np.concatenate([np.arange(m * half, (m + 1) * half) for m in order]).astype(np.int32)


def ring_attention(q, k, v, *, mesh: Mesh):
  """Causal attention of zig-zag-ordered ``q`` ``[b, s, heads, d]`` over ``k``/``v``
  ``[b, s, kv_heads, d]`` (q already scaled), the sequence split over ``context``."""
  n = mesh.shape[CTX]
  spec = P(BATCH_AXES, CTX, None, None)
  block, merge = epl.nn.attention_block, epl.nn.merge_partials

  def body(q, k, v):
    c = jax.lax.axis_index(CTX)
    half = q.shape[1] // 2
    q0, q1 = q[:, :half], q[:, half:]
    late = (2 * n - 1 - c) * half

    def part(qs, ks, vs, *, causal=False, qo=0, ko=0):
      return block(qs, ks, vs, q_offset=qo, k_offset=ko, causal=causal, scale=1.0)

    # Own halves: early x early and late x late on the diagonal, late x early in full.
    acc0 = part(q0, k[:, :half], v[:, :half], causal=True, qo=c * half, ko=c * half)
    acc1 = merge(*part(q1, k[:, :half], v[:, :half]),
                 *part(q1, k[:, half:], v[:, half:], causal=True, qo=late, ko=late))
    kv = (k, v)
    for t in range(1, n):
      kv = jax.lax.ppermute(kv, CTX, [(i, (i + 1) % n) for i in range(n)])
      ks, vs = kv
      k0, v0, k1, v1 = ks[:, :half], vs[:, :half], ks[:, half:], vs[:, half:]
      earlier = (c - t) % n < c
      acc1 = merge(*acc1, *part(q1, k0, v0))       # the late queries see an early half
      # From an earlier device the early queries see its early half; from a later one the
      # late queries see its late half.
      out, lse = part(jnp.where(earlier, q0, q1), jnp.where(earlier, k0, k1),
                      jnp.where(earlier, v0, v1))
      skip = jnp.full_like(lse, -jnp.inf)
      acc0 = merge(*acc0, out, jnp.where(earlier, lse, skip))
      acc1 = merge(*acc1, out, jnp.where(earlier, skip, lse))
    return jnp.concatenate([acc0[0], acc1[0]], axis=1).astype(q.dtype)

  return jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec,
                       check_vma=False)(q, k, v)


def _layer(size, mesh: Mesh, positions):
  """One rematerialized Llama layer ``(h, params) -> h``: the zoo model's arithmetic."""
  from example_models.layers import rms_norm, rope

  s = size
  whole = NamedSharding(mesh, P())

  def layer(h, p):
    p = jax.tree.map(lambda w: jax.lax.with_sharding_constraint(w.astype(s.dtype), whole), p)
    a = p["attn"]
    x = rms_norm(h.astype(jnp.float32), p["attn_norm"]["scale"]).astype(s.dtype)
    q = jnp.einsum("btd,dhk->bthk", x, a["query"]["kernel"])
    k = jnp.einsum("btd,dhk->bthk", x, a["key"]["kernel"])
    v = jnp.einsum("btd,dhk->bthk", x, a["value"]["kernel"])
    q = (rope(q, positions) * s.head_dim ** -0.5).astype(s.dtype)
    k = rope(k, positions).astype(s.dtype)
    out = ring_attention(q, k, v, mesh=mesh)
    h = h + jnp.einsum("bthk,hkd->btd", out, a["out"]["kernel"])
    m = p["mlp"]
    x = rms_norm(h.astype(jnp.float32), p["mlp_norm"]["scale"]).astype(s.dtype)
    gate, up = x @ m["wi_gate"]["kernel"], x @ m["wi_up"]["kernel"]
    return h + (jax.nn.silu(gate) * up) @ m["wo"]["kernel"]

  return jax.checkpoint(layer, prevent_cse=False)


def loss_fn(size, mesh: Mesh, length: int):
  """The Llama's loss over zig-zag-ordered rows (the mean over tokens ignores the order)."""
  from example_models.layers import lm_loss, rms_norm

  s = size
  positions = jnp.asarray(zigzag_positions(length, mesh.shape[CTX]))
  layer = _layer(size, mesh, positions)
  rows = NamedSharding(mesh, P(BATCH_AXES, CTX, None))

  def loss(variables, batch):
    params = variables["params"]
    x = params["embed"]["embedding"].astype(s.dtype)[batch["x"]]
    x = jax.lax.with_sharding_constraint(x, rows)
    x, _ = jax.lax.scan(lambda h, p: (layer(h, p), None), x, params["layers"])
    x = rms_norm(x.astype(jnp.float32), params["final_norm"]["scale"]).astype(s.dtype)
    logits = (x @ params["head"]["kernel"].astype(s.dtype)).astype(jnp.float32)
    return lm_loss(logits, batch["y"])

  return loss


def ring(size, optimizer, variables, batch, devices: list, context: int) -> Figures:
  """The hand step on ``devices`` (``len / context`` data x ``context``), compiled: parameters
  and optimizer state FSDP over every device, rows over ``data``, sequence over ``context``,
  the state donated. Returns ``(Figures, the compiled step, its mesh)``."""
  import optax

  from common import hand_step

  mesh = Mesh(np.asarray(devices).reshape(-1, context), (BATCH_AXES, CTX))
  params = variables["params"]
  n = len(devices)
  param_sh = jax.tree.map(
      lambda x: NamedSharding(mesh, _flat(hand_layouts.fsdp_spec(x.shape, n))), params)
  opt_shape = jax.eval_shape(optimizer.init, params)
  opt_sh = optax.tree_map_params(optimizer, lambda _, s: s, opt_shape, param_sh,
                                 transform_non_params=lambda _: NamedSharding(mesh, P()))
  state_sh = (param_sh, opt_sh)
  state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                       (params, opt_shape), state_sh)
  rows = NamedSharding(mesh, P(BATCH_AXES, CTX))
  batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rows), batch)
  step = jax.jit(hand_step(loss_fn(size, mesh, batch["x"].shape[1]), optimizer),
                 out_shardings=(state_sh, NamedSharding(mesh, P())), donate_argnums=0)
  start = time.perf_counter()
  compiled = step.lower(state, batch).compile()
  return Figures.of(compiled, time.perf_counter() - start), compiled, mesh


def _flat(spec: P) -> P:
  """``fsdp_spec``'s ``data`` as both mesh axes (FSDP over every device)."""
  return P(*[(BATCH_AXES, CTX) if a == "data" else a for a in spec])
