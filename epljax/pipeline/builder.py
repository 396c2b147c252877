"""The pipeline as the Trainer sees it: one immutable plan, a parameter store and a gradient
function.

``plan_pipeline`` is called by ``Trainer._build`` when the mesh has more than one stage. It
traces the loss once more at the shapes one replica sees per micro batch, cuts the stages
(``partition.py``), averages batch statistics over the replicas (``stats.py``), picks the
schedule (``schedules.py``), decides where every parameter is stored (``storage.make_store``)
and returns a frozen ``Pipeline``, which prints (``describe()``, ``stage_info()``: its
``describe.Described``) without compiling anything:

- ``param_shardings``: ``TrainState.params`` is the user's parameter tree, each leaf sharded
  over ``stage`` too, so the optimizer (any optax one) and checkpoints see the user's leaves;
- ``store`` (``storage.ParamStore``): inside the step, between that tree and the loop's
  per-stage ``{dtype: (S, size)}`` buffers, or ``{slot: (S, *shape)}`` slots when stages are
  ``epl.split`` (``slots.py``) (a parameter used by two stages is copied to both, its two
  gradients summed); ``pack_state`` / ``unpack_state``: the model state, in slots;
- ``with_features(features, ctx)``: the same plan with its loop's branches (every feature's
  ``forward`` hook around each stage's forward; traced, not compiled), whose ``gradients()``
  is the ``GradientFn`` of the step (``runtime.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from epljax.config import PipelineConfig
from epljax import hlo
from epljax.errors import PipelineWarning, PlanError, listing
from epljax.features import BuildContext, Feature, GradientFn, loss_scale
from epljax.mesh import MODEL, STAGE, Layout
from epljax.pipeline import packing, runtime, slots, stats, storage
from epljax.pipeline.auto import check_balance
from epljax.pipeline.describe import Described
from epljax.pipeline.partition import Stage, cut_stages, shared_params
from epljax.pipeline.schedules import Schedule, make_schedule
from epljax.sharding import constraints
from epljax.sharding.capture import Capture, capture
from epljax.step import in_device_memory
from epljax.strategy import SPLIT


@dataclasses.dataclass(frozen=True, eq=False)
class Pipeline(Described):
  """What ``plan_pipeline`` worked out (see the module doc); ``with_features`` adds the loop's
  branches. Immutable: every property is read from the fields."""
  stages: tuple[Stage, ...]
  schedule: Schedule
  mesh: Mesh
  batch_axes: tuple[str, ...]
  params_def: Any
  param_paths: tuple[str, ...]
  batch_avals: tuple[Any, ...]
  aux_avals: tuple[Any, ...]
  aux_def: Any
  # Tensor-parallel stages (``split[s]`` > 1: epl.split(k)) keep their parameters whole, in
  # slots (``store.slotted``), and leave the ``model`` axis to GSPMD inside the loop.
  split: tuple[int, ...]
  store: storage.ParamStore
  # Model state (BatchNorm statistics): each leaf kept by the stage that updates it, in slots,
  # and threaded through the micro batches in order; with several replicas the batch means
  # are averaged over them (``stats.py``), so they are those of the micro batch, as on one
  # device.
  state_avals: tuple[Any, ...]
  state_layouts: tuple[packing.Layout, ...]
  state_types: Mapping[str, packing.SlotType]
  balance: tuple[str, ...]       # per stage: estimated FLOPs and parameter bytes
  constraints: tuple[str, ...]   # what became of the model's own sharding constraints
  loop: runtime.Loop | None = None    # the distinct stage functions (``with_features``)
  # ``pipeline.param_layout``: "user" (TrainState.params is the user's tree, packed inside
  # the step) or "stage" (TrainState.params is the loop's slots, ``to_user`` / ``to_internal``).
  param_layout: str = "user"

  @property
  def slotted(self) -> bool:
    """Tensor-parallel stages: parameters and residuals in slots, ``model`` left to GSPMD."""
    return self.store.split_model

  @property
  def in_stages(self) -> bool:
    """``pipeline.param_layout='stage'``: the train state holds each stage's leaves whole on
    its devices, in the loop's slots, and the optimizer updates those."""
    return self.param_layout == "stage"

  @property
  def parts(self) -> Mapping[int, int]:
    """Stacked leaves read by each stage in its own row chunk (``chunks.py``): part -> leaf."""
    return self.store.parts

  @functools.cached_property
  def all_avals(self) -> tuple[Any, ...]:
    """The avals of the user's leaves then of the parts (one chunk's rows): what stages take."""
    return (*self.store.avals, *(jax.ShapeDtypeStruct(t.shape, t.dtype)
                                 for t in self.store.part_types.values()))

  @property
  def shared(self) -> dict[int, tuple[int, ...]]:
    """Parameter leaf -> its stages, for the leaves held by several stages (tied weights)."""
    return shared_params(self.stages)

  # -- storage ------------------------------------------------------------------------------
  # TrainState.params is the user's parameter tree itself: any optax optimizer (masks,
  # multi_transform, adafactor), ZeRO and checkpoints see the user's leaves, each also sharded
  # over ``stage``; inside the step the store packs them into the loop's buffers and brings
  # the packed gradients back as the user's tree (``storage.ParamStore``).
  @property
  def user_param_shardings(self) -> Any:
    """Per user leaf: its spec (from the stage's strategy) with ``stage`` added."""
    return jax.tree.unflatten(self.params_def, list(self.store.shardings))

  @property
  def param_shardings(self) -> Any:
    """``TrainState.params``' shardings: the user's leaves', or the slots' (``in_stages``)."""
    if not self.in_stages:
      return self.user_param_shardings
    return {k: NamedSharding(self.mesh, P(STAGE, *t.spec)) for k, t in self.store.buffers.items()}

  @functools.cached_property
  def params_shape(self) -> Any:
    """``TrainState.params``' shapes with ``in_stages``: ``{slot: (S, *shape)}``."""
    n = self.schedule.num_stages
    return {k: jax.ShapeDtypeStruct((n, *t.shape), t.dtype)
            for k, t in self.store.buffers.items()}

  def to_internal(self, params: Any, dtype: Any = None) -> Any:
    """The user's parameter tree -> ``TrainState.params`` (traceable; in ``dtype``, default
    the leaves' own): a leaf tied across stages is held by the first stage that reads it
    (``slots.tied_rows``)."""
    if not self.in_stages:
      return params
    return self._tied(self.store.pack(jax.tree.leaves(params), dtype), "own")

  def _tied(self, buffers: Mapping[str, jax.Array], mode: str) -> dict[str, jax.Array]:
    return slots.tied_rows(buffers, self.store.layouts, self.store.members,
                           tuple(self.shared), self.mesh, mode)

  def to_user(self, params: Any) -> Any:
    """``TrainState.params`` (or a tree like it: gradients, moments) -> the user's tree."""
    if not self.in_stages:
      return params
    return jax.tree.unflatten(self.params_def, self.store.unpack(params))

  def opt_to_user(self, opt_state: Any) -> Any:
    """The optimizer state on the slots -> as the optimizer makes it on the user's tree (each
    parameter-shaped part, a moment, converted like the parameters)."""
    return self._map_moments(opt_state, self._like_internal, self.to_user)

  def opt_to_internal(self, opt_state: Any) -> Any:
    def moment(x):   # in its own dtype (a float32 or bfloat16 ``mu_dtype``), never rounded
      dtypes = {v.dtype for v in jax.tree.leaves(x)}   # to the parameters'
      return self.to_internal(x, dtypes.pop() if len(dtypes) == 1 else None)

    return self._map_moments(opt_state, self._like_user, moment)

  def _map_moments(self, opt_state: Any, like: Callable, fn: Callable) -> Any:
    if not self.in_stages:
      return opt_state
    return jax.tree.map(lambda x: fn(x) if like(x) else x, opt_state, is_leaf=like)

  def _like_internal(self, x: Any) -> bool:
    want = self.params_shape
    return (isinstance(x, dict) and set(x) == set(want) and all(
        tuple(getattr(x[k], "shape", ())) == want[k].shape for k in want))

  def _like_user(self, x: Any) -> bool:
    leaves, tree = jax.tree.flatten(x)
    return tree == self.params_def and all(
        tuple(getattr(v, "shape", ())) == tuple(a.shape) for v, a in zip(leaves, self.store.avals))

  def check_stage_layout(self, optimizer: Any) -> None:
    """``in_stages``: refuses what the slots cannot hold (interleaved chunks, a leaf no stage
    reads) and an optimizer that would update the slots otherwise than the user's tree: its
    state on the slots is not its state on the user's tree converted moment by moment (masks,
    multi_transform, factored moments), or two updates of small stand-ins differ (a mask, a
    norm or trust ratio over a whole leaf)."""
    if not self.in_stages:
      return
    if self.schedule.num_virtual_stages > 1:
      raise PlanError(_STAGE_LAYOUT.format(what=(
          f"pipeline.num_virtual_stages={self.schedule.num_virtual_stages} (interleaved "
          "chunks); a stage holds its chunks' leaves in one row"),
          fix="Set pipeline.num_virtual_stages=1, or keep param_layout='user'"))
    held = {i for m in self.store.members for i in m} | set(self.store.parts.values())
    unread = [self.param_paths[i] for i in range(len(self.store.avals)) if i not in held]
    if unread:
      raise PlanError(_STAGE_LAYOUT.format(what=(
          f"parameters no stage reads: {listing(unread)}; the slots hold only what a stage "
          "reads"), fix="Remove them from the model or keep param_layout='user'"))
    user_shape = jax.tree.unflatten(self.params_def, [
        jax.ShapeDtypeStruct(a.shape, a.dtype) for a in self.store.avals])
    on_user = jax.eval_shape(optimizer.init, user_shape)
    slots_text = listing([f"{k} {tuple(a.shape)}" for k, a in self.params_shape.items()])
    try:   # a mask or label tree of the user's structure cannot even be applied to the slots
      converted = jax.eval_shape(self.opt_to_user,
                                 jax.eval_shape(optimizer.init, self.params_shape))
    except (ValueError, TypeError, KeyError) as e:
      raise PlanError(_STAGE_OPTIMIZER.format(
          n=len(self.params_shape), slots=slots_text,
          differs=f"its init fails on the slots: {type(e).__name__}: "
                  f"{_short(str(e).splitlines()[0] if str(e) else '', 200)}")) from e
    differs = _first_difference(on_user, converted)
    if differs is not None:
      raise PlanError(_STAGE_OPTIMIZER.format(n=len(self.params_shape), slots=slots_text,
                                              differs=differs))
    differs = self._probe(optimizer)
    if differs is not None:
      raise PlanError(_STAGE_UPDATE.format(path=differs))

  def _probe(self, optimizer: Any) -> str | None:
    """Two updates of ``optimizer`` on small random stand-ins of the user's leaves (each
    dimension at most 3; a stacked leaf's layers one per stage) and on the same values in
    slots, compared: they differ where the update reads a leaf's path, shape or norm (a mask,
    LAMB's trust ratio) rather than each element. The first leaf whose result differs, or
    None."""
    store, n, stages = self.store, len(self.store.avals), self.schedule.num_stages
    parts = {i: storage.part_key(v - n) for v, i in store.parts.items()}
    shapes = [(stages, *(min(d, 3) for d in a.shape[1:])) if i in parts else
              tuple(min(d, 3) for d in a.shape) for i, a in enumerate(store.avals)]
    # float32 whatever the parameters' dtype: whether the update is elementwise does not
    # depend on it, and a difference must not hide under bfloat16 rounding.
    rows: dict[str, dict[int, int]] = {}   # slot -> {row: the leaf at home there}
    for i, (key, row) in store.homes.items():
      rows.setdefault(key, {})[row] = i
    rng = np.random.default_rng(0)

    def draw():
      return [rng.standard_normal(s).astype(np.float32) for s in shapes]

    def to_slots(leaves):   # as ``to_internal`` holds them, at the stand-ins' sizes
      out = {k: jnp.stack([leaves[at[s]] if s in at else
                           jnp.zeros_like(leaves[next(iter(at.values()))])
                           for s in range(stages)]) for k, at in rows.items()}
      return {**out, **{k: leaves[i][:, None] for i, k in parts.items()}}

    def from_slots(tree):
      return [tree[parts[i]][:, 0] if i in parts else tree[store.homes[i][0]][store.homes[i][1]]
              for i in range(n)]

    def train(params, grads, as_tree):   # each step's updates
      params, steps = as_tree(params), []
      state = optimizer.init(params)
      for g in grads:
        updates, state = optimizer.update(as_tree(g), state, params)
        params = optax.apply_updates(params, updates)
        steps.append(updates)
      return steps

    # The updates, not the parameters, are compared, each against its own size: a weight
    # decay a mask leaves out is a small part of a parameter, but not of its update (three
    # steps, so that a learning rate warming up from zero still moves the last two).
    params, grads = draw(), [draw() for _ in range(3)]
    on_user = jax.jit(lambda p, g: train(
        p, g, lambda x: jax.tree.unflatten(self.params_def, x)))(params, grads)
    on_slots = jax.jit(lambda p, g: train(p, g, to_slots))(params, grads)
    for user_step, slot_step in zip(on_user, on_slots):
      for i, (u, v) in enumerate(zip(jax.tree.leaves(user_step), from_slots(slot_step))):
        u, v = np.asarray(u, np.float32), np.asarray(v, np.float32)
        scale = max(float(np.abs(u).max(initial=0.0)), float(np.abs(v).max(initial=0.0)))
        if not np.allclose(u, v, rtol=1e-4, atol=1e-5 * scale):
          return self.param_paths[i]
    return None

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

  def pack_state(self, model_state: Any) -> dict[str, jax.Array]:
    """The model state tree -> ``{slot: (S, *shape)}`` over ``stage`` (empty without state)."""
    if not self.state_avals:
      return {}
    stacked = slots.stack([slots.as_data(x) for x in jax.tree.leaves(model_state)],
                          [s.state for s in self.stages], self.state_layouts, self.state_types)
    return {k: jax.lax.with_sharding_constraint(v, NamedSharding(self.mesh, P(STAGE)))
            for k, v in stacked.items()}

  def unpack_state(self, stacked: dict[str, jax.Array], model_state: Any) -> Any:
    """New state slots -> the model state tree (each leaf kept by one stage,
    ``partition.cut_stages``); a leaf no stage keeps stays as it was."""
    if not self.state_avals:
      return model_state
    old = jax.tree.leaves(model_state)
    new = slots.unstack(stacked, [s.state for s in self.stages], self.state_layouts,
                        [slots.data_aval(a) for a in self.state_avals],
                        missing=[slots.as_data(x) for x in old])
    new = [slots.as_key(x, a) for x, a in zip(new, self.state_avals)]
    return jax.tree.unflatten(jax.tree.structure(model_state), new)

  # -- the step -----------------------------------------------------------------------------
  @property
  def _manual(self) -> frozenset[str]:
    """The mesh axes the loop is written for: its data axes and ``stage``."""
    return frozenset({*self.store.data_axes, STAGE})

  def check_compiled(self, hlo_text: str, platform: str | None = None) -> None:
    """Refuses a compiled step in which GSPMD put a collective inside a stage's branch that
    waits for devices of other stages: with ``model`` left to GSPMD (tensor-parallel stages)
    only that stage's devices reach it, and the step would hang. Another collective is refused
    when one of its groups holds devices of two stages (or cannot be read); a
    ``collective-permute`` by what the platform (the mesh's, or ``platform``) runs it with
    (``_PERMUTE_WAITS``)."""
    platform = platform or self.mesh.devices.flat[0].platform
    mesh_shape = tuple(self.mesh.devices.shape)
    stage_axis = list(self.mesh.axis_names).index(STAGE)

    def one_stage(groups: list[list[int]] | None) -> bool:
      return groups is not None and all(
          len({np.unravel_index(d, mesh_shape)[stage_axis] for d in g}) == 1 for g in groups)

    by_pairs = platform == "gpu" and _GPU_PERMUTE_BY_PAIRS in os.environ.get("XLA_FLAGS", "")
    stuck = []
    for c in hlo.collectives_in_branches(hlo_text, in_loops=True):
      if c.kind != "collective-permute":
        waits = not one_stage(c.device_groups(self.mesh.size))
      else:   # XLA:GPU's clique: the components of its pairs (by that flag), or every device
        waits = not (by_pairs and c.source_target_pairs and one_stage(c.connected()))
      if waits:
        stuck.append(c)
    if stuck:
      raise PlanError(_PERMUTE_IN_STAGE.format(
          n=len(stuck), kinds=", ".join(sorted({c.kind for c in stuck})),
          shapes=", ".join(sorted({"+".join(c.shapes) for c in stuck})[:4]),
          splits=", ".join(f"'{s.name}': split({k})" for s, k in zip(self.stages, self.split)
                           if k > 1),
          why=_PERMUTE_WAITS.get(platform, _PERMUTE_WAITS["other"]).format(platform=platform)
          if any(c.kind == "collective-permute" for c in stuck) else
          "a group of each holds devices of two stages"))

  def executed_collectives(self, hlo_text: str) -> list[hlo.Collective]:
    """The collectives one device of the busiest stage executes in a step of the compiled
    ``hlo_text``: the tick loop's switches hold every stage's branch, and a device runs its
    stage's in the ticks its schedule says (``runtime.branch_shares``); the stage whose
    collectives move the most bytes."""
    if self.loop is None:   # internal invariant: build.py adds the features first
      raise AssertionError("Pipeline.executed_collectives before with_features")
    per_stage = hlo.executed_on_each(hlo_text, [runtime.branch_shares(
        self.loop, self.schedule, s) for s in range(self.schedule.num_stages)])
    return max(per_stage, key=lambda found: sum(c.bytes for c in found))

  def with_features(self, features: Sequence[Feature], ctx: BuildContext) -> Pipeline:
    """This pipeline with its loop's branches: every feature's ``forward`` hook around each
    stage's forward, one branch per distinct result (traced, not compiled)."""
    fns = []
    for stage in self.stages:
      fn = stage
      for f in features:
        fn = f.forward(fn, ctx)
      fns.append(fn)
    loop = runtime.make_loop(
        self.stages, fns, self.all_avals, self.batch_avals, self.store,
        state_avals=self.state_avals, state_layouts=self.state_layouts,
        state_types=self.state_types, loop=(self.mesh, self._manual))
    return dataclasses.replace(self, loop=loop)

  def gradients(self) -> GradientFn:
    """The step's ``GradientFn`` over the user's parameter tree (packed inside the step)."""
    if self.loop is None:   # internal invariant: build.py adds the features first
      raise AssertionError("Pipeline.gradients before with_features")
    run = runtime.pipelined_gradients(
        self.loop, self.aux_avals, self.schedule, self.mesh, self.store.data_axes,
        P(None, self.batch_axes), manual=self._manual)
    single = self.schedule.num_micro_batch == 1
    aux_def, store, params_def = self.aux_def, self.store, self.params_def

    def gradients(params, model_state, micro, fstate):
      scale = loss_scale(fstate)
      seed = jnp.ones((), jnp.float32) if scale is None else jnp.asarray(scale, jnp.float32)
      params = in_device_memory(params)
      buffers = (self._tied(params, "fill") if self.in_stages else
                 store.pack(jax.tree.leaves(params)))
      loss, aux, packed, state = run(buffers, self.pack_state(model_state),
                                     jax.tree.leaves(micro), seed)
      grads = (self._tied(packed, "sum") if self.in_stages else
               jax.tree.unflatten(params_def, store.gradients_of(packed)))
      aux = None if aux_def is None else jax.tree.unflatten(
          aux_def, [a[0] for a in aux] if single else aux)
      return loss, aux, grads, self.unpack_state(state, model_state)

    return gradients


def plan_pipeline(*, loss_call: Callable, has_aux: bool, params_shape: Any, state_shape: Any,
                  param_paths: Sequence[str], state_paths: Sequence[str], micro_shapes: Any,
                  global_capture: Capture, layout: Layout, batch_axes: tuple[str, ...],
                  config: PipelineConfig, num_devices: int, param_specs: Sequence[P],
                  capture_options: dict | None = None) -> Pipeline:
  """Checks, local capture, stages, schedule, parameter store (see the module doc).
  ``micro_shapes``: one micro batch of all replicas; ``param_specs``: per parameter leaf, its
  spec from its stage's strategy; ``capture_options``: as the Trainer's own capture had them,
  so the per-replica trace finds the same task graphs."""
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
  state_layouts, state_types = packing.assign([
      [packing.SlotType.of(slots.data_aval(s_leaves[j])) for j in s.state] for s in stages])
  return Pipeline(
      stages=stages, schedule=schedule, mesh=layout.mesh, batch_axes=batch_axes,
      params_def=p_def, param_paths=tuple(param_paths), batch_avals=tuple(b_leaves),
      aux_avals=tuple(aux_avals), aux_def=found["aux_def"] if has_aux else None,
      split=tuple(split), store=storage.make_store(stages, p_leaves, param_specs, param_paths,
                                                   layout.mesh, split,
                                                   layout.num_virtual_stages,
                                                   in_slots=config.param_layout == "stage"),
      param_layout=config.param_layout,
      state_avals=tuple(s_leaves), state_layouts=tuple(state_layouts),
      state_types=state_types,
      balance=tuple(check_balance(global_capture, layout.stage_of, len(stages),
                                  [s.name for s in stages])),
      constraints=tuple(constraints.plan_lines(notes)))


def _short(tree: Any, limit: int = 300) -> str:
  text = str(tree)
  return text if len(text) <= limit else text[:limit] + " ..."


def _first_difference(want: Any, got: Any) -> str | None:
  """Where an optimizer state converted from the slots (``got``) first differs from its state
  on the user's tree (``want``), in words, or None."""
  want_leaves, got_leaves = (jax.tree_util.tree_flatten_with_path(t)[0] for t in (want, got))
  for (path, a), (other, b) in zip(want_leaves, got_leaves):
    if path != other:
      return (f"at {jax.tree_util.keystr(path)} its state on the user's tree has a leaf where "
              f"its state on the slots has {jax.tree_util.keystr(other)}")
    if (a.shape, a.dtype) != (b.shape, b.dtype):
      return (f"at {jax.tree_util.keystr(path)}: {tuple(a.shape)} {a.dtype} on the user's "
              f"tree, {tuple(b.shape)} {b.dtype} on the slots")
  if len(want_leaves) != len(got_leaves):
    return (f"{len(want_leaves)} leaves on the user's tree, {len(got_leaves)} on the slots "
            f"({_short(jax.tree.structure(got), 200)})")
  if jax.tree.structure(want) != jax.tree.structure(got):
    return f"its structure: {_short(jax.tree.structure(got), 200)}"
  return None


_STAGE_LAYOUT = """\
pipeline.param_layout='stage' keeps each stage's parameters whole on its own devices, in the
slots its loop reads, but this pipeline has {what}. {fix} (the user's tree, each leaf split
over stage)."""

_STAGE_OPTIMIZER = """\
pipeline.param_layout='stage' runs the optimizer on the stages' slots ({n} arrays: {slots})
instead of the user's tree, which updates them the same only when the optimizer treats each
leaf elementwise (AdamW, SGD, momentum, Lion). This optimizer's state on the slots is not its
state on the user's tree moment by moment, so it reads a leaf's path or shape (a mask,
multi_transform, factored moments like adafactor's): {differs}.
Keep pipeline.param_layout='user' (the default) for this optimizer."""

_STAGE_UPDATE = """\
pipeline.param_layout='stage' runs the optimizer on the stages' slots, one (stages, *shape)
array per kind of leaf, instead of the user's tree. This optimizer updates them differently
(checked on small random stand-ins at init: '{path}' differs), so its update reads a leaf's
path, shape or norm (a weight-decay mask, LAMB's trust ratio) rather than each element. Keep
pipeline.param_layout='user' (the default) for this optimizer."""


_GPU_PERMUTE_BY_PAIRS = "--xla_gpu_collective_permute_connected_components=true"

# What a collective-permute inside one stage's branch waits for, per platform. XLA:CPU: every
# device of the program. XLA:GPU (read in its runtime, and compiled for H100s: GSPMD's permute
# stays in the stage's branch as a collective-permute-start, its pairs within each model group):
# its NCCL clique, by default every device of the program, whose first call ends in a rendezvous
# of the clique's local devices, so a device of another stage never arrives; with the flag it is
# the connected components of its pairs, refused only when one spans two stages.
_PERMUTE_WAITS = {
    "cpu": "XLA:CPU's collective-permute waits for every device of the program",
    "gpu": ("XLA:GPU's collective-permute joins a clique of every device at its first call; "
            f"with XLA_FLAGS={_GPU_PERMUTE_BY_PAIRS} its clique is the devices its pairs "
            "connect, and one within a stage passes"),
    "other": "a collective-permute inside a branch is not checked on {platform}: refused",
}

_PERMUTE_IN_STAGE = """\
The compiled pipeline step has {n} collective(s) ({kinds}: {shapes}) inside a tensor-parallel
stage's computation ({splits}) that wait for devices of other stages ({why}). GSPMD inserts
these to move a model-split activation between devices; inside a pipeline stage only that
stage's devices run them, so the step would hang waiting for the others, and it is not
started. Keep each stage's model split on whole dimensions the stage's matmuls contract or
produce (Megatron's column then row), give the stage's parameters explicit specs with
epl.annotate, or use epl.replicate stages."""

_VIRTUAL_WITH = """\
pipeline.num_virtual_stages={v} interleaves stages whose parameters are packed into flat
buffers, one row per chunk; a pipeline with {what} keeps its stages' arrays whole (one per
stage), which interleaving does not support yet. Set pipeline.num_virtual_stages=1 (GPipe or
1F1B with the same stages), or cut the model without that feature."""

_FEW_MICRO = (
    "pipeline.num_micro_batch={m} is smaller than the {s} pipeline stages: at most {m} stages "
    "work at any time, and {bubble:.0%} of each step is pipeline bubble. Use num_micro_batch "
    ">= {s} (4 x the stages keeps the bubble under 20%).")
