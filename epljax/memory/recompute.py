"""Rematerialization that survives every backend's optimizer: the CPU path of gradient
checkpointing for unrolled layers (see ``remat.run_segments`` for which path runs where).

``rematerialize(fn)`` keeps only ``fn``'s inputs; the backward pass recomputes ``fn`` and
differentiates it, its inputs tied to the incoming cotangents (``after``) so that nothing is
recomputed before it is needed. ``jax.checkpoint`` separates the recomputation with
optimization barriers, which the XLA:CPU pipeline expands before CSE merges the recomputation
back into the forward pass (``bench/memory.py --zoo``, GPT-2 blocks by hand with nn.remat:
1.00x less temp on jax 0.10, 1.80x on jax 0.11; this path 2.5x on both). On CPU the tie is a
select on one element of a cotangent, which XLA cannot fold (one scalar read per block: with
the cotangent split over ``data``, a scalar all-reduce per block, on CPU only); elsewhere an
optimization barrier over (inputs, cotangents).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp


def rematerialize(fn: Callable[..., Sequence[Any]], *, platform: str) -> Callable[..., list]:
  """``fn(*vals) -> list of outputs``, recomputed in the backward pass after its cotangents."""

  @jax.custom_vjp
  def remat(*vals):
    return list(fn(*vals))

  def fwd(*vals):
    return list(fn(*vals)), vals

  def bwd(vals, cts):
    vals = after(vals, cts, platform=platform)
    _, pullback = jax.vjp(lambda *v: list(fn(*v)), *vals)
    return pullback(cts)

  remat.defvjp(fwd, bwd)
  return remat


def after(vals: Sequence[Any], cts: Any, *, platform: str) -> tuple:
  """``vals``, made to depend on the float cotangents ``cts`` (see the module docstring)."""
  floats = [c for c in jax.tree.leaves(cts)
            if hasattr(c, "dtype") and jnp.issubdtype(c.dtype, jnp.inexact)]
  vals = tuple(vals)
  if not floats:
    return vals
  vals, _ = jax.lax.optimization_barrier((vals, floats))
  if platform != "cpu":
    return tuple(vals)
  first = floats[0]
  if not first.size:
    return tuple(vals)
  # Its first element, sliced in place: a ravel would gather a model-split cotangent whole.
  probe = jax.lax.slice(first, (0,) * first.ndim, (1,) * first.ndim).reshape(())
  live = probe == probe          # False only for NaN: XLA cannot fold it
  return tuple(_select(live, v) for v in vals)


def refetch(stored: Sequence[Any], cts: Any, *, platform: str) -> tuple:
  """The stored parameters (ZeRO shard, host copy) a backward pass places again, kept apart
  from the forward pass's placed copies so no compiler merges the two and keeps the placed
  weight alive in between.

  - CPU: tied to the cotangents (``after``): XLA:CPU expands optimization barriers before its
    CSE and would otherwise merge them (the measured need of the module docstring).
  - GPU and TPU: an optimization barrier over the stored values alone. The all-gather or
    host-to-device copy then depends on nothing the backward pass computes, so the latency
    hiding scheduler can start it ahead of its use, overlapped with the previous layer's
    backward (how far ahead is the scheduler's choice, bounded by its memory limit).
  """
  if platform == "cpu":
    return after(stored, cts, platform=platform)
  return tuple(jax.lax.optimization_barrier(tuple(stored)))


def _select(flag, v):
  if not hasattr(v, "dtype") or v.size == 0:
    return v
  if getattr(jax.typeof(v), "memory_space", jax.memory.Space.Device) != jax.memory.Space.Device:
    return v   # a host value is only copied in, never recomputed from

  if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key):
    data = jax.random.key_data(v)
    return jax.random.wrap_key_data(jnp.where(flag, data, jnp.zeros_like(data)),
                                    impl=jax.random.key_impl(v))
  if v.dtype == jax.dtypes.float0:
    return v
  return jnp.where(flag, v, jnp.zeros_like(v))
