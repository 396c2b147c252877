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
``jax.jit`` with those shardings (``build.py`` holds these steps). Parameters and optimizer state
are created by a jitted init directly in their shardings. When the task graphs are pipeline
stages, ``epljax.pipeline`` gives the parameter storage (packed per stage) and the gradient
function (a ``shard_map`` loop over micro batches) instead of ``step.accumulate_gradients``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import optax

from epljax import batch as batch_lib
from epljax import env as env_lib
from epljax.build import Built, UserFns, build
from epljax.env import Env
from epljax.errors import EPLError, PlanError, StateError
from epljax.launch import worker as launch_worker
from epljax.plan import Plan
from epljax.step import TrainState


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
    self._env_seen = env              # the last Env checked against self._config
    self._built: Built | None = None

  # -- public API --------------------------------------------------------------------------
  def init(self, rng: jax.Array | int, batch: Any) -> TrainState:
    """Plans the run for ``batch``'s shapes and creates the state in its shardings."""
    if Env._current is not self._env_seen:   # epl.init ran again: its config does not apply
      self._env_seen = env_lib.kept_config(self._config)
    if isinstance(rng, int):
      rng = jax.random.key(rng)
    built = self._build(rng, batch)
    return built.init_jit(rng, self.shard_batch(batch))

  def train_step(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
    """One global step over all micro batches; ``metrics["loss"]`` is the global mean loss."""
    built = self._require()
    if Env._current is not self._env_seen:
      self._env_seen = env_lib.kept_config(self._config)
    self._check_state(built, state)
    state, metrics = built.step_jit(state, self.shard_batch(batch))
    launch_worker.heartbeat()   # the launcher's --hang_timeout (throttled; one write at most)
    checks, built.first_step_checks = built.first_step_checks, []
    for check in checks:   # features that verify the first step (one host sync, once)
      check(metrics)
    return state, metrics

  def loss_and_grads(self, state: TrainState, batch: Any) -> tuple[jax.Array, Any]:
    """The mean loss and the reduced gradients the next step would apply (no update)."""
    built = self._require()
    self._check_state(built, state)
    return built.grads_jit(state, self.shard_batch(batch))

  def variables(self, state: TrainState) -> Any:
    """The variables in the structure ``init_fn`` returned (an ``nnx.Module`` for NNX)."""
    built = self._require()
    self._check_state(built, state)
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
    if built.plan.num_stages > 1 and rows != built.plan.global_rows:
      raise PlanError(f"The pipeline was built for the global batch of trainer.init "
                      f"({built.plan.global_rows} rows); this batch has {rows}. Pipeline stages "
                      "pass activations of fixed shapes: use batches of "
                      f"{built.plan.global_rows} rows, or a new Trainer for the other size.")
    return batch_lib.shard_batch(batch, built.layout.mesh, built.batch_plan.axes)

  @property
  def plan(self) -> Plan:
    return self._require().plan

  # -- building ----------------------------------------------------------------------------
  def _require(self) -> Built:
    if self._built is None:
      raise StateError("Call trainer.init(rng, batch) first: the plan depends on the batch "
                       "shapes and the traced model.")
    return self._built

  @staticmethod
  def _check_state(built: Built, state: Any) -> None:
    """A state this trainer made, and not one already donated to a step."""
    fix = "pass the TrainState that trainer.init or the previous train_step returned"
    if not isinstance(state, TrainState):
      raise StateError(f"Expected the trainer's TrainState, got {type(state).__name__}: {fix}.")
    leaves, treedef = jax.tree.flatten(state)
    if treedef != built.state_treedef:
      raise StateError(f"This TrainState does not have the structure of this trainer's state "
                       f"(a state of another Trainer or model?): {fix}.")
    if any(getattr(x, "is_deleted", lambda: False)() for x in leaves):
      raise StateError("This TrainState was already used by a train_step, which reuses its "
                       "buffers for the new state (donation): continue from the state that "
                       "train_step returned.")

  def _build(self, rng: jax.Array, batch: Any) -> Built:
    fns = UserFns(self.init_fn, self.loss_fn, self.optimizer, self.has_aux, self.mutable,
                  self.clip_norm)
    self._built = build(fns, self._config, self._cluster, rng, batch)
    return self._built
