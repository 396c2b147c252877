"""The pipeline as the Trainer sees it: packed parameter storage and a gradient function.

``plan_pipeline`` is called by ``Trainer._build`` when the mesh has more than one stage. It
traces the loss once more at the shapes one replica sees per micro batch, cuts the stages
(``partition.py``), averages batch statistics over the replicas (``stats.py``), picks the
schedule (``schedules.py``) and returns a ``Pipeline``:

- ``param_shardings``: ``TrainState.params`` is the user's parameter tree, each leaf sharded
  over ``stage`` too, so the optimizer (any optax one) and checkpoints see the user's leaves;
- ``pack`` / ``gradients_of``: inside the step, between that tree and the loop's per-stage
  ``{dtype: (S, size)}`` buffers, or ``{slot: (S, *shape)}`` slots when stages are
  ``epl.split`` (``slots.py``) (a parameter used by two stages is copied to both, its two
  gradients summed); ``pack_state`` / ``unpack_state``: the model state, in slots;
- ``gradients(features, ctx)``: the ``GradientFn`` of the step (``runtime.py``), with every
  feature's ``forward`` hook around each stage's forward;
- ``stage_info()`` / ``describe()``: its rows and lines in the plan (``describe.py``).
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
from epljax import hlo
from epljax.errors import PipelineWarning, PlanError, listing
from epljax.features import BuildContext, Feature, GradientFn, loss_scale
from epljax.mesh import DATA, MODEL, STAGE, Layout
from epljax.pipeline import describe, packing, runtime, slots, stats, storage
from epljax.pipeline.auto import check_balance
from epljax.pipeline.describe import StageInfo
from epljax.pipeline.partition import Stage, cut_stages, shared_params
from epljax.pipeline.schedules import Schedule, make_schedule
from epljax.sharding import constraints
from epljax.sharding.capture import Capture, capture
from epljax.step import in_device_memory
from epljax.strategy import SPLIT


# What the loop keeps between a micro batch's forward and backward: "residuals" (the forward
# runs once) or "inputs" (the stage's forward runs again in the backward). bench/pipeline.py
# measures both; gradient checkpointing features give the policies in between.
STASH = "residuals"


class Pipeline:
  """What ``plan_pipeline`` worked out (see the module doc)."""

  def __init__(self, stages: Sequence[Stage], param_avals: Sequence[Any], params_def: Any,
               batch_avals: Sequence[Any], aux_avals: Sequence[Any], aux_def: Any,
               schedule: Schedule, layout: Layout, batch_axes: tuple[str, ...],
               stash: str | None = None, split: Sequence[int] = (),
               state_avals: Sequence[Any] = (), state_def: Any = None):
    self.stages = tuple(stages)
    self.param_avals = list(param_avals)
    self.params_def = params_def
    self.batch_avals = list(batch_avals)
    self.aux_avals = list(aux_avals)
    self.aux_def = aux_def
    self.schedule = schedule
    self.mesh = layout.mesh
    self.batch_axes = batch_axes
    # Stacked leaves read by each stage in its own row chunk (``chunks.py``): part index ->
    # leaf, and the avals of the user's leaves then of the parts (what the stages take).
    self.parts = dict(sorted({v: i for s in stages for v, i in s.parts}.items()))
    self.all_avals = self.param_avals + [   # a part: one chunk's rows
        jax.ShapeDtypeStruct((param_avals[i].shape[0] // len(stages), *param_avals[i].shape[1:]),
                             param_avals[i].dtype) for i in self.parts.values()]
    if list(self.parts) != list(range(len(param_avals), len(self.all_avals))):  # invariant
      raise AssertionError(f"pipeline parts are not numbered after the leaves: {self.parts}")
    self.layouts = [packing.Layout.of([self.all_avals[i] for i in s.params]) for s in stages]
    self.sizes = packing.padded_sizes(self.layouts)
    # Packed row r holds chunk rows[r]: stage s's v chunks s, s + S, ... are rows sv..sv+v-1.
    self.rows = chunk_rows(schedule.num_stages, schedule.num_virtual_stages)
    self.buffers: runtime.Buffers | None = None
    self.branches: list[runtime.Branch] = []
    self.branch_of: list[int] = []
    self._stored: list[NamedSharding] | None = None
    self.param_paths: list[str] = [f"leaf {i}" for i in range(len(self.param_avals))]
    self.balance: list[str] = []   # per stage: estimated FLOPs and parameter bytes
    self.constraints: list[str] = []   # what became of the model's own sharding constraints
    # Tensor-parallel stages (``split[s]`` > 1: epl.split(k)) keep their parameters whole, in
    # slots (``slots.py``), and leave the ``model`` axis to GSPMD inside the loop.
    self.split = tuple(split) or (1,) * len(self.stages)
    # Residuals of tensor-parallel stages are stashed in slots (``runtime.distinct_branches``),
    # which keep GSPMD's ``model`` split.
    self.stash = stash or STASH
    self.slot_layouts: list[slots.SlotLayout] | None = None
    self.param_specs: list[P] = [P()] * len(self.param_avals)
    # Model state (BatchNorm statistics): each leaf kept by the stage that updates it, in slots,
    # and threaded through the micro batches in order; with several replicas the batch means
    # are averaged over them (``stats.py``), so they are those of the micro batch, as on one
    # device.
    self.state_avals = list(state_avals)
    self.state_def = state_def
    self.state_layouts = slots.assign([
        [slots.SlotType.of(slots.data_aval(self.state_avals[j])) for j in s.state]
        for s in self.stages]) if self.state_avals else None

  @property
  def slotted(self) -> bool:
    return any(k > 1 for k in self.split)

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
    chunked = set(self.parts.values())
    out = [NamedSharding(self.mesh, self._rows_over_stage(i, spec) if i in chunked else
                         storage.add_axis(spec, tuple(a.shape), STAGE, size) or spec)
           for i, (spec, a) in enumerate(zip(specs, self.param_avals))]
    self._stored = out
    self.param_specs = list(specs)
    # Where each stage's leaves arrive in its buffer (``storage.exchange``); parts stay put.
    self.dims = [storage.stage_dim(sh.spec) for sh in out]
    self.layouts = storage.exchange_layouts(self._exchanged(), self.param_avals, self.dims, size)
    self.sizes = self.layouts[0].sizes
    if self.parts:
      types = tuple((storage.part_key(v - len(self.param_avals)),
                     slots.SlotType.of(self.all_avals[v])) for v in self.parts)
      self.layouts = [storage.WithParts(layout, tuple(
          storage.part_key(v - len(self.param_avals)) for v, _ in stage.parts), types)
          for layout, stage in zip(self.layouts, self.stages)]
    if self.slotted:   # the exchanged leaves in shared slots, then each part in its own
      self._leaf_slots = slots.assign([[self._slot_type(i) for i in leaves]
                                       for leaves in self._exchanged()])
      parts = tuple((storage.part_key(v - len(self.param_avals)), self._slot_type(v))
                    for v in self.parts)
      self.slot_layouts = [slots.SlotLayout(
          layout.keys + tuple(storage.part_key(v - len(self.param_avals)) for v, _ in s.parts),
          layout.types + parts) for layout, s in zip(self._leaf_slots, self.stages)]
    return jax.tree.unflatten(self.params_def, out)

  def _rows_over_stage(self, i: int, spec: P) -> P:
    """A chunked leaf's stored spec: its rows (layers) over ``stage``, stage ``s`` holding
    chunk ``s``."""
    if len(spec) and spec[0] is not None:
      raise PlanError(_ROWS_TAKEN.format(path=self.param_paths[i], spec=spec,
                                         shape=tuple(self.param_avals[i].shape)))
    return P(STAGE, *tuple(spec)[1:])

  @property
  def _exchange_layouts(self) -> list[storage.ExchangeLayout]:
    """Per stage, the layout of what the exchange brings (``layouts`` without the parts)."""
    return [getattr(x, "exchanged", x) for x in self.layouts]

  def _exchanged(self) -> list[tuple[int, ...]]:
    """Per stage, the leaves the exchange brings (its parameters but its parts)."""
    return [tuple(i for i in s.params if i not in self.parts) for s in self.stages]

  def state_sharding(self, leaf: Any, param_sharding: NamedSharding) -> NamedSharding:
    """An optimizer-state leaf of a parameter: the parameter's sharding when the shapes agree,
    else (factored moments, adafactor) the leaf's own largest dimension over ``stage``."""
    spec = param_sharding.spec
    if len(spec) <= len(leaf.shape) and all(
        e is None or leaf.shape[d] % storage.axis_size(self.mesh, e) == 0
        for d, e in enumerate(spec)):
      return param_sharding
    size = self.mesh.shape[STAGE]
    return NamedSharding(self.mesh, storage.add_axis(P(), tuple(leaf.shape), STAGE, size) or P(),
                         memory_kind=param_sharding.memory_kind)

  def _slot_type(self, i: int) -> slots.SlotType:
    """Leaf (or part: one chunk's rows, with its leaf's spec) ``i`` in a slot."""
    a = self.all_avals[i]
    spec = tuple(self.param_specs[self.parts.get(i, i)])
    return slots.SlotType(tuple(a.shape), packing.dtype_name(a.dtype),
                          spec + (None,) * (len(a.shape) - len(spec)))

  def pack(self, params: Any) -> dict[str, jax.Array]:
    """The user's parameter tree -> ``{dtype: (S x v, size)}`` (traceable; rows: ``rows``);
    with tensor-parallel stages ``{slot: (S, *shape)}`` sharded ``P(stage, *spec)``."""
    leaves = jax.tree.leaves(params)
    if self.slotted:
      stacked = slots.stack(leaves, self._exchanged(), self._leaf_slots)
      stacked.update((storage.part_key(v - len(leaves)),
                      storage.interleave(leaves[i], self.schedule.num_virtual_stages,
                                         self.mesh))
                     for v, i in self.parts.items())
      types = dict(self.slot_layouts[0].types)
      return {k: jax.lax.with_sharding_constraint(
          v, NamedSharding(self.mesh, types[k].stacked_spec(STAGE))) for k, v in stacked.items()}
    out = storage.exchange(leaves, self._by_row(self._exchange_layouts),
                           self._by_row(self._exchanged()), self.dims, self.mesh)
    for v, i in self.parts.items():   # scanned layers, where stored (or interleaved)
      out[storage.part_key(v - len(leaves))] = jax.lax.with_sharding_constraint(
          storage.interleave(leaves[i], self.schedule.num_virtual_stages, self.mesh),
          NamedSharding(self.mesh, P(STAGE)))
    return out

  def pack_state(self, model_state: Any) -> dict[str, jax.Array]:
    """The model state tree -> ``{slot: (S, *shape)}`` over ``stage`` (empty without state)."""
    if not self.state_avals:
      return {}
    stacked = slots.stack([slots.as_data(x) for x in jax.tree.leaves(model_state)],
                          [s.state for s in self.stages], self.state_layouts)
    return {k: jax.lax.with_sharding_constraint(v, NamedSharding(self.mesh, P(STAGE)))
            for k, v in stacked.items()}

  def unpack_state(self, stacked: dict[str, jax.Array], model_state: Any) -> Any:
    """New state slots -> the model state tree; a leaf no stage keeps stays as it was."""
    if not self.state_avals:
      return model_state
    old = jax.tree.leaves(model_state)
    new = slots.unstack(stacked, [s.state for s in self.stages], self.state_layouts,
                        [slots.data_aval(a) for a in self.state_avals], total=False,
                        missing=[slots.as_data(x) for x in old])
    new = [slots.as_key(x, a) for x, a in zip(new, self.state_avals)]
    return jax.tree.unflatten(jax.tree.structure(model_state), new)

  def gradients_of(self, packed: dict[str, jax.Array]) -> Any:
    """Packed gradients -> the user's tree; a leaf held by several stages gets their sum (the
    transpose of ``pack``, which copies it to each)."""
    n = len(self.param_avals)
    parts = {storage.part_key(v - n): i for v, i in self.parts.items()}
    if self.slotted:
      leaves = slots.unstack(packed, self._exchanged(), self._leaf_slots, self.param_avals,
                             total=True)
    else:
      leaves = list(storage.exchange_gradients(
          {k: g for k, g in packed.items() if k not in parts}, self._by_row(self._exchange_layouts),
          self._by_row(self._exchanged()), self.dims, self.param_avals, self.mesh))
    for k, i in parts.items():
      leaves[i] = storage.deinterleave(packed[k], tuple(self.param_avals[i].shape), self.mesh)
    return jax.tree.unflatten(self.params_def, leaves)

  def _by_row(self, per_chunk: Sequence[Any]) -> list[Any]:
    return [per_chunk[c] for c in self.rows]

  @property
  def shared(self) -> dict[int, tuple[int, ...]]:
    """Parameter leaf -> its stages, for the leaves held by several stages (tied weights)."""
    return shared_params(self.stages)

  # -- the step -----------------------------------------------------------------------------
  def check_compiled(self, hlo_text: str) -> None:
    """Refuses a compiled step in which GSPMD put a collective inside a stage's branch that
    waits for devices of other stages: with ``model`` left to GSPMD (tensor-parallel stages)
    only that stage's devices reach it, and the step would hang. A ``collective-permute`` is
    refused whatever its pairs (XLA:CPU's waits for every device); another collective when one
    of its groups holds devices of two stages (or cannot be read)."""
    mesh_shape = tuple(self.mesh.devices.shape)
    stage_axis = list(self.mesh.axis_names).index(STAGE)

    def crosses(c: hlo.Collective) -> bool:
      if c.kind == "collective-permute":
        return True
      groups = c.device_groups(self.mesh.size)
      return groups is None or any(
          len({np.unravel_index(d, mesh_shape)[stage_axis] for d in g}) > 1 for g in groups)

    stuck = [c for c in hlo.collectives_in_branches(hlo_text) if crosses(c)]
    if stuck:
      raise PlanError(_PERMUTE_IN_STAGE.format(
          n=len(stuck), kinds=", ".join(sorted({c.kind for c in stuck})),
          shapes=", ".join(sorted({"+".join(c.shapes) for c in stuck})[:4]),
          splits=", ".join(f"'{s.name}': split({k})" for s, k in zip(self.stages, self.split)
                           if k > 1)))

  def gradients(self, features: Sequence[Feature], ctx: BuildContext) -> GradientFn:
    """The step's ``GradientFn`` over the user's parameter tree (packed inside the step)."""
    fns = []
    for stage in self.stages:
      fn = stage
      for f in features:
        fn = f.forward(fn, ctx)
      fns.append(fn)
    # Tensor-parallel stages: the loop is written for (data, stage); GSPMD splits ``model``.
    data_axes, manual = ((DATA,), frozenset({DATA, STAGE})) if self.slotted else (
        (DATA, MODEL), frozenset(self.mesh.axis_names))
    self.branches, self.branch_of = runtime.distinct_branches(
        self.stages, fns, self.all_avals, self.batch_avals, self.stash,
        param_layouts=self.slot_layouts if self.slotted else self.layouts,
        state_avals=self.state_avals,
        state_layouts=self.state_layouts, loop=(self.mesh, manual))
    self.buffers = runtime.buffer_sizes(self.branches)
    run = runtime.pipelined_gradients(
        self.branches, self.branch_of, self.aux_avals, self.schedule, self.mesh,
        data_axes, P(None, self.batch_axes), manual=manual)
    single = self.schedule.num_micro_batch == 1
    aux_def = self.aux_def

    def gradients(params, model_state, micro, fstate):
      scale = loss_scale(fstate)
      seed = jnp.ones((), jnp.float32) if scale is None else jnp.asarray(scale, jnp.float32)
      loss, aux, packed, state = run(self.pack(in_device_memory(params)),
                                     self.pack_state(model_state), jax.tree.leaves(micro), seed)
      grads = self.gradients_of(packed)
      aux = None if aux_def is None else jax.tree.unflatten(
          aux_def, [a[0] for a in aux] if single else aux)
      return loss, aux, grads, self.unpack_state(state, model_state)

    return gradients

  # -- the plan (``describe.py``) ------------------------------------------------------------
  @property
  def param_bytes_per_device(self) -> int:
    return describe.param_bytes_per_device(self)

  @property
  def packed_bytes_per_device(self) -> int:
    return describe.packed_bytes_per_device(self)

  def stage_info(self) -> list[StageInfo]:
    return describe.stage_info(self)

  def describe(self) -> list[str]:
    return describe.describe(self)


def plan_pipeline(*, loss_call: Callable, has_aux: bool, params_shape: Any, state_shape: Any,
                  param_paths: Sequence[str], state_paths: Sequence[str], micro_shapes: Any,
                  global_capture: Capture, layout: Layout, batch_axes: tuple[str, ...],
                  config: PipelineConfig, num_devices: int,
                  capture_options: dict | None = None) -> Pipeline:
  """Checks, local capture, stages, schedule (see the module doc). ``micro_shapes``: one
  micro batch of all replicas; ``capture_options``: as the Trainer's own capture had them, so
  the per-replica trace finds the same task graphs."""
  s_leaves, s_def = jax.tree.flatten(state_shape)
  split = [1] * (layout.num_stages * layout.num_virtual_stages)   # per stage (chunk)
  for tg in global_capture.taskgraphs:
    if tg.strategy == SPLIT:
      split[layout.stage_of[tg.index]] = max(split[layout.stage_of[tg.index]], tg.device_count)
  if any(k > 1 for k in split) and MODEL in batch_axes:   # internal invariant (specs.py)
    raise AssertionError("tensor-parallel stages with the batch split over model")
  if layout.num_virtual_stages > 1 and (s_leaves or any(k > 1 for k in split)):
    what = (f"model state ({listing(state_paths)})" if s_leaves else
            "tensor-parallel (epl.split) stages")
    raise PlanError(_VIRTUAL_WITH.format(v=layout.num_virtual_stages, what=what))
  shards = layout.num_replicas * (layout.devices_per_stage if MODEL in batch_axes else 1)
  local = jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] // shards, *x.shape[1:]),
                                                      x.dtype), micro_shapes)
  p_leaves, p_def = jax.tree.flatten(params_shape)
  b_leaves, b_def = jax.tree.flatten(local)
  found: dict[str, Any] = {}

  n_p, n_s = len(p_leaves), len(s_leaves)

  def flat_loss(*flat):
    params = jax.tree.unflatten(p_def, flat[:n_p])
    model_state = jax.tree.unflatten(s_def, flat[n_p:n_p + n_s])
    batch = jax.tree.unflatten(b_def, flat[n_p + n_s:])
    loss, aux, new_state = loss_call(params, model_state, batch)
    aux_leaves, found["aux_def"] = jax.tree.flatten(aux)
    return (loss, *aux_leaves, *jax.tree.leaves(new_state))

  # Traced outside any mesh: the stages replay these equations inside the pipeline's
  # shard_map, and an equation replays in the abstract mesh it was traced in.
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
    cap = capture(flat_loss, p_leaves + s_leaves, b_leaves,
                  input_paths=list(param_paths) + list(state_paths),
                  num_devices=num_devices, **(capture_options or {}))
  if [t.name for t in cap.taskgraphs] != [t.name for t in global_capture.taskgraphs]:
    raise AssertionError("the per-replica trace found other task graphs than the global one")
  outvars = cap.program.closed_jaxpr.jaxpr.outvars
  aux_avals = [v.aval for v in outvars[1:len(outvars) - n_s]]
  stages = cut_stages(cap, layout.stage_of, n_p, n_s, roll=config.roll_layers)
  # The model's own sharding constraints, onto the loop's mesh (``sharding.constraints``):
  # inside the stages only ``model`` of split stages is left to GSPMD.
  auto = frozenset({MODEL}) if any(k > 1 for k in split) else frozenset()
  notes: dict = {}
  stages = tuple(dataclasses.replace(s, jaxpr=constraints.fit(s.jaxpr, layout.mesh, auto,
                                                               f"stage '{s.name}'", notes))
                 for s in stages)
  if s_leaves and shards > 1:    # batch statistics over several replicas' rows
    means = stats.batch_means(stages, state_paths, shards)
    stages = tuple(dataclasses.replace(s, averaged=m, row_axes=batch_axes)
                   for s, m in zip(stages, means))
  schedule = make_schedule(config.strategy, layout.num_stages, config.num_micro_batch,
                           config.num_virtual_stages)
  if config.num_micro_batch < layout.num_stages:
    warnings.warn(_FEW_MICRO.format(m=config.num_micro_batch, s=layout.num_stages,
                                    bubble=schedule.bubble_fraction), PipelineWarning,
                  stacklevel=3)
  pipe = Pipeline(stages, p_leaves, p_def, b_leaves, aux_avals,
                  found["aux_def"] if has_aux else None, schedule, layout, batch_axes,
                  split=split, state_avals=s_leaves, state_def=s_def)
  pipe.param_paths = list(param_paths)
  pipe.constraints = constraints.plan_lines(notes)
  pipe.balance = check_balance(global_capture, layout.stage_of, len(stages),
                               [s.name for s in stages])
  return pipe


def chunk_rows(num_stages: int, num_virtual_stages: int) -> list[int]:
  """The chunk of each packed row: stage ``s`` holds chunks ``s, s + S, ..., s + (v - 1)S``
  (the interleaved layout) as its ``v`` consecutive rows, so sharding the rows over ``stage``
  gives every device its own chunks."""
  return [s + j * num_stages for s in range(num_stages) for j in range(num_virtual_stages)]


_ROWS_TAKEN = """\
Parameter '{path}' (shape {shape}) is a stack of layers each pipeline stage reads its own rows
of, so it is stored split over stage on its first dimension, but its spec {spec} already splits
that dimension. Leave the layers axis of scanned layers unsplit (map its logical axis name to
None, or give the parameter an epl.annotate spec that starts with None)."""

_PERMUTE_IN_STAGE = """\
The compiled pipeline step has {n} collective(s) ({kinds}: {shapes}) inside a tensor-parallel
stage's computation ({splits}) that wait for devices of other stages (any collective-permute
does, on CPU). GSPMD inserts these to move a model-split activation between devices; inside a
pipeline stage only that stage's devices run them, so the step would hang waiting for the
others, and it is not started. Keep each stage's model split on whole
dimensions the stage's matmuls contract or produce (Megatron's column then row), give the
stage's parameters explicit specs with epl.annotate, or use epl.replicate stages."""

_VIRTUAL_WITH = """\
pipeline.num_virtual_stages={v} interleaves stages whose parameters are packed into flat
buffers, one row per chunk; a pipeline with {what} keeps its stages' arrays whole (one per
stage), which interleaving does not support yet. Set pipeline.num_virtual_stages=1 (GPipe or
1F1B with the same stages), or cut the model without that feature."""

_FEW_MICRO = (
    "pipeline.num_micro_batch={m} is smaller than the {s} pipeline stages: at most {m} stages "
    "work at any time, and {bubble:.0%} of each step is pipeline bubble. Use num_micro_batch "
    ">= {s} (4 x the stages keeps the bubble under 20%).")
