"""What ``Trainer.init`` works out: from ``init_fn``, ``loss_fn`` and a batch to the jitted
step and its plan, in six steps, each a function below.

1. ``trace_variables``: ``init_fn`` on abstract values -> the variables' structure.
2. ``capture_loss``: ``loss_fn`` traced -> the task graph of every equation and variable.
3. ``place``: the mesh, the batch layout, every variable's spec (split rules, user specs) and,
   for pipeline stages, the packed parameter storage.
4. the features (memory, communication) change the shardings and wrap the step's pieces.
5. ``compile_functions``: the jitted init, step, gradient and forward functions, with explicit
   shardings.
6. ``make_plan``: the printable plan.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from epljax import batch as batch_lib
from epljax import communication, memory
from epljax import cost as cost_lib
from epljax import pipeline as pipeline_lib
from epljax import search
from epljax import step as step_lib
from epljax import strategy as strategy_lib
from epljax.errors import PlanError
from epljax.features import BuildContext, Feature, StateShardings
from epljax.mesh import DATA, MODEL, Layout, abstract_mesh, build_mesh
from epljax.nn import context as context_lib
from epljax.pipeline.auto import auto_stage_cuts, check_auto, scan_split
from epljax.plan import EVERY_STAGE, Leaf, Plan, leaf_bytes_per_device, tree_bytes_per_device
from epljax.sharding import annotations, constraints, reductions
from epljax.sharding import specs as specs_lib
from epljax.sharding.capture import Capture, capture, defining_frames
from epljax.sharding.fused import FusedLayouts
from epljax.step import TrainState
from epljax.user_state import UserState
from epljax.variables import Model


@dataclasses.dataclass(frozen=True)
class UserFns:
  """What the user gave the Trainer."""
  init_fn: Callable[[Any, Any], Any]
  loss_fn: Callable[[Any, Any], Any]
  optimizer: optax.GradientTransformation
  has_aux: bool
  mutable: tuple[str, ...]
  clip_norm: float | None


@dataclasses.dataclass
class Built:
  """What ``Trainer.init`` worked out; fixed for the Trainer's life."""
  model: Model
  capture: Capture
  layout: Layout
  batch_plan: batch_lib.BatchPlan
  state_shardings: TrainState
  init_jit: Any
  step_jit: Any
  grads_jit: Any
  loss_jit: Any
  batch_sharding: NamedSharding       # every global batch leaf: rows over the batch axes
  plan: Plan
  user_params: Callable[[Any], Any]   # TrainState.params -> the user's tree (pipeline: unpack)
  state_treedef: Any                  # of the TrainState that init and train_step return
  first_step_checks: list = dataclasses.field(default_factory=list)
  eval_jit: Any = None
  user_state: Any = None              # epljax.user_state.UserState: what checkpoints hold
  waits_each_step: bool = False       # step.waits_each_step (XLA:CPU)

  def to_user(self, state: TrainState) -> dict:
    """The state in the user's structure (params, optimizer and model state; never packed)."""
    return self.user_state.to_user(state)

  def from_user(self, tree: dict) -> TrainState:
    """``to_user``'s tree -> a ``TrainState`` in this trainer's layout and shardings."""
    return self.user_state.from_user(tree)


@dataclasses.dataclass(frozen=True)
class Variables:
  """Step 1: the variables' structure, and the loss as a function of (params, model state)."""
  model: Model
  init_jaxpr: Any
  params_shape: Any
  state_shape: Any
  loss_call: Callable
  paths: tuple[str, ...]   # params' leaves, then the model state's

  @property
  def num_params(self) -> int:
    return len(jax.tree.leaves(self.params_shape))

  @property
  def leaves(self) -> list[Any]:
    return jax.tree.leaves(self.params_shape) + jax.tree.leaves(self.state_shape)


@dataclasses.dataclass(frozen=True)
class Placement:
  """Step 3: where everything lives."""
  layout: Layout
  batch_plan: batch_lib.BatchPlan
  leaf_specs: list[specs_lib.LeafSpec]    # per variable leaf, in the user's structure
  pipe: Any                               # epljax.pipeline.Pipeline, or None
  opt_shape: Any
  shardings: StateShardings
  fused: FusedLayouts    # fused parameters held part by part (``sharding.fused``)
  # ``pipeline.param_layout='stage'``: the params' and optimizer state's shardings in the
  # user's tree (what checkpoints and Trainer.variables hold); None: ``shardings``' own.
  user_shardings: StateShardings | None = None

  @property
  def in_stages(self) -> bool:
    """The train state holds the pipeline's slots (``Pipeline.in_stages``)."""
    return self.pipe is not None and self.pipe.in_stages

  def stored_shape(self, params_shape: Any) -> Any:
    """The user's params shape -> ``TrainState.params``' shape."""
    return self.pipe.params_shape if self.in_stages else params_shape

  def to_user(self, params: Any) -> Any:
    """``TrainState.params`` (or gradients like them) -> the user's tree and order."""
    return self.fused.to_user(self.pipe.to_user(params) if self.in_stages else params)

  def to_internal(self, params: Any) -> Any:
    params = self.fused.to_internal(params)
    return self.pipe.to_internal(params) if self.in_stages else params


@dataclasses.dataclass(frozen=True)
class CaptureOptions:
  """How the loss is captured (``sharding.capture.capture``'s options, the pipeline's
  per-replica capture too): the ``epl.annotate`` module rules and default strategy in force,
  where ``init_fn`` defined each variable, and with ``auto.auto_parallel``'s stages the split
  of scanned layers and the stage cuts."""
  module_rules: Sequence[Any]
  defaults: strategy_lib.Defaults | None
  definitions: Sequence[Any]                 # per variable leaf (``defining_frames``)
  rewrite: Callable[[Any], Any] | None = None   # one scan per stage (``scan_split``)
  stage_cuts: Sequence[int] | None = None    # node indices where stages 1.. start

  def kwargs(self) -> dict[str, Any]:
    """As ``capture``'s keyword arguments."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True)
class Steps:
  """Steps 1 to 4 (traced, nothing compiled): the variables, the task graphs, where
  everything lives with the features' shardings, the features and their context."""
  variables: Variables
  capture: Capture
  placement: Placement
  features: list[Feature]
  context: BuildContext


@dataclasses.dataclass(frozen=True)
class Jitted:
  """Step 5: the jitted functions, the shardings they take, and the plan's line of the gradient
  sums (``_shared_reductions``)."""
  init: Any        # (rng, global batch) -> TrainState
  step: Any        # (state, global batch) -> (state, metrics); donates the state
  grads: Any       # (state, global batch) -> (loss, the gradients in the user's tree)
  loss: Any        # (state, global batch) -> the first micro batch's loss
  eval: Any        # (state, global batch) -> metrics
  state_shardings: TrainState
  batch_sharding: NamedSharding           # every global batch leaf: rows over the batch axes
  user_params: Callable[[Any], Any]       # TrainState.params -> the user's tree
  gradient_sums: Any   # "" (none), a str, or the fused forward (its ``describe``)


# The mesh is not known before the capture; a provisional one with the same axis names lets
# model code that asks for the mesh (NNX eager sharding) trace.
_PROVISIONAL = abstract_mesh()


def build(fns: UserFns, config, cluster, rng: jax.Array, batch: Any,
          scope: search.Scope | None = None) -> Built:
  """The six steps of the module doc, outside a mesh the caller set (``jax.set_mesh``).
  ``scope``: a plan search's candidate task graph in place of the user's default strategy and
  ``epl.annotate`` module rules (read, never written)."""
  with constraints.outside_set_mesh():
    return _build(fns, config, cluster, rng, batch, scope)


def _build(fns: UserFns, config, cluster, rng: jax.Array, batch: Any,
           scope: search.Scope | None = None) -> Built:
  rows, micro_shapes = _micro_shapes(config, batch)
  if config.auto.auto_parallel and config.pipeline.num_stages is None:
    return search.search(fns, config, cluster, rng, batch,
                         search.Builders(build, pipeline_plan))   # the plan, searched
  steps = plan_steps(fns, config, cluster, rng, micro_shapes, rows, scope)
  var, where, features = steps.variables, steps.placement, steps.features
  fstate = {f.name: f.init_state(steps.context) for f in features}
  fstate[step_lib.NONFINITE_RUN] = np.zeros((), np.int32)
  by_cond = _skips_by_cond(where, features)
  jitted = compile_functions(fns, steps, fstate, rows, by_cond)
  skip = step_lib.describe_skip(by_cond)
  waits = step_lib.waits_each_step(where.layout.mesh)
  lines = [jitted.gradient_sums, skip, step_lib.describe_wait(waits),
           _context_line(var, where, micro_shapes)]
  plan = make_plan(steps, [*features, *filter(None, lines)], fstate, jitted, batch, rows,
                   target=cost_lib.Target.of(config, cluster))
  state_shardings = jitted.state_shardings
  user = UserState(state_shardings=state_shardings, params_shape=var.params_shape,
                   state_shape=var.state_shape, optimizer=fns.optimizer, feature_state=fstate,
                   fused=where.fused, stages=where.pipe if where.in_stages else None,
                   user_shardings=where.user_shardings)
  return Built(var.model, steps.capture, where.layout, where.batch_plan, state_shardings,
               init_jit=jitted.init, step_jit=jitted.step, grads_jit=jitted.grads,
               loss_jit=jitted.loss, batch_sharding=jitted.batch_sharding, plan=plan,
               user_params=jitted.user_params,
               state_treedef=jax.tree.structure(state_shardings),
               first_step_checks=[f.after_first_step for f in features],
               eval_jit=jitted.eval, user_state=user, waits_each_step=waits)


def pipeline_plan(fns: UserFns, config, cluster, rng: jax.Array, batch: Any,
                  scope: search.Scope | None = None):
  """The pipeline plan (``epljax.pipeline.Pipeline``, None without stages) of a configuration
  with ``pipeline.num_stages`` set: steps 1 to 4, traced, nothing compiled. What a search
  weighs a stage candidate by: ``pipe.text()`` prints it as ``print(trainer.plan)`` would,
  ``pipe.param_bytes_per_device`` is what a device stores."""
  rows, micro_shapes = _micro_shapes(config, batch)
  with constraints.explained():
    return plan_steps(fns, config, cluster, rng, micro_shapes, rows, scope).placement.pipe


def _micro_shapes(config, batch: Any) -> tuple[int, Any]:
  """The global batch's rows and the shapes of one micro batch (all replicas)."""
  num_micro = config.pipeline.num_micro_batch
  rows = batch_lib.leading_rows(batch) * jax.process_count()
  if rows % num_micro:
    raise PlanError(f"The global batch of {rows} rows does not divide into "
                    f"pipeline.num_micro_batch={num_micro} micro batches. Use a multiple of "
                    f"{num_micro} rows.")
  return rows, jax.tree.map(
      lambda x: jax.ShapeDtypeStruct((rows // num_micro, *jnp.shape(x)[1:]),
                                     batch_lib._dtype(x)), batch)


def plan_steps(fns: UserFns, config, cluster, rng: jax.Array, micro_shapes: Any, rows: int,
               scope: search.Scope | None = None) -> Steps:
  """Steps 1 to 4 (traced, nothing compiled): the variables, the task graphs, where everything
  lives with the features' shardings, the features and their context."""
  num_micro = config.pipeline.num_micro_batch
  var = trace_variables(fns, rng, micro_shapes)
  rules, defaults = annotations.module_rules(), strategy_lib.Defaults.current()
  if scope is not None:
    rules, defaults = [*rules, *scope.module_rules], scope.defaults or defaults
  options = CaptureOptions(rules, defaults, defining_frames(var.init_jaxpr))
  cap = capture_loss(var, micro_shapes, len(cluster.devices), options)
  if config.auto.auto_parallel:   # EPL's automatic pipeline partitioning
    check_auto(cap, config.pipeline.num_stages)
    stages, virtual = config.pipeline.num_stages, config.pipeline.num_virtual_stages
    n_chunks = stages * virtual
    unit = "stages" if virtual == 1 else f"chunks ({stages} stages x {virtual} virtual)"
    split, not_split = scan_split(cap, n_chunks, var.num_params, len(var.paths), unit)
    if split is not None:   # scanned layers: one scan per stage (per chunk, interleaved)
      options = dataclasses.replace(options, rewrite=split)
      cap = capture_loss(var, micro_shapes, len(cluster.devices), options)
    options = dataclasses.replace(
        options, stage_cuts=auto_stage_cuts(cap, n_chunks, not_split, unit))
    cap = capture_loss(var, micro_shapes, len(cluster.devices), options)
  where = place(fns, var, cap, micro_shapes, rows, config, cluster, options)
  mesh = where.layout.mesh
  ctx = BuildContext(mesh=mesh, num_replicas=where.layout.num_replicas,
                     num_micro_batch=num_micro, capture=cap, params_shape=var.params_shape,
                     optimizer=fns.optimizer,
                     state_params_shape=where.pipe.params_shape if where.in_stages else None)
  features = features_for(config, fns.clip_norm)
  if where.in_stages:
    _check_stage_features(features)
  shardings = where.shardings
  for f in features:
    shardings = f.shardings(shardings, ctx)
  where = dataclasses.replace(where, shardings=shardings)
  ctx = dataclasses.replace(ctx, shardings=shardings)
  if where.pipe is not None:   # the pipeline's branches: its stages with the features' hooks
    where = dataclasses.replace(where, pipe=where.pipe.with_features(features, ctx))
  return Steps(var, cap, where, features, ctx)


def _check_stage_features(features: Sequence[Feature]) -> None:
  """``pipeline.param_layout='stage'`` with a feature that places or updates the parameters
  leaf by leaf in the user's tree: refused, naming it."""
  kinds = (memory.offload.Offload, memory.grouped.GroupedApply)
  found = [f.name for f in features if isinstance(f, kinds)]
  if found:
    raise PlanError(
        f"pipeline.param_layout='stage' holds the stages' parameters in the loop's slots, but "
        f"{', '.join(found)} place(s) or update(s) the parameters leaf by leaf in the user's "
        "tree, which it does not support yet. Keep pipeline.param_layout='user' (the default) "
        "with offload.level or optimizer.num_apply_group.")


def features_for(config, clip_norm: float | None = None) -> list[Feature]:
  """Every feature the configuration asks for, in the order they wrap the step."""
  return [*memory.features(config), *communication.features(config.communication, clip_norm)]


def trace_variables(fns: UserFns, rng: jax.Array, micro_shapes: Any) -> Variables:
  """Step 1: ``init_fn`` traced on abstract values."""
  found: dict[str, Model] = {}

  def init_split(r, b):
    model, params, model_state = Model.split(fns.init_fn(r, b))
    found["model"] = model
    return params, model_state

  with strategy_lib.trace_session(), jax.sharding.use_abstract_mesh(_PROVISIONAL):
    init_jaxpr, (params_shape, state_shape) = jax.make_jaxpr(
        init_split, return_shape=True)(rng, micro_shapes)
  model = found["model"]
  _check_trainable(params_shape, model)
  p_paths, s_paths = model.leaf_paths(params_shape, state_shape)
  return Variables(model, init_jaxpr, params_shape, state_shape,
                   model.loss_call(fns.loss_fn, fns.has_aux, fns.mutable),
                   tuple(p_paths + s_paths))


def capture_loss(var: Variables, micro_shapes: Any, num_devices: int,
                 options: CaptureOptions) -> Capture:
  """Step 2: the task graphs, from the loss traced on abstract values (and from where
  ``init_fn`` defined each variable, for EPL's "variables defined under split" MoE pattern)."""
  leaves, tree = jax.tree.flatten((var.params_shape, var.state_shape, micro_shapes))
  n_v = len(var.paths)

  def flat_loss(*flat):
    return var.loss_call(*jax.tree.unflatten(tree, flat))[0]

  with jax.sharding.use_abstract_mesh(_PROVISIONAL):
    return capture(flat_loss, leaves[:n_v], leaves[n_v:], input_paths=var.paths,
                   num_devices=num_devices, **options.kwargs())


def place(fns: UserFns, var: Variables, cap: Capture, micro_shapes: Any, rows: int, config,
          cluster, options: CaptureOptions) -> Placement:
  """Step 3: mesh, batch layout, variable specs, pipeline packing, base shardings."""
  layout = build_mesh(cap.taskgraphs, cluster.devices, config.cluster,
                      config.pipeline.num_virtual_stages,
                      config.zero.shard_size if config.zero.level else "all",
                      context=config.context.parallel_degree)
  _check_layout(layout, cap, config.pipeline.num_stages)
  mesh = layout.mesh
  axes = specs_lib.batch_axes(cap, layout)
  bplan = batch_lib.BatchPlan(layout.num_replicas, config.pipeline.num_micro_batch,
                              layout.devices_per_stage if MODEL in axes else 1, axes,
                              layout.context)
  bplan.check(rows)
  bplan.check_sequences(micro_shapes)
  shapes = [tuple(x.shape) for x in var.leaves]
  user = annotations.user_specs(list(var.paths), shapes, var.model.metadata, dict(mesh.shape))
  leaf_specs = specs_lib.variable_specs(cap, layout, shapes, user)
  fused = FusedLayouts.of([(s.dim, s.parts) for s in leaf_specs], var.paths, shapes,
                          layout.devices_per_stage, var.num_params)
  # Pipeline stages: parameters packed per stage, a shard_map gradient (epljax.pipeline).
  pipe = None if layout.num_stages == 1 else pipeline_lib.plan_pipeline(
      loss_call=fused.loss_call(var.loss_call), has_aux=fns.has_aux,
      params_shape=var.params_shape,
      state_shape=var.state_shape, param_paths=list(var.paths[:var.num_params]),
      state_paths=list(var.paths[var.num_params:]), micro_shapes=micro_shapes,
      global_capture=cap, layout=layout, batch_axes=axes, config=config.pipeline,
      num_devices=len(cluster.devices), param_specs=[s.spec for s in leaf_specs[:var.num_params]],
      capture_options=options.kwargs())
  named = [NamedSharding(mesh, s.spec) for s in leaf_specs]
  n_p = var.num_params
  replicated = NamedSharding(mesh, P())
  model_sh = jax.tree.unflatten(jax.tree.structure(var.state_shape), named[n_p:])

  def state_shardings(params_shape, param_sh):   # (the optimizer state's shape too)
    opt_shape = jax.eval_shape(fns.optimizer.init, params_shape)
    return opt_shape, StateShardings(
        params=param_sh,
        opt_state=step_lib.map_optimizer_state(
            fns.optimizer, lambda _, s: s if pipe is None else pipe.state_sharding(_, s),
            opt_shape, param_sh, non_params=lambda _: replicated),
        model_state=model_sh)

  # Pipeline stages keep the user's tree too, each leaf also sharded over ``stage``, unless
  # ``pipeline.param_layout='stage'``: then the loop's slots.
  if pipe is None:
    opt_shape, shardings = state_shardings(
        var.params_shape, jax.tree.unflatten(jax.tree.structure(var.params_shape), named[:n_p]))
    return Placement(layout, bplan, leaf_specs, pipe, opt_shape, shardings, fused)
  pipe.check_stage_layout(fns.optimizer)
  opt_shape, shardings = state_shardings(
      pipe.params_shape if pipe.in_stages else var.params_shape, pipe.param_shardings)
  user = None
  if pipe.in_stages:
    _, user = state_shardings(var.params_shape, pipe.user_param_shardings)
  return Placement(layout, bplan, leaf_specs, pipe, opt_shape, shardings, fused, user)


def compile_functions(fns: UserFns, steps: Steps, fstate: dict, rows: int,
                      by_cond: bool) -> Jitted:
  """Step 5: the jitted functions (and how to show the trained params in the user's tree);
  ``by_cond``: how a non-finite step is skipped (``step.skips_by_cond``)."""
  var, where, features, ctx = steps.variables, steps.placement, steps.features, steps.context
  mesh, pipe, base = where.layout.mesh, where.pipe, where.shardings
  num_micro = ctx.num_micro_batch
  replicated = NamedSharding(mesh, P())
  axes = where.batch_plan.axes
  state_sh = TrainState(step=replicated, params=base.params, opt_state=base.opt_state,
                        model_state=base.model_state,
                        feature_state=jax.tree.map(lambda _: replicated, fstate))
  loss_call = where.fused.loss_call(var.loss_call)

  def forward(params, model_state, b, fs):
    return loss_call(params, model_state, b)

  per_replica = communication.replica_gradients(features, ctx)
  forward, sums = _shared_reductions(forward, var, where, features, per_replica is not None)
  # communication.fp16 / local clipping need each replica's own gradients (communication.py);
  # pipeline stages compute their gradients in their own shard_map (epljax.pipeline).
  make_gradients = (per_replica or (lambda fwd: step_lib.accumulate_gradients(fwd, num_micro)))
  if pipe is not None:
    make_gradients = lambda _: pipe.gradients()  # noqa: E731
  forward, gradients, update = step_lib.build(forward, make_gradients, fns.optimizer,
                                              features, ctx, by_cond)
  user_params = where.to_user
  if where.in_stages:   # Trainer.variables: the user's leaves in their stored shardings
    user_params = jax.jit(where.to_user, out_shardings=where.user_shardings.params)

  def prepare(global_batch):
    return batch_lib.micro_batches(global_batch, where.batch_plan, mesh)

  def init_state(r, global_batch):
    first = jax.tree.map(lambda x: x[:rows // num_micro], global_batch)
    _, params, model_state = Model.split(fns.init_fn(r, first))
    params = where.to_internal(params)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=fns.optimizer.init(params), model_state=model_state,
                      feature_state=fstate)

  def loss_and_grads(state, global_batch):
    loss, _, grads, _ = gradients(state.params, state.model_state, prepare(global_batch),
                                  state.feature_state)
    return loss, where.to_user(grads)

  # The forward alone runs unpipelined, under GSPMD, on the user's tree (its leaves as
  # stored: split over ``stage``; with ``param_layout='stage'`` unpacked from the slots).
  def user_forward(params, *args):
    return forward(where.pipe.to_user(params) if where.in_stages else params, *args)

  def first_loss(state, global_batch):
    micro = jax.tree.map(lambda x: x[0], prepare(global_batch))
    return user_forward(state.params, state.model_state, micro, state.feature_state)[0]

  def evaluate(state, global_batch):
    return step_lib.eval_step(user_forward, prepare, fns.has_aux)(state, global_batch)

  step = step_lib.train_step(gradients, update, features, prepare, fns.has_aux, by_cond,
                             grad_layouts=base.reduced_grads)
  traced = functools.partial(_traced_in_session, mesh=mesh,
                             attention=context_lib.layout_of(mesh, axes))
  options = communication.compiler_options(features, var.params_shape) or None
  rows_sh = NamedSharding(mesh, P(axes))   # Built.batch_sharding (batch_lib.leaf_sharding)
  # With sequences split each leaf has its own sharding, as shard_batch put it.
  batch_sh = rows_sh if where.layout.context == 1 else None
  jit = functools.partial(jax.jit, compiler_options=options)
  checked = (functools.partial(Preflight, check=where.pipe.check_compiled)
             if where.pipe is not None and where.pipe.slotted else lambda f: f)
  return Jitted(
      init=jax.jit(traced(init_state), out_shardings=state_sh),
      step=checked(jit(traced(step), in_shardings=(state_sh, batch_sh),
                       out_shardings=(state_sh, None), donate_argnums=0)),
      grads=checked(jit(traced(loss_and_grads), in_shardings=(state_sh, batch_sh),
                        out_shardings=(replicated, (where.user_shardings or base).params))),
      loss=jit(traced(first_loss), in_shardings=(state_sh, batch_sh),
               out_shardings=replicated),
      eval=jit(traced(evaluate), in_shardings=(state_sh, batch_sh)),
      state_shardings=state_sh, batch_sharding=rows_sh, user_params=user_params,
      gradient_sums=sums)


def _shared_reductions(forward, var: Variables, where: Placement, features: Sequence[Feature],
                       per_replica: bool):
  """The forward with gradient partial sums added before their one all-reduce
  (``sharding.reductions``), and its plan line: only the plain step on XLA:CPU (no pipeline
  stages, no feature that rewrites each parameter use or computes per-replica gradients) runs
  the fused form; a split model says why not. On GPU and TPU the step is what GSPMD makes."""
  mesh = where.layout.mesh
  split = mesh.shape.get(MODEL, 1) > 1
  if not split and mesh.shape.get(DATA, 1) == 1:
    return forward, ""
  platform = mesh.devices.flat[0].platform
  if platform not in reductions.PLATFORMS:
    return forward, reductions.not_fused(
        f"on {platform}, XLA merges them itself: XLA:GPU's all-reduces are within 5% of "
        "epljax's rewrite, which runs on XLA:CPU only; bench/gpu_compile.py")
  why = ""
  if where.pipe is not None:
    why = "pipeline stages compute their own gradients"
  elif per_replica:
    why = "gradients are computed per replica: communication.fp16 or local clipping"
  elif any(isinstance(f, memory.uses.ParamUses) for f in features):
    why = "ZeRO, offload or mixed precision rewrite each parameter use"
  elif tuple(where.batch_plan.axes) != (DATA,):
    why = f"the batch is split over {where.batch_plan.axes}, not over '{DATA}' alone"
  if why:
    return forward, reductions.not_fused(why) if split else ""
  split_dims = {i: d for i, s in enumerate(where.leaf_specs[:var.num_params])
                if split and (d := specs_lib.dim_over(s.spec, MODEL)) is not None}
  # With gradient checkpointing the per-replica copy of a tied parameter kept more memory
  # than the two reductions it saves (GPT-2 of tests/models, split(2), GC auto, 64 rows: step
  # temp 593 -> 968 KiB on XLA:CPU), so only the column matmuls are fused there.
  rows = not any(isinstance(f, memory.remat.GradientCheckpoint) for f in features)
  fused = reductions.shared_reduction(
      forward, mesh=mesh, model=MODEL, data=DATA, split=split_dims,
      leaf_shapes=[tuple(x.shape) for x in var.leaves], leaf_paths=list(var.paths), rows=rows)
  return fused, fused


class Preflight:
  """A jitted function whose compiled program is checked before it first runs (a program
  that would hang is refused, not started); it then runs that compiled program."""

  def __init__(self, jitted: Any, check: Callable[[str], None]):
    self._jitted, self._check, self._compiled = jitted, check, None

  def lower(self, *args):
    return self._jitted.lower(*args)

  def __call__(self, *args):
    if self._compiled is None:
      compiled = self._jitted.lower(*args).compile()
      self._check(compiled.as_text())
      self._compiled = compiled
    return self._compiled(*args)


def make_plan(steps: Steps, features: Sequence[Feature | str], fstate: dict, jitted: Jitted,
              batch: Any, rows: int, target: cost_lib.Target | None = None) -> Plan:
  """Step 6: the plan, with the compiled facts computed lazily from the same executables;
  ``features``: the plan's feature lines (the features, then lines of the step)."""
  var, cap, where = steps.variables, steps.capture, steps.placement
  layout, pipe, base = where.layout, where.pipe, where.shardings
  mesh, axes = layout.mesh, where.batch_plan.axes
  abstract_state = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      jax.eval_shape(lambda: TrainState(
          step=jnp.zeros((), jnp.int32), params=where.stored_shape(var.params_shape),
          opt_state=where.opt_shape,
          model_state=var.state_shape, feature_state=fstate)), jitted.state_shardings)
  abstract_batch = batch_lib.global_shapes(batch, lambda nd: batch_lib.leaf_sharding(
      NamedSharding(mesh, specs_lib.batch_spec(axes, nd)), nd))
  n_p = var.num_params
  final = (jax.tree.leaves((where.user_shardings or base).params)
           + jax.tree.leaves(base.model_state))
  by_layer = set(pipe.parts.values()) if pipe is not None else set()   # each stage its rows
  leaves = [
      Leaf(path, tuple(x.shape), str(x.dtype), sh.spec,
           leaf_bytes_per_device(x.shape, x.dtype, sh),
           EVERY_STAGE if i in by_layer else
           cap.taskgraphs[tg].name if tg is not None else "-", i < n_p, ls.rule)
      for i, (path, x, sh, tg, ls) in enumerate(zip(
          var.paths, var.leaves, final, cap.input_taskgraph, where.leaf_specs))]
  specs = [sh.spec for sh in final]
  grads_sh = base.reduced_grads
  step_jit, grads_jit = jitted.step, jitted.grads
  num_micro = where.batch_plan.num_micro_batch
  return Plan(
      mesh=mesh, num_replicas=layout.num_replicas, num_stages=layout.num_stages,
      taskgraphs=cap.taskgraphs,
      param_specs=var.model.user_tree(
          jax.tree.unflatten(jax.tree.structure(var.params_shape), specs[:n_p]),
          jax.tree.unflatten(jax.tree.structure(var.state_shape), specs[n_p:])),
      leaves=leaves, num_micro_batch=num_micro, global_rows=rows, batch_axes=axes,
      optimizer_bytes=tree_bytes_per_device(where.opt_shape, base.opt_state),
      schedule=(pipe.schedule.strategy if pipe is not None else
                "gradient accumulation" if num_micro > 1 else "-"),
      features=[f if isinstance(f, str) else f.describe for f in features], pipeline=pipe,
      compile_step=lambda: step_jit.lower(abstract_state, abstract_batch).compile(),
      grads_bytes=tree_bytes_per_device(where.stored_shape(var.params_shape), grads_sh),
      placement={"parameters": _where(base.params), "gradients": _where(grads_sh),
                 "optimizer state": _where(base.opt_state),
                 "model state": _where(base.model_state)},
      compile_grads=lambda: grads_jit.lower(abstract_state, abstract_batch).compile(),
      **({} if target is None else dict(
          chip=target.chip, chip_note=target.chip_note, memory_limit=target.memory_limit,
          step_cost=target.step_cost)))


def _skips_by_cond(where: Placement, features: Sequence[Feature]) -> bool:
  on_device = all(_where(t) == "device" for t in (where.shardings.params,
                                                  where.shardings.opt_state))
  return step_lib.skips_by_cond(where.layout.mesh, features, state_on_device=on_device)


def _where(shardings: Any) -> str:
  """Where a tree of shardings puts its bytes: "device", "host (pinned_host)" or both."""
  kinds = sorted({s.memory_kind or "device" for s in jax.tree.leaves(
      shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))})
  named = ["device" if k == "device" else f"host ({k})" for k in kinds]
  return " + ".join(named) if named else "device"


def _traced_in_session(fn: Callable, mesh, attention=None) -> Callable:
  """Traces ``fn`` inside a strategy trace session, so unnamed scopes get the same labels as in
  the capture, and with the mesh as the abstract mesh, so model code can ask
  ``jax.sharding.get_abstract_mesh()`` (the MoE layer does) or use bare ``PartitionSpec``s;
  ``attention``: the plan's ``epljax.nn.context.ContextLayout`` (context parallelism)."""

  def wrapped(*args):
    with (strategy_lib.trace_session(), jax.sharding.use_abstract_mesh(mesh.abstract_mesh),
          context_lib.attention_over(attention)):
      return fn(*args)

  wrapped.__name__ = f"epl_{fn.__name__}"
  return wrapped


def _context_line(var: Variables, where: Placement, micro_shapes: Any) -> str:
  """The plan's line for context parallelism: the loss traced once more (shapes only),
  counting the attention calls that run over ``context`` (``epljax.nn.context.describe``)."""
  layout = context_lib.layout_of(where.layout.mesh, where.batch_plan.axes)
  if layout is None:
    return ""
  loss = _traced_in_session(lambda p, s, b: var.loss_call(p, s, b)[0], where.layout.mesh,
                            layout)
  with context_lib.counting_calls() as calls:
    jax.eval_shape(loss, var.params_shape, var.state_shape, micro_shapes)
  return context_lib.describe(layout, calls.count)


def _check_trainable(params_shape: Any, model: Model) -> None:
  for path, leaf in jax.tree_util.tree_flatten_with_path(params_shape)[0]:
    if not jnp.issubdtype(leaf.dtype, jnp.inexact):
      where = jax.tree_util.keystr(path, simple=True, separator="/")
      what = {"flax": "variables['params']", "nnx": "the nnx.Param variables",
              "pytree": "the variables"}[model.kind]
      raise PlanError(f"Trainable leaf '{where}' of {what} has dtype {leaf.dtype}; only "
                      "floating-point leaves can be trained. Keep integer state in another "
                      "collection (Flax) or a non-Param variable (NNX).")


def _check_layout(layout: Layout, cap: Capture, num_stages: int | None) -> None:
  if num_stages is not None and num_stages != layout.num_stages:
    raise PlanError(f"pipeline.num_stages={num_stages}, but the model's task graphs make "
                    f"{layout.num_stages} stage(s) ({[t.name for t in cap.taskgraphs]}). "
                    "pipeline.num_stages chooses the stages only with auto.auto_parallel=True; "
                    "otherwise the scopes do. Unset it, or set auto.auto_parallel.")
  used = set(cap.node_taskgraph)
  for tg in cap.taskgraphs:
    if tg.index not in used and not layout.colocated:
      raise PlanError(
          f"Task graph '{tg.name}' ({tg.strategy}({tg.device_count})) only defines variables "
          "(they are used by code outside its scope, EPL's MoE pattern), which needs the task "
          "graphs on the same devices: set cluster.colocate_split_and_replicate=True.")
