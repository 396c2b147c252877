"""The global batch: its size rules, process-local slices, and micro batches.

EPL's batch semantics: the model's own batch dimension is the micro batch of one replica, and
the global batch is ``replicas x micro batch x pipeline.num_micro_batch``. Each process passes
its own slice of the global batch (its rows, in process order); ``shard_batch`` turns those
slices into one global ``jax.Array`` split over the batch axes of the mesh.

Rows are dealt out in order: replica ``r`` owns the ``r``-th contiguous block of the global
batch, and its micro batch ``m`` is the ``m``-th contiguous chunk of that block, as if each
replica read its own data and cut it into micro batches. Inside the step the model is traced
once for the micro batch of *all* replicas together (GSPMD), so statistics over the batch
(BatchNorm) are taken over every replica's rows, exactly as single-device training on the same
batch would.

Context parallelism (``context.parallel_degree = k``): dimension 1 of every leaf with two or
more dimensions (the sequence) is split over the mesh axis ``context`` too, in order (device
``c`` of the axis holds the ``c``-th contiguous chunk); leaves with one dimension (a label per
row) are not.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from epljax.errors import PlanError
from epljax.mesh import CONTEXT


@dataclasses.dataclass(frozen=True)
class BatchPlan:
  """How the rows of a global batch are divided."""
  num_replicas: int
  num_micro_batch: int
  split_per_replica: int          # devices each replica's micro batch is split over
  axes: tuple[str, ...]           # mesh axes of the batch dimension
  context: int = 1                # devices each sequence (dimension 1) is split over

  @property
  def num_shards(self) -> int:
    return self.num_replicas * self.split_per_replica

  def check(self, global_rows: int) -> None:
    """Raises a ``PlanError`` naming the sizes when ``global_rows`` does not divide."""
    r, m, k = self.num_replicas, self.num_micro_batch, self.split_per_replica
    unit = r * m * k
    if global_rows % unit == 0:
      return
    parts = [f"{r} replicas", f"{m} micro batches"]
    if k > 1:
      parts.append(f"{k} devices per replica sharing each micro batch (replicate({k}))")
    lower = max(unit, global_rows // unit * unit)
    raise PlanError(
        f"The global batch of {global_rows} rows does not divide into {' x '.join(parts)} "
        f"(= {unit}). Use a global batch that is a multiple of {unit}, for example {lower} or "
        f"{lower + unit}: a micro batch of {lower // (r * m)} rows per replica.")

  def check_sequences(self, batch: Any) -> None:
    """Raises a ``PlanError`` naming the leaf when a sequence does not divide over context."""
    if self.context == 1:
      return
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
      shape = np.shape(leaf)
      if len(shape) >= 2 and shape[1] % self.context:
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        k = self.context
        raise PlanError(
            f"Batch leaf '{name}' {tuple(shape)}: its sequence (dimension 1) of {shape[1]} "
            f"does not divide over context.parallel_degree={k} devices. Pad or cut the "
            f"sequences to a multiple of {k} (for example {-(-shape[1] // k) * k}), or use a "
            f"context.parallel_degree dividing {shape[1]}.")

  def micro_rows(self, global_rows: int) -> int:
    """Rows of one micro batch of all replicas together (what the model is traced with)."""
    return global_rows // self.num_micro_batch


def leading_rows(batch: Any) -> int:
  """The leading (batch) size shared by every leaf of a process-local batch."""
  leaves = jax.tree.leaves(batch)
  sizes = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
  if (len(sizes) == 1 and None not in sizes   # the common case, checked cheaply every step
      and not any(isinstance(x, np.ndarray) and x.dtype.kind in "USO" for x in leaves)):
    return sizes.pop()
  leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
  if not leaves:
    raise PlanError("The batch is empty: pass a pytree of arrays with a leading batch dimension.")
  sizes = {}
  for path, leaf in leaves:
    name = jax.tree_util.keystr(path, simple=True, separator="/")
    shape = np.shape(leaf)
    if isinstance(leaf, np.ndarray) and leaf.dtype.kind in "USO":
      raise PlanError(f"Batch leaf '{name}' has dtype {leaf.dtype}, which JAX cannot put on a "
                      "device. Encode it as numbers (token ids, class indices) before the "
                      "step, or keep it out of the batch.")
    if not shape:
      what = "a scalar" if isinstance(leaf, (np.ndarray, jax.Array)) else \
          f"of type {type(leaf).__name__}, not an array"
      raise PlanError(f"Batch leaf '{name}' is {what}; every batch leaf needs a leading batch "
                      "dimension. Constants (a temperature, a flag) belong in loss_fn's closure, "
                      "not in the batch.")
    sizes[name] = shape[0]
  if len(set(sizes.values())) > 1:
    listing = ", ".join(f"{k}: {v}" for k, v in sizes.items())
    raise PlanError(f"Batch leaves have different leading (batch) sizes ({listing}); every leaf "
                    "needs the same number of rows.")
  return next(iter(sizes.values()))


def global_shapes(batch: Any, sharding_of) -> Any:
  """Abstract global batch: process-local rows times the number of processes."""
  n = jax.process_count()
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct((np.shape(x)[0] * n, *np.shape(x)[1:]), _dtype(x),
                                     sharding=sharding_of(np.ndim(x))), batch)


def leaf_sharding(rows: NamedSharding, ndim: int) -> NamedSharding:
  """A batch leaf's sharding: ``rows`` (the batch dimension over the batch axes), and with a
  ``context`` axis in the mesh, dimension 1 of a leaf of 2+ dimensions over it."""
  if ndim < 2 or rows.mesh.shape.get(CONTEXT, 1) == 1:
    return rows
  return NamedSharding(rows.mesh, P(*rows.spec[:1], CONTEXT))


def shard_batch(batch: Any, rows: NamedSharding) -> Any:
  """Process-local slices -> global arrays, each leaf in ``leaf_sharding(rows, ndim)`` (a no-op
  for arrays already so)."""
  single = jax.process_count() == 1

  def one(x):
    sharding = leaf_sharding(rows, np.ndim(x))
    if isinstance(x, jax.Array) and x.sharding == sharding and (
        single or not x.is_fully_addressable):
      return x
    if single:
      return jax.device_put(x, sharding)
    return jax.make_array_from_process_local_data(sharding, np.asarray(x))

  return jax.tree.map(one, batch)


def micro_batches(batch: Any, plan: BatchPlan, mesh: Mesh) -> Any:
  """Global batch ``(G, ...)`` -> ``(num_micro_batch, G / num_micro_batch, ...)`` (traced).

  Micro batch ``m`` takes chunk ``m`` of every shard's rows, so no row leaves its device.
  """
  m, shards = plan.num_micro_batch, plan.num_shards

  def one(x):
    rows = x.shape[0] // (shards * m)
    x = x.reshape(shards, m, rows, *x.shape[1:]).swapaxes(0, 1)
    x = x.reshape(m, shards * rows, *x.shape[3:])
    seq = (CONTEXT,) if plan.context > 1 and x.ndim >= 3 else ()
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, plan.axes, *seq)))

  return jax.tree.map(one, batch)


def _dtype(x: Any) -> Any:
  return x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype
