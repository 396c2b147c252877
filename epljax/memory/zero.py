"""ZeRO (``zero.level``): shard what data parallelism replicates over the ``data`` axis.

- ``"v1"`` (EPL's): optimizer state sharded. Each weight gradient is reduce-scattered where
  the backward pass produces it (``uses.py``: an explicit ``psum_scatter``; GSPMD alone writes
  all-reduce + slice on CPU), each device updates its shard of the parameters, and the new
  parameters are all-gathered into their replicated layout. A ring all-reduce is a
  reduce-scatter plus an all-gather, so the bytes on the wire are those of plain data
  parallelism. With gradient accumulation v1 accumulates whole gradients as data parallelism
  does and keeps its shard of the sum.
- ``"v2"``: gradients kept sharded from the moment they are produced, also under gradient
  accumulation: each micro batch's gradient is reduce-scattered and the accumulator is 1/N.
  Without accumulation v1 and v2 compile to the same program.
- ``"v3"``: parameters sharded too (FSDP). Each is all-gathered at each use; a matmul keeps
  only the shard for its backward pass and gathers it again there, and its gradient is
  reduce-scattered. Where that moves more bytes than the other operand (an embedding or an
  LM head of a large vocabulary, a few rows per device), the use is routed otherwise
  (``routes.py``).

Context parallelism (``context.parallel_degree``): the ``context`` devices of a replica see
different tokens of the same rows and sum their gradients as data replicas do, so ZeRO shards
over ``data`` x ``context`` together (one mesh-axis tuple on a dimension; ``zero_axes``), as a
hand FSDP over every device of the replicas does; a leaf that data x context does not divide
falls back to ``data`` alone.

Hybrid sharding (``zero.shard_size``, HSDP; MaxText's ``ici_fsdp`` x ``dcn_data``, PyTorch's
``HYBRID_SHARD``): the mesh's ``data`` axis is one group of replicas and ``replica`` runs across
the groups (``mesh/builder.py``). Everything above happens over ``data`` inside a group; the
groups hold the same shards (``context`` stays inside a group), and each gradient shard is
all-reduced over ``replica`` once
(``hybrid_traffic`` gives the step's collectives for a plan search).

A leaf is sharded on its largest dimension that the data axis divides and that no other mesh
axis uses (a leaf read outside loops: no other mesh axis of several devices); leaves with no
such dimension stay as they are (``describe`` lists them). This file gives the shardings
(``StateShardings.params_at_use``: the layout before the split, which v3 gathers to at each
use; ``grads``: the ZeRO layout), the gradient constraint and the sharded update; the per-use
part of the forward pass is ``uses.ParamUses``, reading those shardings.
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from epljax import step as step_lib
from epljax.config import ZeroConfig
from epljax.features import BuildContext, Feature, GradientFn, StateShardings, UpdateFn
from epljax.mesh import CONTEXT, DATA, REPLICA
from epljax.sharding.program import LOOPS


def zero_axes(mesh) -> tuple[str, ...]:
  """The mesh axes ZeRO shards over: ``data``, and ``context`` beside it under context
  parallelism (its devices see different tokens of the same rows and sum their gradients as
  data replicas do, so they split the state too: FSDP over data x context). Hybrid sharding's
  ``replica`` stays outside (the groups hold the same shards)."""
  return (DATA, CONTEXT) if dict(mesh.shape).get(CONTEXT, 1) > 1 else (DATA,)


def shard_over_data(sharding: NamedSharding, shape, size: int,
                    unit_axes_free: bool = False,
                    over: tuple[str, ...] = (DATA,)) -> NamedSharding:
  """``sharding`` with the mesh axes ``over`` (``data``, or ``data`` x ``context``: one entry)
  on the largest free dimension ``size`` (their devices) divides; as it is when one of them is
  used already or no dimension fits. With ``unit_axes_free`` a dimension named only by mesh
  axes of one device (a model's logical rules naming ``model`` in a data-only mesh) is free
  too: it splits nothing."""
  axes = lambda e: () if e is None else e if isinstance(e, tuple) else (e,)  # noqa: E731
  entries = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
  used = {a for e in entries for a in axes(e)}
  free = [d for d, e in enumerate(entries)
          if (e is None or unit_axes_free and all(sharding.mesh.shape[a] == 1 for a in axes(e)))
          and shape[d] % size == 0 and shape[d] >= size]
  if used & set(over) or not free:
    return sharding
  entries[max(free, key=lambda d: (shape[d], -d))] = over[0] if len(over) == 1 else over
  return NamedSharding(sharding.mesh, P(*entries), memory_kind=sharding.memory_kind)


def shard_over_group(sharding: NamedSharding, shape, mesh, unit_axes_free: bool = False):
  """``shard_over_data`` over ``zero_axes(mesh)``; a leaf no dimension of which the data x
  context devices divide falls back to ``data`` alone."""
  over = zero_axes(mesh)
  sizes = dict(mesh.shape)
  split = shard_over_data(sharding, shape, math.prod(sizes[a] for a in over), unit_axes_free,
                          over)
  if split == sharding and len(over) > 1:
    split = shard_over_data(sharding, shape, sizes[DATA], unit_axes_free)
  return split


def read_in_loops(capture, leaves: int) -> list[bool]:
  """Per parameter leaf: whether the traced loss reads it inside a loop (the stacked layers of
  ``nn.scan``); all True without a capture."""
  if capture is None:
    return [True] * leaves
  program = capture.program
  return [any(e in LOOPS for node, _ in program.uses_of_input(i)
              for e in node.enclosing) for i in range(leaves)]


def is_sharding(x) -> bool:
  return isinstance(x, jax.sharding.Sharding)


def device_layout(sh: NamedSharding) -> NamedSharding:
  # Constraints inside the step say how a value is laid out, not where it lives.
  return NamedSharding(sh.mesh, sh.spec)


class Zero(Feature):
  """``zero.level`` v1, v2 or v3 (see the module docstring)."""

  name = "zero"

  def __init__(self, config: ZeroConfig):
    self.level = config.level
    self._sharded: list[NamedSharding] = []     # per parameter leaf: its ZeRO layout
    self._treedef = None
    self._unsharded: list[str] = []
    self._groups = 1
    self._over: tuple[str, ...] = (DATA,)
    self._paths: list[str] = []

  def shardings(self, shardings: StateShardings, ctx: BuildContext) -> StateShardings:
    self._over = zero_axes(ctx.mesh)
    self._groups = dict(ctx.mesh.shape).get(REPLICA, 1)
    shapes, self._treedef = jax.tree.flatten(ctx.stored_params_shape)
    full = jax.tree.leaves(shardings.params, is_leaf=is_sharding)
    # A weight read outside loops (an embedding, an LM head) may be split along a dimension
    # named by a one-device axis (the vocabulary under a model's logical rules), as a hand FSDP
    # splits it: uses.py can then leave its use sharded (routes.py). The stacked layers of a
    # loop keep their truly free dimension (the same gathered bytes; on XLA:GPU a layer kernel
    # split along its minor dimension costs a transposed copy of its stack). (A pipeline's
    # slots, ``state_params_shape``, are not the traced loss's inputs: each keeps its own.)
    looped = (read_in_loops(ctx.capture, len(shapes)) if ctx.state_params_shape is None
              else [True] * len(shapes))
    self._sharded = [shard_over_group(s, x.shape, ctx.mesh, unit_axes_free=not inside)
                     for s, x, inside in zip(full, shapes, looped)]
    paths = [jax.tree_util.keystr(p, simple=True, separator="/")
             for p, _ in jax.tree_util.tree_flatten_with_path(ctx.stored_params_shape)[0]]
    self._paths = [f"{path} {tuple(x.shape)}" for path, x in zip(paths, shapes)]
    self._unsharded = [p for p, a, b in zip(self._paths, full, self._sharded) if a == b]
    sharded_tree = jax.tree.unflatten(self._treedef, self._sharded)
    opt_state = step_lib.map_optimizer_state(
        ctx.optimizer, lambda current, target: NamedSharding(
            target.mesh, target.spec, memory_kind=current.memory_kind),
        shardings.opt_state, sharded_tree, is_leaf=is_sharding)
    parts = sharded_parts(self.level, ctx.num_micro_batch)
    params = sharded_tree if PARAMETERS in parts else shardings.params
    reduced = GRADIENTS in parts
    grads = jax.tree.map(lambda s, p: NamedSharding(s.mesh, s.spec, memory_kind=p.memory_kind),
                         sharded_tree, shardings.params, is_leaf=is_sharding)
    at_use = shardings.params if shardings.params_at_use is None else shardings.params_at_use
    return dataclasses.replace(shardings, params=params, opt_state=opt_state,
                               grads=grads if reduced else shardings.grads, params_at_use=at_use)

  # -- gradients and update: reduce-scatter, update shards, gather -------------------------
  def gradients(self, fn: GradientFn, ctx: BuildContext) -> GradientFn:
    def reduce_scattered(params, model_state, micro, fstate):
      loss, aux, grads, new_state = fn(params, model_state, micro, fstate)
      return loss, aux, jax.lax.with_sharding_constraint(grads, self._layout()), new_state

    return reduce_scattered

  def update(self, fn: UpdateFn, ctx: BuildContext) -> UpdateFn:
    def sharded_update(params, opt_state, grads, fstate):
      layout = self._layout()
      constrain = jax.lax.with_sharding_constraint
      new_params, opt_state, fstate = fn(constrain(params, layout), opt_state,
                                         constrain(grads, layout), fstate)
      return constrain(new_params, layout), opt_state, fstate

    return sharded_update

  def _layout(self):
    return jax.tree.unflatten(self._treedef, [device_layout(s) for s in self._sharded])

  def describe(self) -> str:
    what = {"v1": "optimizer state", "v2": "optimizer state and gradients",
            "v3": "parameters, gradients and optimizer state"}[self.level]
    left = (f"; not sharded (no dimension divisible by the data axis): "
            f"{', '.join(self._unsharded[:4])}{' ...' if len(self._unsharded) > 4 else ''}"
            if self._unsharded else "")
    axes = " x ".join(f"'{a}'" for a in self._over)
    over = (axes if self._groups == 1 else
            f"{axes} inside each of {self._groups} groups (zero.shard_size), replicated over "
            f"'replica' (gradient shards all-reduced across the groups)")
    alone = [u for u, s in zip(self._paths, self._sharded) if len(self._over) > 1
             and DATA in s.spec and self._over not in s.spec]
    if alone:
      over += (f"; over 'data' alone (no dimension divisible by data x context): "
               f"{', '.join(alone[:4])}{' ...' if len(alone) > 4 else ''}")
    return f"ZeRO {self.level}: {what} sharded over {over}{left}"


PARAMETERS, GRADIENTS, OPTIMIZER_STATE = "parameters", "gradients", "optimizer state"


def sharded_parts(level: str, num_micro_batch: int) -> frozenset[str]:
  """What ZeRO ``level`` shards over its group's data replicas (``Zero.shardings`` and the
  plan search's footprint alike): the optimizer state; the gradients from v2 on, and with v1
  without accumulation (it keeps only its shard of each reduced gradient: v2's program); the
  parameters with v3."""
  if not level:
    return frozenset()
  parts = {OPTIMIZER_STATE}
  if level != "v1" or num_micro_batch == 1:
    parts.add(GRADIENTS)
  if level == "v3":
    parts.add(PARAMETERS)
  return frozenset(parts)


def footprint(level: str, num_micro_batch: int, parts: dict[str, int],
              group: int) -> dict[str, int]:
  """Bytes per device of each part (``parameters``, ``gradients``, ``optimizer state``: as
  data parallelism replicates them) under ZeRO ``level`` over ``group`` devices (the data
  replicas of one group, times ``context.parallel_degree``: ``zero_axes``): what
  ``sharded_parts`` names, divided by the group."""
  sharded = sharded_parts(level, num_micro_batch)
  return {k: v // group if k in sharded else v for k, v in parts.items()}


@dataclasses.dataclass(frozen=True)
class Traffic:
  """One kind of collective of a ZeRO step, before compiling: ``bytes`` per device per step
  (the result's size, summed over its ``times`` calls), over ``axis`` in groups of ``group``."""
  kind: str
  axis: str
  bytes: float
  group: int
  times: int


def hybrid_traffic(level: str, param_bytes: float, leaves: int, data: int, groups: int = 1,
                   gather_bytes: float | None = None, context: int = 1) -> list[Traffic]:
  """The collectives of ZeRO ``level`` over ``data`` replicas in each of ``groups`` groups
  (``zero.shard_size``; 1: plain ZeRO), times ``context`` (``context.parallel_degree``: ZeRO's
  group is data x context, its rows over ``data+context``; ``replica`` outside), for
  ``leaves`` trainable leaves of ``param_bytes``
  (float32 master weights). ``gather_bytes``: the parameters' bytes in the dtype v3 gathers
  (the compute dtype, half for bfloat16 uses; default ``param_bytes``), in which v3 also
  reduce-scatters the gradients (``uses.py`` casts before it gathers). What the compiled
  step shows (tests/test_memory_hybrid.py): reduce-scatter of each gradient over ``data``,
  all-gather of the updated shards (v1, v2) or of the parameters at each use in the forward
  and the backward (v3; a rematerialized layer's backward reuses its recomputed forward's
  gather), and one all-reduce of each gradient shard over ``replica``."""
  gathered = param_bytes if gather_bytes is None else gather_bytes
  grads = gathered if level == "v3" else param_bytes
  rows = []
  axis = DATA if context == 1 else f"{DATA}+{CONTEXT}"
  data *= context
  if data > 1 and level:
    rows.append(Traffic("reduce-scatter", axis, grads / data, data, leaves))
    if level == "v3":
      rows.append(Traffic("all-gather", axis, 2 * gathered, data, 2 * leaves))
    else:
      rows.append(Traffic("all-gather", axis, param_bytes, data, leaves))
  if groups > 1:
    shard = grads / data if level else param_bytes
    rows.append(Traffic("all-reduce", REPLICA, shard, groups, leaves if level else 1))
  return rows
