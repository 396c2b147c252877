"""Communication options (``config.communication``) as features of the step.

GSPMD inserts the collectives of a data-parallel step: the gradient of a loss traced over the
whole batch is already the float32 mean over replicas. The options decide what is reduced, in
which precision, and what the compiler may do with the collectives:

- ``gradients_reduce_method``: ``"mean"`` is GSPMD's result; ``"sum"`` multiplies the gradients
  by the number of replicas, which is EPL's sum all-reduce of per-replica mean gradients.
- ``fp16``: each replica's gradients are multiplied by ``fp16_scale``, cast to float16 and
  all-reduced in float16 (an ``f16`` all-reduce in the compiled HLO), then cast back to their
  dtype and divided by ``fp16_scale`` and the number of replicas. Half the bytes on the wire;
  the result is float32's within float16's precision (about 1e-3 relative).
- ``clip_after_allreduce`` with ``Trainer(..., clip_norm=c)``: gradients are clipped to global
  norm ``c`` before the optimizer. ``True``: the clipping sees the reduced (global) gradients,
  like ``optax.clip_by_global_norm`` at the head of the optimizer. ``False`` (EPL's default):
  each replica clips its own gradients before the all-reduce, so the result is the mean of the
  clipped replica gradients. Clipping written inside the optax chain always sees the reduced
  gradients, whatever this key says.
- ``sparse_as_dense``: JAX gradients are always dense arrays (the gradient of a gather is a
  dense scatter-add), so this is accepted and changes nothing.
- ``num_communicators`` / ``max_splits``: mapped to XLA's options for overlapping and combining
  collectives (``compiler_options``), passed to the step's ``jax.jit``. They act on GPU; other
  backends accept and ignore them. EPL's default values leave XLA's own defaults in place.

``fp16`` and local clipping need each replica's own gradients, which a GSPMD step never has:
``replica_gradients`` then computes the gradients in a ``shard_map`` that is manual over the
``data`` axis (tensor-parallel axes stay with GSPMD), so each replica differentiates its rows
only, and the features reduce them explicitly. Statistics over the batch (BatchNorm) are then
taken per replica, as in EPL and Horovod, and float model state is averaged over replicas.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from epljax import step as step_lib
from epljax.config import CommunicationConfig
from epljax.errors import PlanError
from epljax.features import BuildContext, Feature, ForwardFn, GradientFn, loss_scale
from epljax.mesh import DATA, STAGE, data_axes
from epljax.sharding import constraints

# XLA's options for the two EPL keys (xla/debug_options_flags.cc).
OVERLAP_LIMIT = "xla_gpu_experimental_parallel_collective_overlap_limit"
COMBINE_BYTES = "xla_gpu_all_reduce_combine_threshold_bytes"


class ReduceSum(Feature):
  """``gradients_reduce_method="sum"``: gradients summed over replicas instead of averaged."""

  name = "reduce_sum"

  def gradients(self, fn: GradientFn, ctx: BuildContext) -> GradientFn:
    replicas = ctx.num_replicas

    def summed(params, model_state, micro, fstate):
      loss, aux, grads, new_state = fn(params, model_state, micro, fstate)
      return loss, aux, jax.tree.map(lambda g: g * replicas, grads), new_state

    return summed

  def describe(self) -> str:
    return "gradients summed over replicas (communication.gradients_reduce_method='sum')"


class ReplicaFeature(Feature):
  """A feature acting on each replica's own gradients, inside ``replica_gradients``."""

  def before_reduce(self, grads: Any, scale: Any) -> Any:
    """Transforms one replica's gradients (``scale``: the loss scale they carry, or None)."""
    return grads

  def reduce(self, grads: Any, replicas: int, scale: Any) -> Any | None:
    """The mean over the ``data`` axis, or None to leave it to the float32 default
    (``scale``: the loss scale the gradients carry, or None)."""
    return None


class HalfPrecisionReduce(ReplicaFeature):
  """``communication.fp16``: the gradient all-reduce runs in ``dtype``, pre-scaled."""

  name = "fp16_allreduce"

  def __init__(self, scale: float, dtype: Any = jnp.float16):
    self.scale = scale
    self.dtype = jnp.dtype(dtype)

  def reduce(self, grads: Any, replicas: int, scale: Any, axes: tuple[str, ...] = (DATA,)) -> Any:
    # Gradients that already carry a loss scale (mixed precision, up to 2**15) would overflow
    # float16 if multiplied by fp16_scale too: bring them to fp16_scale x the true gradient,
    # reduce, and give them back their loss scale for the feature that removes it.
    factor = self.scale if scale is None else self.scale / scale

    def one(g):
      half = jax.lax.psum((g * factor).astype(self.dtype), axes)
      return (half.astype(jnp.float32) / (factor * replicas)).astype(g.dtype)

    return jax.tree.map(one, grads)

  def describe(self) -> str:
    return (f"gradients all-reduced in {self.dtype.name}, multiplied by {self.scale} before "
            "and divided after (communication.fp16)")


class ClipByGlobalNorm(ReplicaFeature):
  """``Trainer(clip_norm=...)``: where the clipping sits follows ``clip_after_allreduce``."""

  name = "clip_by_global_norm"

  def __init__(self, max_norm: float, after_reduce: bool):
    self.max_norm = max_norm
    self.after_reduce = after_reduce

  def before_reduce(self, grads: Any, scale: Any) -> Any:
    return grads if self.after_reduce else clip_by_global_norm(grads, self.max_norm, scale)

  def gradients(self, fn: GradientFn, ctx: BuildContext) -> GradientFn:
    if not self.after_reduce:
      return fn

    def clipped(params, model_state, micro, fstate):
      loss, aux, grads, new_state = fn(params, model_state, micro, fstate)
      return loss, aux, clip_by_global_norm(grads, self.max_norm), new_state

    return clipped

  def describe(self) -> str:
    where = ("the reduced gradients" if self.after_reduce
             else "each replica's gradients, before the all-reduce")
    return (f"clip by global norm {self.max_norm}: {where} "
            f"(communication.clip_after_allreduce={self.after_reduce})")


class CollectiveOptions(Feature):
  """``num_communicators`` / ``max_splits`` -> XLA compiler options of the step (GPU)."""

  name = "collective_options"

  def __init__(self, num_communicators: int | None, max_splits: int | None):
    self.num_communicators = num_communicators
    self.max_splits = max_splits

  def compiler_options(self, params_shape: Any) -> dict[str, int]:
    out = {}
    if self.num_communicators is not None:
      out[OVERLAP_LIMIT] = self.num_communicators
    if self.max_splits is not None:
      total = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
                  for x in jax.tree.leaves(params_shape))
      out[COMBINE_BYTES] = max(1, math.ceil(total / self.max_splits))
    return out

  def describe(self) -> str:
    parts = []
    if self.num_communicators is not None:
      parts.append(f"{OVERLAP_LIMIT}={self.num_communicators} (communication.num_communicators)")
    if self.max_splits is not None:
      parts.append(f"{COMBINE_BYTES}=gradient bytes / {self.max_splits} "
                   "(communication.max_splits)")
    return "XLA options, GPU only: " + ", ".join(parts)


class SparseAsDense(Feature):
  """``communication.sparse_as_dense``: accepted; JAX gradients are dense already."""

  name = "sparse_as_dense"

  def describe(self) -> str:
    return "sparse_as_dense: gradients are dense arrays in JAX already (no change)"


def clip_by_global_norm(grads: Any, max_norm: float, scale: Any = None) -> Any:
  """``optax.clip_by_global_norm``'s rule; ``scale``: gradients carry a loss scale (kept).
  The gradients of offloaded parameters come in host memory: the norm adds up every leaf, so
  they are moved to device memory first."""
  grads = step_lib.in_device_memory(grads)
  norm = optax.tree.norm(grads)
  if scale is not None:
    norm = norm / scale.astype(norm.dtype)
  factor = jnp.where(norm < max_norm, 1.0, max_norm / norm)
  return jax.tree.map(lambda g: g * factor.astype(g.dtype), grads)


def features(config: CommunicationConfig, clip_norm: float | None = None) -> list[Feature]:
  """The communication features the configuration asks for, in the order they apply."""
  defaults = CommunicationConfig()
  out: list[Feature] = []
  if config.gradients_reduce_method == "sum":
    out.append(ReduceSum())
  if clip_norm is not None:
    if isinstance(clip_norm, bool) or not isinstance(clip_norm, (int, float)) or not clip_norm > 0:
      raise PlanError(f"clip_norm={clip_norm!r} must be a positive number (the largest global "
                      "norm of the gradients), or None for no clipping.")
    out.append(ClipByGlobalNorm(float(clip_norm), config.clip_after_allreduce))
  elif config.clip_after_allreduce:
    raise PlanError(_CLIP_WITHOUT_NORM)
  if config.fp16:
    out.append(HalfPrecisionReduce(config.fp16_scale))
  if config.sparse_as_dense:
    out.append(SparseAsDense())
  communicators = (config.num_communicators
                   if config.num_communicators != defaults.num_communicators else None)
  splits = config.max_splits if config.max_splits != defaults.max_splits else None
  if communicators is not None or splits is not None:
    out.append(CollectiveOptions(communicators, splits))
  return out


_CLIP_WITHOUT_NORM = """\
communication.clip_after_allreduce=True says where gradient clipping happens, but there is no
clipping to move: give the norm to the Trainer,

    epl.Trainer(init_fn, loss_fn, optax.adam(1e-3), clip_norm=1.0)

(clipping inside your optax chain, optax.clip_by_global_norm, always sees the reduced
gradients; leave clip_after_allreduce unset then)."""


def compiler_options(feats: Sequence[Feature], params_shape: Any) -> dict[str, int]:
  """The XLA options the features ask for (``jax.jit(..., compiler_options=...)``)."""
  out: dict[str, int] = {}
  for f in feats:
    if isinstance(f, CollectiveOptions):
      out.update(f.compiler_options(params_shape))
  return out


def replica_gradients(feats: Sequence[Feature], ctx: BuildContext
                      ) -> Callable[[ForwardFn], GradientFn] | None:
  """A per-replica gradient computation when a feature needs one, else None (module doc)."""
  local = [f for f in feats if isinstance(f, ReplicaFeature)]
  if not any(isinstance(f, HalfPrecisionReduce) or
             (isinstance(f, ClipByGlobalNorm) and not f.after_reduce) for f in local):
    return None
  if ctx.mesh.shape.get(STAGE, 1) > 1:
    raise PlanError("communication.fp16 and clipping before the all-reduce "
                    "(clip_after_allreduce=False with clip_norm) do not run with pipeline "
                    "stages yet; unset them or use one stage.")
  axes = data_axes(ctx.mesh)   # (replica, data) under hybrid sharding
  replicas = ctx.num_replicas
  reducer = next((f for f in local if isinstance(f, HalfPrecisionReduce)), None)

  def make(forward: ForwardFn) -> GradientFn:
    # The model's constraints on a mesh of its own cannot enter the shard_map: say so.
    forward = constraints.refused_inside(
        forward, ctx.mesh, "communication.fp16 and clipping before the all-reduce")
    local_grads = step_lib.accumulate_gradients(forward, ctx.num_micro_batch)
    stacked = ctx.num_micro_batch > 1

    def per_replica(params, model_state, micro, fstate):
      mine = jax.lax.pcast(params, axes, to="varying")   # differentiate locally: no implicit psum
      loss, aux, grads, new_state = local_grads(mine, model_state, micro, fstate)
      for f in local:
        grads = f.before_reduce(grads, loss_scale(fstate))
      grads = (reducer.reduce(grads, replicas, loss_scale(fstate), axes) if reducer is not None
               else jax.tree.map(lambda g: jax.lax.psum(g, axes) / replicas, grads))
      return (jax.lax.pmean(loss, axes),
              jax.tree.map(lambda x: _gather_aux(x, stacked, axes), aux), grads,
              jax.tree.map(lambda x: _agree(x, axes), new_state))

    def gradients(params, model_state, micro, fstate):
      return jax.shard_map(per_replica, mesh=ctx.mesh, axis_names=set(axes),
                           in_specs=(P(), P(), P(None, axes), P()),
                           out_specs=P())(params, model_state, micro, fstate)

    return gradients

  return make


def _varies(x: Any) -> bool:
  return DATA in getattr(jax.typeof(x), "vma", ())


def _gather_aux(x: Any, stacked: bool, axes: tuple[str, ...]) -> Any:
  """Aux of one replica -> of the global batch: float scalars averaged, integer ones summed,
  arrays (one row per example) concatenated along the batch axis."""
  if not _varies(x):
    return x
  if np.ndim(x) == int(stacked):
    return jax.lax.pmean(x, axes) if jnp.issubdtype(x.dtype, jnp.inexact) else \
        jax.lax.psum(x, axes)
  return jax.lax.all_gather(x, axes, axis=int(stacked), tiled=True)


def _agree(x: Any, axes: tuple[str, ...]) -> Any:
  """New model state: float leaves averaged over replicas, others taken from replica 0."""
  if not _varies(x):
    return x
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return jax.lax.pmean(x, axes)
  return jax.lax.all_gather(x, axes)[0]
