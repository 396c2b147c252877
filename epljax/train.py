"""``epl.Trainer``: capture -> plan -> one jitted train step.

>>> import epljax as epl, optax, jax, numpy as np, flax.linen as nn     # doctest: +SKIP
>>> epl.init()
>>> epl.set_default_strategy(epl.replicate(1))
>>> model = nn.Dense(10)
>>> def loss_fn(variables, batch):
...   logits = model.apply(variables, batch["x"])
...   return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
>>> trainer = epl.Trainer(lambda rng, b: model.init(rng, b["x"]), loss_fn, optax.sgd(0.1))
>>> state = trainer.init(jax.random.key(0), batch)
>>> state, metrics = trainer.train_step(state, batch)
>>> print(trainer.plan)

``init`` traces ``init_fn`` and ``loss_fn`` on abstract values, reads the task graphs from the
traced loss (``sharding.capture``), builds the mesh (``mesh.build_mesh``), gives every variable
its ``PartitionSpec`` (``sharding.specs``) and compiles the step pieces of ``step.py`` into one
``jax.jit`` with those shardings. Parameters and optimizer state are created by a jitted init
directly in their shardings. When the task graphs are pipeline stages, ``epljax.pipeline`` gives
the parameter storage (packed per stage) and the gradient function (a ``shard_map`` loop over
micro batches) instead of ``step.accumulate_gradients``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from epljax import batch as batch_lib
from epljax import communication, memory
from epljax import pipeline as pipeline_lib
from epljax import step as step_lib
from epljax import strategy as strategy_lib
from epljax.env import Env
from epljax.errors import EPLError, PlanError, StateError
from epljax.features import BuildContext, Feature, StateShardings
from epljax.mesh import AXES, MODEL, Layout, build_mesh
from epljax.plan import Leaf, Plan, leaf_bytes_per_device, tree_bytes_per_device
from epljax.sharding import specs as specs_lib
from epljax.sharding import annotations
from epljax.sharding.capture import Capture, capture, defining_frames
from epljax.step import TrainState
from epljax.variables import Model


@dataclasses.dataclass
class _Built:
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
  plan: Plan
  user_params: Callable[[Any], Any]   # TrainState.params -> the user's tree (pipeline: unpack)
  first_step_checks: list = dataclasses.field(default_factory=list)


class Trainer:
  """Trains ``loss_fn`` with the strategies its scopes declare, over every device.

  Args:
    init_fn: ``init_fn(rng, batch) -> variables``, e.g. ``lambda rng, b: model.init(rng, b["x"])``
      for Flax Linen, or a function returning an ``nnx.Module`` for Flax NNX, or any pytree of
      arrays for plain JAX. It sees one micro batch.
    loss_fn: ``loss_fn(variables, batch) -> loss`` (a float scalar, the mean over the batch), or
      ``(loss, aux)`` with ``has_aux``. For NNX, ``variables`` is the module.
    optimizer: an ``optax.GradientTransformation``, applied to ``variables["params"]`` for a
      Flax-style dict, to the ``nnx.Param`` variables of an NNX module, else to the whole tree.
    has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` comes back as ``metrics["aux"]``
      (stacked along a leading micro-batch axis when ``pipeline.num_micro_batch > 1``).
    mutable: Flax Linen collections the loss updates (``["batch_stats"]``); ``loss_fn`` then
      returns ``(output, updates)`` as ``model.apply(..., mutable=...)`` does. NNX models need
      nothing: their state is read back from the module after the loss.
    clip_norm: clip the gradients to this global norm before the optimizer; whether each
      replica clips its own gradients (EPL's default) or the reduced ones follows
      ``communication.clip_after_allreduce`` (``epljax.communication``).
  """

  def __init__(self, init_fn: Callable[[Any, Any], Any], loss_fn: Callable[[Any, Any], Any],
               optimizer: optax.GradientTransformation, has_aux: bool = False, *,
               mutable: Sequence[str] = (), clip_norm: float | None = None):
    env = Env.get()
    if not (callable(getattr(optimizer, "init", None))
            and callable(getattr(optimizer, "update", None))):
      raise EPLError(f"optimizer must be an optax.GradientTransformation (with init and "
                     f"update), got {type(optimizer).__name__}. For example optax.adamw(1e-3).")
    if isinstance(mutable, str):
      mutable = (mutable,)
    self.init_fn = init_fn
    self.loss_fn = loss_fn
    self.optimizer = optimizer
    self.has_aux = bool(has_aux)
    self.mutable = tuple(mutable)
    self.clip_norm = clip_norm
    self._config = env.config
    self._cluster = env.cluster
    _check_supported(self._config)
    self._built: _Built | None = None

  # -- public API --------------------------------------------------------------------------
  def init(self, rng: jax.Array | int, batch: Any) -> TrainState:
    """Plans the run for ``batch``'s shapes and creates the state in its shardings."""
    if isinstance(rng, int):
      rng = jax.random.key(rng)
    built = self._build(rng, batch)
    return built.init_jit(rng, self.shard_batch(batch))

  def train_step(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
    """One global step over all micro batches; ``metrics["loss"]`` is the global mean loss."""
    built = self._require()
    state, metrics = built.step_jit(state, self.shard_batch(batch))
    checks, built.first_step_checks = built.first_step_checks, []
    for check in checks:   # features that verify the first step (one host sync, once)
      check(metrics)
    return state, metrics

  def loss_and_grads(self, state: TrainState, batch: Any) -> tuple[jax.Array, Any]:
    """The mean loss and the reduced gradients the next step would apply (no update)."""
    built = self._require()
    return built.grads_jit(state, self.shard_batch(batch))

  def variables(self, state: TrainState) -> Any:
    """The variables in the structure ``init_fn`` returned (an ``nnx.Module`` for NNX)."""
    built = self._require()
    return built.model.merge(built.user_params(state.params), state.model_state)

  def lower(self, state: TrainState, batch: Any) -> jax.stages.Lowered:
    """The lowered step: ``.compile().memory_analysis()``, ``.cost_analysis()``, ``.as_text()``."""
    return self._require().step_jit.lower(state, self.shard_batch(batch))

  def lower_loss(self, state: TrainState, batch: Any) -> jax.stages.Lowered:
    """The lowered forward pass alone (the loss of the first micro batch, no gradient): to read
    what the forward communicates."""
    return self._require().loss_jit.lower(state, self.shard_batch(batch))

  def shard_batch(self, batch: Any) -> Any:
    """This process's slice of the global batch -> global arrays split over the batch axes.

    ``train_step`` calls it; call it yourself to move the next batch while a step runs.
    """
    built = self._require()
    rows = batch_lib.leading_rows(batch) * jax.process_count()
    built.batch_plan.check(rows)
    return batch_lib.shard_batch(batch, built.layout.mesh, built.batch_plan.axes)

  @property
  def plan(self) -> Plan:
    return self._require().plan

  # -- building ----------------------------------------------------------------------------
  def _require(self) -> _Built:
    if self._built is None:
      raise StateError("Call trainer.init(rng, batch) first: the plan depends on the batch "
                       "shapes and the traced model.")
    return self._built

  def _build(self, rng: jax.Array, batch: Any) -> _Built:
    config, cluster = self._config, self._cluster
    num_micro = config.pipeline.num_micro_batch
    rows = batch_lib.leading_rows(batch) * jax.process_count()
    if rows % num_micro:
      raise PlanError(f"The global batch of {rows} rows does not divide into "
                      f"pipeline.num_micro_batch={num_micro} micro batches. Use a multiple of "
                      f"{num_micro} rows.")
    micro_shapes = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((rows // num_micro, *jnp.shape(x)[1:]),
                                       batch_lib._dtype(x)), batch)

    # 1. The variables' structure, from init_fn traced on abstract values.
    found: dict[str, Model] = {}

    def init_split(r, b):
      model, params, model_state = Model.split(self.init_fn(r, b))
      found["model"] = model
      return params, model_state

    # The mesh is not known before the capture; a provisional one with the same axis names lets
    # model code that asks for the mesh (NNX eager sharding) trace.
    provisional = jax.sharding.AbstractMesh((1,) * len(AXES), AXES)
    with strategy_lib.trace_session(), jax.sharding.use_abstract_mesh(provisional):
      init_jaxpr, (params_shape, state_shape) = jax.make_jaxpr(
          init_split, return_shape=True)(rng, micro_shapes)
    model = found["model"]
    _check_trainable(params_shape, model)
    loss_call = model.loss_call(self.loss_fn, self.has_aux, self.mutable)

    # 2. Task graphs, from loss_fn traced on abstract values (and where init_fn defined each
    #    variable, for EPL's "variables defined under split" MoE pattern).
    p_leaves, p_def = jax.tree.flatten(params_shape)
    s_leaves, s_def = jax.tree.flatten(state_shape)
    b_leaves, b_def = jax.tree.flatten(micro_shapes)
    n_p, n_s = len(p_leaves), len(s_leaves)

    def flat_loss(*flat):
      params = jax.tree.unflatten(p_def, flat[:n_p])
      model_state = jax.tree.unflatten(s_def, flat[n_p:n_p + n_s])
      return loss_call(params, model_state, jax.tree.unflatten(b_def, flat[n_p + n_s:]))[0]

    p_paths, s_paths = model.leaf_paths(params_shape, state_shape)
    with jax.sharding.use_abstract_mesh(provisional):
      cap = capture(flat_loss, p_leaves + s_leaves, b_leaves, input_paths=p_paths + s_paths,
                    num_devices=len(cluster.devices), module_rules=annotations.module_rules(),
                    definitions=defining_frames(init_jaxpr))

    # 3. Mesh, batch layout, shardings.
    layout = build_mesh(cap.taskgraphs, cluster.devices, config.cluster)
    _check_layout(layout, cap)
    mesh = layout.mesh
    axes = specs_lib.batch_axes(cap, layout)
    bplan = batch_lib.BatchPlan(layout.num_replicas, num_micro,
                                layout.devices_per_stage if MODEL in axes else 1, axes)
    bplan.check(rows)
    # Pipeline stages: parameters packed per stage, a shard_map gradient (epljax.pipeline).
    pipe = None if layout.num_stages == 1 else pipeline_lib.plan_pipeline(
        loss_call=loss_call, has_aux=self.has_aux, params_shape=params_shape,
        state_shape=state_shape, param_paths=p_paths, state_paths=s_paths,
        micro_shapes=micro_shapes, global_capture=cap, layout=layout, batch_axes=axes,
        config=config.pipeline, optimizer=self.optimizer, num_devices=len(cluster.devices),
        capture_options=dict(module_rules=annotations.module_rules(),
                             definitions=defining_frames(init_jaxpr)))
    shapes = [tuple(x.shape) for x in p_leaves + s_leaves]
    user = annotations.user_specs(p_paths + s_paths, shapes, model.metadata, dict(mesh.shape))
    leaf_specs = specs_lib.variable_specs(cap, layout, shapes, user)
    named = [NamedSharding(mesh, s.spec) for s in leaf_specs]
    replicated = NamedSharding(mesh, P())
    param_sh = jax.tree.unflatten(p_def, named[:n_p]) if pipe is None else pipe.param_shardings
    trained_shape = params_shape if pipe is None else pipe.packed_shape
    opt_shape = jax.eval_shape(self.optimizer.init, trained_shape)
    base = StateShardings(
        params=param_sh,
        opt_state=optax.tree_map_params(self.optimizer, lambda _, s: s, opt_shape, param_sh,
                                        transform_non_params=lambda _: replicated),
        model_state=jax.tree.unflatten(s_def, named[n_p:]))

    # 4. Features (memory, communication), chained around the step's pieces.
    ctx = BuildContext(mesh=mesh, num_replicas=layout.num_replicas, num_micro_batch=num_micro,
                       capture=cap, params_shape=trained_shape, optimizer=self.optimizer)
    features = _features(config, self.clip_norm)
    for f in features:
      base = f.shardings(base, ctx)
    fstate_init = {f.name: f.init_state(ctx) for f in features}
    shardings = TrainState(step=replicated, params=base.params, opt_state=base.opt_state,
                           model_state=base.model_state,
                           feature_state=jax.tree.map(lambda _: replicated, fstate_init))
    batch_sh = jax.tree.map(lambda x: NamedSharding(mesh, specs_lib.batch_spec(axes, x.ndim)),
                            micro_shapes)

    def forward(params, model_state, b, fstate):
      return loss_call(params, model_state, b)

    # communication.fp16 / local clipping need each replica's own gradients (communication.py).
    # Pipeline stages compute their gradients in their own shard_map (epljax.pipeline).
    make_gradients = (communication.replica_gradients(features, ctx)
                      or (lambda fwd: step_lib.accumulate_gradients(fwd, num_micro)))
    if pipe is not None:
      make_gradients = lambda _: pipe.gradients(features, ctx)  # noqa: E731
    forward, gradients, update = step_lib.build(forward, make_gradients, self.optimizer,
                                                features, ctx)
    user_params = (lambda p: p) if pipe is None else jax.jit(
        pipe.unpack, out_shardings=jax.tree.map(lambda _: replicated, params_shape))

    def prepare(global_batch):
      return batch_lib.micro_batches(global_batch, bplan, mesh)

    # 5. The jitted functions.
    optimizer = self.optimizer

    def init_state(r, global_batch):
      first = jax.tree.map(lambda x: x[:rows // num_micro], global_batch)
      _, params, model_state = Model.split(self.init_fn(r, first))
      params = params if pipe is None else pipe.pack(params)
      return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                        opt_state=optimizer.init(params), model_state=model_state,
                        feature_state=fstate_init)

    step = step_lib.train_step(gradients, update, features, prepare, self.has_aux)
    traced = functools.partial(_traced_in_session, mesh=mesh)
    xla_options = communication.compiler_options(features, params_shape) or None
    init_jit = jax.jit(traced(init_state), out_shardings=shardings)
    step_jit = jax.jit(traced(step), in_shardings=(shardings, batch_sh),
                       out_shardings=(shardings, None), donate_argnums=0,
                       compiler_options=xla_options)

    def loss_and_grads(state, global_batch):
      loss, _, grads, _ = gradients(state.params, state.model_state, prepare(global_batch),
                                    state.feature_state)
      return loss, grads if pipe is None else pipe.unpack(grads)

    grads_jit = jax.jit(traced(loss_and_grads), in_shardings=(shardings, batch_sh),
                        out_shardings=(replicated, base.params if pipe is None else
                                       jax.tree.map(lambda _: replicated, params_shape)),
                        compiler_options=xla_options)

    def first_loss(state, global_batch):
      micro = jax.tree.map(lambda x: x[0], prepare(global_batch))
      params = state.params if pipe is None else pipe.unpack(state.params)
      return forward(params, state.model_state, micro, state.feature_state)[0]

    loss_jit = jax.jit(traced(first_loss), in_shardings=(shardings, batch_sh),
                       out_shardings=replicated, compiler_options=xla_options)

    # 6. The plan (grads_bytes, placement, compile_grads and lazy feature descriptions: the
    # per-device memory breakdown of the memory features).
    abstract_state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        jax.eval_shape(lambda: TrainState(
            step=jnp.zeros((), jnp.int32), params=trained_shape, opt_state=opt_shape,
            model_state=state_shape, feature_state=fstate_init)), shardings)
    abstract_batch = batch_lib.global_shapes(
        batch, lambda nd: NamedSharding(mesh, specs_lib.batch_spec(axes, nd)))
    final_named = (jax.tree.leaves(base.params) if pipe is None else named[:n_p]) + \
        jax.tree.leaves(base.model_state)
    leaves = [
        Leaf(path, tuple(x.shape), str(x.dtype), sh.spec,
             leaf_bytes_per_device(x.shape, x.dtype, sh),
             cap.taskgraphs[tg].name if tg is not None else "-", i < n_p, ls.rule)
        for i, (path, x, sh, tg, ls) in enumerate(zip(
            p_paths + s_paths, p_leaves + s_leaves, final_named, cap.input_taskgraph,
            leaf_specs))]
    spec_leaves = [sh.spec for sh in final_named]
    grads_sh = base.grads if base.grads is not None else base.params
    plan = Plan(
        mesh=mesh, num_replicas=layout.num_replicas, num_stages=layout.num_stages,
        taskgraphs=cap.taskgraphs,
        param_specs=model.user_tree(jax.tree.unflatten(p_def, spec_leaves[:n_p]),
                                    jax.tree.unflatten(s_def, spec_leaves[n_p:])),
        leaves=leaves, num_micro_batch=num_micro, global_rows=rows, batch_axes=axes,
        optimizer_bytes=tree_bytes_per_device(opt_shape, base.opt_state),
        schedule=(pipe.schedule.strategy if pipe is not None else
                  "gradient accumulation" if num_micro > 1 else "-"),
        features=[f.describe for f in features], pipeline=pipe,
        compile_step=lambda: step_jit.lower(abstract_state, abstract_batch).compile(),
        grads_bytes=tree_bytes_per_device(trained_shape, grads_sh),
        placement={"parameters": _where(base.params), "gradients": _where(grads_sh),
                   "optimizer state": _where(base.opt_state),
                   "model state": _where(base.model_state)},
        compile_grads=lambda: grads_jit.lower(abstract_state, abstract_batch).compile())
    self._built = _Built(model, cap, layout, bplan, shardings, init_jit, step_jit, grads_jit,
                         loss_jit, plan, user_params, [f.after_first_step for f in features])
    return self._built


def _where(shardings: Any) -> str:
  """Where a tree of shardings puts its bytes: "device", "host (pinned_host)" or both."""
  kinds = sorted({s.memory_kind or "device" for s in jax.tree.leaves(
      shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))})
  named = ["device" if k == "device" else f"host ({k})" for k in kinds]
  return " + ".join(named) if named else "device"


def _traced_in_session(fn: Callable, mesh) -> Callable:
  """Traces ``fn`` inside a strategy trace session, so unnamed scopes get the same labels as in
  the capture, and with the mesh as the abstract mesh, so model code can ask
  ``jax.sharding.get_abstract_mesh()`` (the MoE layer does) or use bare ``PartitionSpec``s."""

  def wrapped(*args):
    with strategy_lib.trace_session(), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return fn(*args)

  wrapped.__name__ = f"epl_{fn.__name__}"
  return wrapped


def _features(config, clip_norm: float | None = None) -> list[Feature]:
  """Every feature the configuration asks for, in the order they wrap the step."""
  return [*memory.features(config), *communication.features(config.communication, clip_norm)]


def _check_trainable(params_shape: Any, model: Model) -> None:
  for path, leaf in jax.tree_util.tree_flatten_with_path(params_shape)[0]:
    if not jnp.issubdtype(leaf.dtype, jnp.inexact):
      where = jax.tree_util.keystr(path, simple=True, separator="/")
      what = {"flax": "variables['params']", "nnx": "the nnx.Param variables",
              "pytree": "the variables"}[model.kind]
      raise PlanError(f"Trainable leaf '{where}' of {what} has dtype {leaf.dtype}; only "
                      "floating-point leaves can be trained. Keep integer state in another "
                      "collection (Flax) or a non-Param variable (NNX).")


def _check_layout(layout: Layout, cap: Capture) -> None:
  used = set(cap.node_taskgraph)
  for tg in cap.taskgraphs:
    if tg.index not in used and not layout.colocated:
      raise PlanError(
          f"Task graph '{tg.name}' ({tg.strategy}({tg.device_count})) only defines variables "
          "(they are used by code outside its scope, EPL's MoE pattern), which needs the task "
          "graphs on the same devices: set cluster.colocate_split_and_replicate=True.")


# Config keys accepted by epl.Config whose features this version does not run yet. A value
# other than the default is refused rather than ignored.
_NOT_YET = {
    "pipeline.strategy": None,
    "auto.auto_parallel": False,
}


def _check_supported(config) -> None:
  changed = config.changed()
  refused = [k for k, default in _NOT_YET.items() if default is not None and k in changed]
  if refused:
    raise EPLError(f"Config keys {refused} are set, but this version of epljax does not "
                   "implement them yet; unset them.")
