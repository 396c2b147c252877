"""The pipeline as the Trainer sees it: packed parameter storage and a gradient function.

``plan_pipeline`` is called by ``Trainer._build`` when the mesh has more than one stage. It
traces the loss once more at the shapes one replica sees per micro batch, cuts the stages
(``partition.py``), picks the schedule (``schedules.py``), checks what pipelines cannot do
(model state, split stages) and returns a ``Pipeline``:

- ``param_shardings``: ``TrainState.params`` is the user's parameter tree, each leaf sharded
  over ``stage`` too, so the optimizer (any optax one) and checkpoints see the user's leaves;
- ``pack`` / ``gradients_of``: inside the step, between that tree and the loop's per-stage
  ``{dtype: (S, size)}`` buffers (a parameter used by two stages is copied to both, its two
  gradients summed);
- ``gradients(features, ctx)``: the ``GradientFn`` of the step (``runtime.py``), with every
  feature's ``forward`` hook around each stage's forward.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from epljax.config import PipelineConfig
from epljax.errors import PlanError
from epljax.features import BuildContext, Feature, GradientFn, loss_scale
from epljax.mesh import DATA, MODEL, STAGE, Layout
from epljax.pipeline import packing, runtime
from epljax.pipeline.auto import check_balance
from epljax.pipeline.partition import Stage, cut_stages, shared_params
from epljax.pipeline.schedules import Schedule, make_schedule
from epljax.plan import leaf_bytes_per_device
from epljax.sharding.capture import Capture, capture
from epljax.step import in_device_memory
from epljax.strategy import REPLICATE


# What the loop keeps between a micro batch's forward and backward: "residuals" (the forward
# runs once) or "inputs" (the stage's forward runs again in the backward). bench/pipeline.py
# measures both; gradient checkpointing features give the policies in between.
STASH = "residuals"


class PipelineWarning(UserWarning):
  """A pipeline that runs, but not the way it should (too few micro batches)."""


@dataclasses.dataclass(frozen=True)
class StageInfo:
  """One row of the plan's stage table."""
  index: int
  name: str
  num_params: int
  param_bytes: int        # the stage's own parameters (before padding)
  incoming_bytes: int     # activations received per micro batch
  kept_bytes: int         # kept per micro batch for its backward (residuals, inputs)


class Pipeline:
  """What ``plan_pipeline`` worked out (see the module doc)."""

  def __init__(self, stages: Sequence[Stage], param_avals: Sequence[Any], params_def: Any,
               batch_avals: Sequence[Any], aux_avals: Sequence[Any], aux_def: Any,
               schedule: Schedule, layout: Layout, batch_axes: tuple[str, ...],
               stash: str | None = None):
    self.stages = tuple(stages)
    self.param_avals = list(param_avals)
    self.params_def = params_def
    self.batch_avals = list(batch_avals)
    self.aux_avals = list(aux_avals)
    self.aux_def = aux_def
    self.schedule = schedule
    self.mesh = layout.mesh
    self.batch_axes = batch_axes
    self.stash = stash or STASH
    self.layouts = [packing.Layout.of([param_avals[i] for i in s.params]) for s in stages]
    self.sizes = packing.padded_sizes(self.layouts)
    # Packed row r holds chunk rows[r]: stage s's v chunks s, s + S, ... are rows sv..sv+v-1.
    self.rows = chunk_rows(schedule.num_stages, schedule.num_virtual_stages)
    self.buffers: runtime.Buffers | None = None
    self.branches: list[runtime.Branch] = []
    self.branch_of: list[int] = []
    self._stored: list[NamedSharding] | None = None
    self.param_paths: list[str] = [f"leaf {i}" for i in range(len(self.param_avals))]
    self.balance: list[str] = []   # per stage: estimated FLOPs and parameter bytes

  # -- storage ------------------------------------------------------------------------------
  # TrainState.params is the user's parameter tree itself: any optax optimizer (masks,
  # multi_transform, adafactor), ZeRO and checkpoints see the user's leaves. Each leaf is also
  # sharded over ``stage`` (on its largest dimension the stage count divides), so a device holds
  # about 1/S of the parameters and of the optimizer state. Inside the step the leaves are
  # packed into the loop's ``{dtype: (S, size)}`` buffers (``pack``) and the packed gradients
  # come back as the user's tree (``gradients_of``: a leaf held by several stages gets the sum).
  def param_shardings(self, specs: Sequence[P]) -> Any:
    """Per user leaf: its spec (from the stage's strategy) with ``stage`` added."""
    size = self.mesh.shape[STAGE]
    out = [NamedSharding(self.mesh, add_axis(spec, tuple(a.shape), STAGE, size) or spec)
           for spec, a in zip(specs, self.param_avals)]
    self._stored = out
    return jax.tree.unflatten(self.params_def, out)

  def state_sharding(self, leaf: Any, param_sharding: NamedSharding) -> NamedSharding:
    """An optimizer-state leaf of a parameter: the parameter's sharding when the shapes agree,
    else (factored moments, adafactor) the leaf's own largest dimension over ``stage``."""
    spec = param_sharding.spec
    if len(spec) <= len(leaf.shape) and all(
        e is None or leaf.shape[d] % _size(self.mesh, e) == 0 for d, e in enumerate(spec)):
      return param_sharding
    size = self.mesh.shape[STAGE]
    return NamedSharding(self.mesh, add_axis(P(), tuple(leaf.shape), STAGE, size) or P(),
                         memory_kind=param_sharding.memory_kind)

  def pack(self, params: Any) -> dict[str, jax.Array]:
    """The user's parameter tree -> ``{dtype: (S x v, size)}`` (traceable; rows: ``rows``)."""
    return _pack(jax.tree.leaves(params), self._by_row(self.stages), self._by_row(self.layouts),
                 self.sizes)

  def unpack(self, packed: dict[str, jax.Array]) -> Any:
    """``{dtype: (S x v, size)}`` -> the user's parameter tree (a leaf held by several stages: the
    first stage's copy)."""
    leaves = _unpack(packed, self._by_row(self.stages), self._by_row(self.layouts),
                     self.param_avals, total=False)
    return jax.tree.unflatten(self.params_def, leaves)

  def gradients_of(self, packed: dict[str, jax.Array]) -> Any:
    """Packed gradients -> the user's tree; a leaf held by several stages gets their sum (the
    transpose of ``pack``, which copies it to each)."""
    leaves = _unpack(packed, self._by_row(self.stages), self._by_row(self.layouts),
                     self.param_avals, total=True)
    return jax.tree.unflatten(self.params_def, leaves)

  def _by_row(self, per_chunk: Sequence[Any]) -> list[Any]:
    return [per_chunk[c] for c in self.rows]

  @property
  def shared(self) -> dict[int, tuple[int, ...]]:
    """Parameter leaf -> its stages, for the leaves held by several stages (tied weights)."""
    return shared_params(self.stages)

  @property
  def param_bytes_per_device(self) -> int:
    """The user's leaves as stored (sharded over ``stage``)."""
    if self._stored is None:
      return packing.nbytes(self.sizes)
    return sum(leaf_bytes_per_device(a.shape, a.dtype, sh)
               for a, sh in zip(self.param_avals, self._stored))

  @property
  def packed_bytes_per_device(self) -> int:
    """One stage's packed parameters inside the step (the largest stage)."""
    return packing.nbytes(self.sizes)

  # -- the step -----------------------------------------------------------------------------
  def gradients(self, features: Sequence[Feature], ctx: BuildContext) -> GradientFn:
    """The step's ``GradientFn`` over the user's parameter tree (packed inside the step)."""
    fns = []
    for stage in self.stages:
      fn = stage
      for f in features:
        fn = f.forward(fn, ctx)
      fns.append(fn)
    self.branches, self.branch_of = runtime.distinct_branches(
        self.stages, fns, self.param_avals, self.batch_avals, self.stash)
    self.buffers = runtime.buffer_sizes(self.branches)
    run = runtime.pipelined_gradients(
        self.branches, self.branch_of, self.aux_avals, self.schedule, self.mesh,
        (DATA, MODEL), P(None, self.batch_axes))
    single = self.schedule.num_micro_batch == 1
    aux_def = self.aux_def

    def gradients(params, model_state, micro, fstate):
      scale = loss_scale(fstate)
      seed = jnp.ones((), jnp.float32) if scale is None else jnp.asarray(scale, jnp.float32)
      loss, aux, packed = run(self.pack(in_device_memory(params)), jax.tree.leaves(micro), seed)
      grads = self.gradients_of(packed)
      aux = None if aux_def is None else jax.tree.unflatten(
          aux_def, [a[0] for a in aux] if single else aux)
      return loss, aux, grads, model_state

    return gradients

  # -- the plan -----------------------------------------------------------------------------
  def stage_info(self) -> list[StageInfo]:
    rows = []
    for stage, layout in zip(self.stages, self.layouts):
      branch = self.branches[self.branch_of[stage.index]] if self.branches else None
      kept = 0
      if branch is not None:
        kept = packing.nbytes(branch.residuals.layout.sizes)
        kept += packing.nbytes(branch.incoming.sizes) if branch.needs_inputs else 0
      rows.append(StageInfo(stage.index, stage.name, len(stage.params),
                            packing.nbytes(layout.sizes),
                            packing.nbytes(packing.Layout.of(stage.incoming).sizes), kept))
    return rows

  def describe(self) -> list[str]:
    """Lines for the plan: the schedule and what one device keeps."""
    lines = [f"schedule  {self.schedule.describe()}"]
    n_stages, virtual = self.schedule.num_stages, self.schedule.num_virtual_stages
    if virtual > 1:
      lines.append("chunks    " + "; ".join(
          f"stage {s}: " + ", ".join(f"'{self.stages[c].name}'" for c in self.rows[
              s * virtual:(s + 1) * virtual]) for s in range(n_stages)))
    if self.buffers is not None:
      per_slot = packing.nbytes(self.buffers.residuals) + (
          packing.nbytes(self.buffers.payload) if self.buffers.keep_inputs else 0)
      kept = "micro batches" if virtual == 1 else "micro batch chunks"
      lines.append(
          f"stash     {self.stash}: {self.schedule.num_slots} {kept} (+1 scratch slot) x "
          f"{_kib(per_slot)} per device; {len(self.branches)} distinct stage functions")
    lines.append(f"params    {_kib(self.param_bytes_per_device)} per device as stored (the "
                 f"user's leaves, sharded over stage); {_kib(self.packed_bytes_per_device)} "
                 "packed for the largest stage inside the step")
    lines += [f"balance   {row}" for row in self.balance]
    for i, holders in self.shared.items():
      names = ", ".join(f"'{self.stages[h].name}'" for h in holders)
      lines.append(f"tied      '{self.param_paths[i]}' held by stages {names}; their gradients "
                   "are summed")
    return lines


def plan_pipeline(*, loss_call: Callable, has_aux: bool, params_shape: Any, state_shape: Any,
                  param_paths: Sequence[str], state_paths: Sequence[str], micro_shapes: Any,
                  global_capture: Capture, layout: Layout, batch_axes: tuple[str, ...],
                  config: PipelineConfig, num_devices: int,
                  capture_options: dict | None = None) -> Pipeline:
  """Checks, local capture, stages, schedule (see the module doc). ``micro_shapes``: one
  micro batch of all replicas; ``capture_options``: as the Trainer's own capture had them, so
  the per-replica trace finds the same task graphs."""
  if jax.tree.leaves(state_shape):
    raise PlanError(_MODEL_STATE.format(paths=", ".join(f"'{p}'" for p in state_paths[:3])
                                        + (" ..." if len(state_paths) > 3 else "")))
  for tg in global_capture.taskgraphs:
    if tg.strategy != REPLICATE:
      raise PlanError(_SPLIT_STAGE.format(name=tg.name, count=tg.device_count))
  shards = layout.num_replicas * (layout.devices_per_stage if MODEL in batch_axes else 1)
  local = jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] // shards, *x.shape[1:]),
                                                      x.dtype), micro_shapes)
  p_leaves, p_def = jax.tree.flatten(params_shape)
  b_leaves, b_def = jax.tree.flatten(local)
  found: dict[str, Any] = {}

  def flat_loss(*flat):
    params = jax.tree.unflatten(p_def, flat[:len(p_leaves)])
    batch = jax.tree.unflatten(b_def, flat[len(p_leaves):])
    loss, aux, _ = loss_call(params, state_shape, batch)
    aux_leaves, found["aux_def"] = jax.tree.flatten(aux)
    return (loss, *aux_leaves)

  # Traced outside any mesh: the stages replay these equations inside the pipeline's
  # shard_map, and an equation replays in the abstract mesh it was traced in.
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
    cap = capture(flat_loss, p_leaves, b_leaves, input_paths=list(param_paths),
                  num_devices=num_devices, **(capture_options or {}))
  if [t.name for t in cap.taskgraphs] != [t.name for t in global_capture.taskgraphs]:
    raise AssertionError("the per-replica trace found other task graphs than the global one")
  aux_avals = [v.aval for v in cap.program.closed_jaxpr.jaxpr.outvars[1:]]
  stages = cut_stages(cap, layout.stage_of, len(p_leaves))
  schedule = make_schedule(config.strategy, layout.num_stages, config.num_micro_batch,
                           config.num_virtual_stages)
  if config.num_micro_batch < layout.num_stages:
    warnings.warn(_FEW_MICRO.format(m=config.num_micro_batch, s=layout.num_stages,
                                    bubble=schedule.bubble_fraction), PipelineWarning,
                  stacklevel=3)
  pipe = Pipeline(stages, p_leaves, p_def, b_leaves, aux_avals,
                  found["aux_def"] if has_aux else None, schedule, layout, batch_axes)
  pipe.param_paths = list(param_paths)
  pipe.balance = check_balance(global_capture, layout.stage_of, len(stages),
                               [s.name for s in stages])
  return pipe


def chunk_rows(num_stages: int, num_virtual_stages: int) -> list[int]:
  """The chunk of each packed row: stage ``s`` holds chunks ``s, s + S, ..., s + (v - 1)S``
  (the interleaved layout) as its ``v`` consecutive rows, so sharding the rows over ``stage``
  gives every device its own chunks."""
  return [s + j * num_stages for s in range(num_stages) for j in range(num_virtual_stages)]


def _pack(leaves, stages, layouts, sizes) -> dict[str, jax.Array]:
  rows = [layout.pack([leaves[i] for i in s.params], sizes) for s, layout in zip(stages, layouts)]
  return {k: jnp.stack([r[k] for r in rows]) for k in sizes}


def _unpack(packed, stages, layouts, avals, *, total: bool) -> list[Any]:
  leaves: list[Any] = [None] * len(avals)
  for row, (s, layout) in enumerate(zip(stages, layouts)):
    for i, value in zip(s.params, layout.unpack({k: v[row] for k, v in packed.items()})):
      if leaves[i] is None:
        leaves[i] = value
      elif total:
        leaves[i] = leaves[i] + value
  # A leaf no stage holds (a parameter the loss never reads) has a zero gradient.
  return [jnp.zeros(a.shape, a.dtype) if x is None else x for x, a in zip(leaves, avals)]


def _size(mesh, entry) -> int:
  names = entry if isinstance(entry, tuple) else (entry,)
  return int(np.prod([mesh.shape[n] for n in names]))


def add_axis(spec: P, shape: tuple[int, ...], axis: str, size: int) -> P | None:
  """``spec`` with ``axis`` on the largest free dimension ``size`` divides, or None."""
  entries = list(spec) + [None] * (len(shape) - len(spec))
  free = [d for d, e in enumerate(entries) if e is None and shape[d] % size == 0
          and shape[d] >= size]
  if size == 1 or not free:
    return None
  dim = max(free, key=lambda d: (shape[d], -d))
  entries[dim] = axis
  return P(*entries)


def _kib(n: int) -> str:
  if n < 1024:
    return f"{n} B"
  return f"{n / 1024:.1f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.1f} MiB"


_MODEL_STATE = """\
The pipelined model has model state ({paths}): variables that are not trained (BatchNorm
statistics, NNX RNG counters). Pipeline stages do not carry model state: each replica would
see only its own rows, so batch statistics could not match single-device training. Use
normalization without batch statistics (LayerNorm, RMSNorm), pass RNG keys in the batch
rather than keeping them in the module, or train without pipeline stages."""

_SPLIT_STAGE = """\
Task graph '{name}' is epl.split({count}) and, as its task graphs are not colocated, a
pipeline stage; tensor parallelism inside pipeline stages is not supported yet. Use
epl.replicate(...) scopes for the stages, or set cluster.colocate_split_and_replicate=True to
run the task graphs on the same devices without a pipeline."""

_FEW_MICRO = (
    "pipeline.num_micro_batch={m} is smaller than the {s} pipeline stages: at most {m} stages "
    "work at any time, and {bubble:.0%} of each step is pipeline bubble. Use num_micro_batch "
    ">= {s} (4 x the stages keeps the bubble under 20%).")
