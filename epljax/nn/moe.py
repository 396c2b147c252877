"""A GShard / Switch mixture-of-experts feed-forward layer, written so that expert parallelism
is an all-to-all.

Tokens are routed in groups (one group per sequence): each group sends at most ``capacity``
tokens to each expert. With the experts' weights split over devices (``experts=epl.split(n)``,
EPL's MoE pattern: the weights are defined under the split scope, the routing outside) and the
groups split over the same devices by data parallelism, each token travels to its expert's
device and back with one all-to-all each way, and no device ever holds another device's
experts.

The all-to-alls are written out (a ``shard_map`` over the mesh epljax traces the step under)
because GSPMD, left to itself, prefers to all-gather the experts' weights. Outside epljax
(one device, or no ``model`` axis) the same layer is plain einsums with the same numbers.

>>> layer = MoE(num_experts=8, hidden=256, experts=epl.split(8))   # doctest: +SKIP
>>> y, aux_loss = layer(x)          # x: (batch, length, features)
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from epljax.errors import PlanError


def top_k_routing(probs: jax.Array, top_k: int, capacity: int) -> tuple[jax.Array, jax.Array]:
  """Dispatch and combine tensors ``(groups, tokens, experts, capacity)`` for top-k routing.

  A token's k-th choice queues behind every token's earlier choices (GShard); tokens past an
  expert's capacity are dropped (their combine weight is 0). Combine weights are the chosen
  experts' probabilities, renormalized over the k choices.
  """
  num_experts = probs.shape[-1]
  remaining = probs
  masks, gates = [], []
  for _ in range(top_k):
    choice = jnp.argmax(remaining, axis=-1)
    mask = jax.nn.one_hot(choice, num_experts, dtype=probs.dtype)   # (g, s, e)
    gates.append(jnp.sum(probs * mask, axis=-1))                      # (g, s)
    masks.append(mask)
    remaining = remaining * (1 - mask)
  norm = sum(gates) + 1e-9
  dispatch = jnp.zeros((*probs.shape, capacity), probs.dtype)
  combine = jnp.zeros_like(dispatch)
  filled = jnp.zeros(probs.shape[:1] + probs.shape[2:], probs.dtype)  # (g, e) so far
  for mask, gate in zip(masks, gates):
    position = (jnp.cumsum(mask, axis=1) - 1 + filled[:, None, :]) * mask   # (g, s, e)
    keep = mask * (position < capacity)
    slot = jax.nn.one_hot(position.astype(jnp.int32), capacity, dtype=probs.dtype)
    dispatch = dispatch + keep[..., None] * slot
    combine = combine + (keep * (gate / norm)[..., None])[..., None] * slot
    filled = filled + jnp.sum(mask, axis=1)
  return dispatch, combine


def _experts(expert_in, w_in, w_out):
  hidden = nn.relu(jnp.einsum("egcd,edf->egcf", expert_in, w_in))
  return jnp.einsum("egcf,efd->egcd", hidden, w_out)


def _expert_parallel_axes(experts, num_experts: int, groups: int):
  """(expert axis, group axes) when the step is traced over a mesh with a ``model`` axis the
  experts are split over; None otherwise (plain einsums)."""
  mesh = jax.sharding.get_abstract_mesh()
  if experts is None or getattr(experts, "kind", None) != "split" or mesh.empty:
    return None
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  if sizes.get("model", 1) == 1:
    return None
  group_axes = tuple(a for a in ("replica", "data", "model") if a in sizes)
  devices = math.prod(sizes[a] for a in group_axes)
  if num_experts % sizes["model"] or groups % devices:
    raise PlanError(
        f"MoE: {num_experts} experts over a model axis of {sizes['model']} devices and "
        f"{groups} groups (sequences in the micro batch) over {devices} devices "
        f"({' x '.join(f'{a}={sizes[a]}' for a in group_axes)}): both must divide. Use a "
        "number of experts and a batch that are multiples of the device counts.")
  return "model", group_axes


def _experts_all_to_all(expert_in, w_in, w_out, expert_axis: str, group_axes: tuple[str, ...]):
  """The experts with tokens moved by all-to-all: each device computes its own experts on the
  tokens every device routed to them."""

  def local(tokens, w1, w2):
    # (experts, my groups, c, d) -> (my experts, groups of my expert group, c, d)
    tokens = jax.lax.all_to_all(tokens, expert_axis, 0, 1, tiled=True)
    out = _experts(tokens, w1, w2)
    return jax.lax.all_to_all(out, expert_axis, 1, 0, tiled=True)

  tokens_spec = P(None, group_axes)
  return jax.shard_map(local, in_specs=(tokens_spec, P(expert_axis), P(expert_axis)),
                       out_specs=tokens_spec)(expert_in, w_in, w_out)


class MoE(nn.Module):
  """Mixture-of-experts MLP: ``x (batch, length, features) -> (y, load-balancing loss)``."""
  num_experts: int
  hidden: int
  top_k: int = 2
  capacity_factor: float = 1.25
  experts: Any = None          # a strategy for the experts' weights, e.g. epl.split(8)
  kernel_init: Any = nn.initializers.lecun_normal()

  @nn.compact
  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    groups, tokens, features = x.shape
    e = self.num_experts
    capacity = max(1, math.ceil(tokens * self.top_k * self.capacity_factor / e))
    gate = self.param("gate", self.kernel_init, (features, e))
    with self.experts if self.experts is not None else contextlib.nullcontext():
      w_in = self.param("w_in", nn.initializers.variance_scaling(1.0, "fan_in", "normal",
                                                                   in_axis=1, out_axis=2),
                        (e, features, self.hidden))
      w_out = self.param("w_out", nn.initializers.variance_scaling(1.0, "fan_in", "normal",
                                                                    in_axis=1, out_axis=2),
                         (e, self.hidden, features))
    probs = jax.nn.softmax(jnp.einsum("gsd,de->gse", x, gate).astype(jnp.float32))
    dispatch, combine = top_k_routing(probs, self.top_k, capacity)
    expert_in = jnp.einsum("gsec,gsd->egcd", dispatch.astype(x.dtype), x)
    axes = _expert_parallel_axes(self.experts, e, groups)
    if axes is None:
      expert_out = _experts(expert_in, w_in, w_out)
    else:
      expert_out = _experts_all_to_all(expert_in, w_in, w_out, *axes)
    y = jnp.einsum("gsec,egcd->gsd", combine.astype(x.dtype), expert_out)
    # Switch Transformer's auxiliary loss: experts' token share times their mean probability.
    share = jnp.mean(jax.nn.one_hot(jnp.argmax(probs, -1), e), axis=1)
    aux = e * jnp.mean(jnp.sum(share * jnp.mean(probs, axis=1), axis=-1))
    return y, aux
