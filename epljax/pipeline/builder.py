"""The pipeline as the Trainer sees it: packed parameter storage and a gradient function.

``plan_pipeline`` is called by ``Trainer._build`` when the mesh has more than one stage. It
traces the loss once more at the shapes one replica sees per micro batch, cuts the stages
(``partition.py``), picks the schedule (``schedules.py``), checks what pipelines cannot do
(model state, split stages, optimizers that are not elementwise) and returns a ``Pipeline``:

- ``packed_shape`` / ``param_shardings``: ``TrainState.params`` is ``{dtype: (S, size)}``
  sharded over ``stage``, so each device holds only its stage's parameters;
- ``pack`` / ``unpack``: between the user's parameter tree and that storage (``Trainer.init``
  and ``Trainer.variables``);
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
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from epljax.config import PipelineConfig
from epljax.errors import PlanError
from epljax.features import BuildContext, Feature, GradientFn, loss_scale
from epljax.mesh import DATA, MODEL, STAGE, Layout
from epljax.pipeline import packing, runtime
from epljax.pipeline.optimizers import check_optimizer
from epljax.pipeline.partition import Stage, cut_stages
from epljax.pipeline.schedules import Schedule, make_schedule
from epljax.sharding.capture import Capture, capture
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
    self.buffers: runtime.Buffers | None = None
    self.branches: list[runtime.Branch] = []
    self.branch_of: list[int] = []

  # -- storage ------------------------------------------------------------------------------
  @property
  def packed_shape(self) -> dict[str, jax.ShapeDtypeStruct]:
    n = len(self.stages)
    return {k: jax.ShapeDtypeStruct((n, size), k) for k, size in self.sizes.items()}

  @property
  def param_shardings(self) -> dict[str, NamedSharding]:
    return {k: NamedSharding(self.mesh, P(STAGE)) for k in self.sizes}

  def pack(self, params: Any) -> dict[str, jax.Array]:
    """The user's parameter tree -> ``{dtype: (S, size)}`` (traceable)."""
    return _pack(jax.tree.leaves(params), self.stages, self.layouts, self.sizes)

  def unpack(self, packed: dict[str, jax.Array]) -> Any:
    """``{dtype: (S, size)}`` -> the user's parameter tree (traceable)."""
    leaves = _unpack(packed, self.stages, self.layouts, len(self.param_avals))
    return jax.tree.unflatten(self.params_def, leaves)

  @property
  def param_bytes_per_device(self) -> int:
    return packing.nbytes(self.sizes)

  # -- the step -----------------------------------------------------------------------------
  def gradients(self, features: Sequence[Feature], ctx: BuildContext,
                param_space=None) -> GradientFn:
    """``param_space``: the packed parameters' ``jax.memory.Space`` if not device memory."""
    fns = []
    for stage in self.stages:
      fn = stage
      for f in features:
        fn = f.forward(fn, ctx)
      fns.append(fn)
    self.branches, self.branch_of = runtime.distinct_branches(
        self.stages, fns, self.param_avals, self.batch_avals, self.stash, param_space)
    self.buffers = runtime.buffer_sizes(self.branches)
    run = runtime.pipelined_gradients(
        self.branches, self.branch_of, self.aux_avals, self.schedule, self.mesh,
        (DATA, MODEL), P(None, self.batch_axes))
    single = self.schedule.num_micro_batch == 1
    aux_def = self.aux_def

    def gradients(params, model_state, micro, fstate):
      scale = loss_scale(fstate)
      seed = jnp.ones((), jnp.float32) if scale is None else jnp.asarray(scale, jnp.float32)
      loss, aux, grads = run(params, jax.tree.leaves(micro), seed)
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
    if self.buffers is not None:
      per_slot = packing.nbytes(self.buffers.residuals) + (
          packing.nbytes(self.buffers.payload) if self.buffers.keep_inputs else 0)
      lines.append(
          f"stash     {self.stash}: {self.schedule.num_slots} micro batches (+1 scratch slot) x "
          f"{_kib(per_slot)} per device; {len(self.branches)} distinct stage functions")
    lines.append(f"params    {_kib(self.param_bytes_per_device)} per device (the largest stage, "
                 "packed)")
    return lines


def plan_pipeline(*, loss_call: Callable, has_aux: bool, params_shape: Any, state_shape: Any,
                  param_paths: Sequence[str], state_paths: Sequence[str], micro_shapes: Any,
                  global_capture: Capture, layout: Layout, batch_axes: tuple[str, ...],
                  config: PipelineConfig, optimizer: Any, num_devices: int,
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
  schedule = make_schedule(config.strategy, layout.num_stages, config.num_micro_batch)
  if config.num_micro_batch < layout.num_stages:
    warnings.warn(_FEW_MICRO.format(m=config.num_micro_batch, s=layout.num_stages,
                                    bubble=schedule.bubble_fraction), PipelineWarning,
                  stacklevel=3)
  pipe = Pipeline(stages, p_leaves, p_def, b_leaves, aux_avals,
                  found["aux_def"] if has_aux else None, schedule, layout, batch_axes)
  check_optimizer(optimizer, params_shape, param_paths,
                  lambda small: _packer(small, stages))
  return pipe


def _packer(leaves: Sequence[Any], stages: Sequence[Stage]):
  layouts = [packing.Layout.of([leaves[i] for i in s.params]) for s in stages]
  sizes = packing.padded_sizes(layouts)
  return (lambda values: _pack(values, stages, layouts, sizes),
          lambda packed: _unpack(packed, stages, layouts, len(leaves)))


def _pack(leaves, stages, layouts, sizes) -> dict[str, jax.Array]:
  rows = [layout.pack([leaves[i] for i in s.params], sizes) for s, layout in zip(stages, layouts)]
  return {k: jnp.stack([r[k] for r in rows]) for k in sizes}


def _unpack(packed, stages, layouts, count) -> list[Any]:
  leaves: list[Any] = [None] * count
  for s, layout in zip(stages, layouts):
    for i, value in zip(s.params, layout.unpack({k: v[s.index] for k, v in packed.items()})):
      leaves[i] = value
  return leaves


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
