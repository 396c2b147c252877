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

import contextlib
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from epljax import batch as batch_lib
from epljax import env as env_lib
from epljax import init_result
from epljax.build import Built, UserFns, build
from epljax.env import Env
from epljax.errors import EPLError, NonFiniteError, PlanError, StateError
from epljax.launch import worker as launch_worker
from epljax.plan import Plan, Rebuild
from epljax.plan.changes import in_this_context
from epljax.sharding import constraints
from epljax.step import NONFINITE_RUN, TrainState


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
    max_nonfinite_steps: a step whose loss or gradients are not finite is not applied
      (``metrics["finite"]`` is False); after this many in a row ``train_step`` raises
      ``NonFiniteError`` naming the step. The device counts the run; the host reads it only
      when it could have reached the limit (every ``max_nonfinite_steps`` steps while steps
      are finite), at the call after that step: the host never waits for the step it just
      queued (the error comes one call late). None: nothing is read.
    tokens_key: the batch leaf (a key of a dict batch) whose size is the step's token count,
      ``metrics["tokens"]``; by default the first integer leaf with two or more dimensions
      (token ids), if any.

  ``metrics`` of ``train_step``: ``loss``, ``grad_norm`` (global norm of the reduced
  gradients), ``finite``, ``step`` (the step just taken), ``examples`` (rows of the global
  batch), ``tokens`` (when known, see ``tokens_key``) and ``step_time`` (host seconds since the
  previous ``train_step`` returned, the first call: its own time, compilation included);
  ``aux`` with ``has_aux``; features add theirs (``loss_scale``).
  """

  def __init__(self, init_fn: Callable[[Any, Any], Any], loss_fn: Callable[[Any, Any], Any],
               optimizer: optax.GradientTransformation, has_aux: bool = False, *,
               mutable: Sequence[str] = (), clip_norm: float | None = None,
               max_nonfinite_steps: int | None = 20, tokens_key: str | None = None):
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
    if max_nonfinite_steps is not None and (not isinstance(max_nonfinite_steps, int)
                                            or max_nonfinite_steps < 1):
      raise EPLError(f"max_nonfinite_steps={max_nonfinite_steps!r}: use a positive int, or "
                     "None to never stop on non-finite steps.")
    self.max_nonfinite_steps = max_nonfinite_steps
    self.tokens_key = tokens_key
    self._built: Built | None = None
    # _watch_nonfinite: the (run, step) being copied to the host, and the steps left until
    # the next read.
    self._reading: tuple[Any, Any] | None = None
    self._unread = max_nonfinite_steps or 0
    self._in_flight: jax.Array | None = None   # the last step's counter (XLA:CPU's wait)
    # _global_batch: the last batch's structure, shapes and dtypes, and its counts
    self._batch_shapes: tuple | None = None
    self._batch_counts: dict[str, int] = {}
    self._last_return: float | None = None
    # The state the last train_step returned, not yet passed back: its structure and buffers
    # are known good, so the next call skips _check_state (a flatten of every leaf).
    self._returned: weakref.ref | None = None

  # -- public API --------------------------------------------------------------------------
  def init(self, rng: jax.Array | int, batch: Any, variables: Any = None) -> TrainState:
    """Plans the run for ``batch``'s shapes and creates the state in its shardings.

    The parameters (and model state) come from ``init_fn(rng, batch)``, compiled with the
    state's shardings; or, given ``variables`` in the structure ``init_fn`` returns (pretrained
    weights: host or device arrays), from those, each leaf placed in its sharding, with a
    fresh optimizer state (``init_fn`` is then only traced, for the plan).
    """
    if Env._current is not self._env_seen:   # epl.init ran again: its config does not apply
      self._env_seen = env_lib.kept_config(self._config)
    if _STOP_AT_INIT.active:   # python -m epljax.plan: plan for the topology, run nothing
      raise Planned(self, self.compile(batch))
    if self._cluster.compile_only:
      raise StateError(_COMPILE_ONLY.format(n=self._cluster.total_gpu_num,
                                            kind=self._cluster.devices[0].device_kind))
    if isinstance(rng, int):
      rng = jax.random.key(rng)
    built = self._build(rng, batch)
    if variables is None:
      state = built.init_jit(rng, self.shard_batch(batch))
    else:
      state = built.user_state.start(variables)
    self._returned = weakref.ref(state)
    return state

  def compile(self, batch: Any, rng: jax.Array | int | None = None) -> Plan:
    """Plans and compiles the step for ``batch``'s shapes without creating any state:
    ``init_fn`` and ``loss_fn`` are traced, never run. Returns ``trainer.plan``, whose
    ``bytes_per_device``, ``fits``, ``collectives`` and ``predicted_step_s`` read the
    compiled step (the executable ``train_step`` would run, on devices that can run it).

    ``batch``: what this process would pass to ``train_step`` (arrays, or
    ``jax.ShapeDtypeStruct``); on compile-only devices (``epl.topology``) this one process
    stands for every host, so it is the global batch.
    """
    if Env._current is not self._env_seen:
      self._env_seen = env_lib.kept_config(self._config)
    if rng is None or isinstance(rng, int):
      rng = jax.eval_shape(lambda: jax.random.key(rng or 0))   # (abstract: nothing is made)
    built = self._build(rng, batch)
    _ = built.plan.compiled
    return built.plan

  def train_step(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
    """One global step over all micro batches; ``metrics["loss"]`` is the global mean loss."""
    start = time.perf_counter()
    built = self._require()
    if Env._current is not self._env_seen:
      self._env_seen = env_lib.kept_config(self._config)
    if self._returned is None or self._returned() is not state:   # (else: checked as made)
      self._check_state(built, state)
      # Another lineage (init, a restored or an older state): its own non-finite run, read
      # after this step.
      self._reading, self._unread = None, 1
    self._returned = None   # donated below
    batch, counts = self._global_batch(built, batch)
    state, metrics = built.step_jit(state, batch)
    self._returned = weakref.ref(state)
    if built.waits_each_step:   # XLA:CPU: two steps in flight at most (step.waits_each_step)
      if self._in_flight is not None:
        self._in_flight.block_until_ready()
      self._in_flight = metrics["step"]
    launch_worker.heartbeat()   # the launcher's --hang_timeout (throttled; one write at most)
    checks, built.first_step_checks = built.first_step_checks, []
    for check in checks:   # features that verify the first step (one host sync, once)
      check(metrics)
    metrics.update(counts)
    now = time.perf_counter()
    metrics["step_time"] = now - (start if self._last_return is None else self._last_return)
    self._last_return = now
    if self.max_nonfinite_steps is not None:   # (None: nothing is ever read)
      self._watch_nonfinite(state, metrics["step"])
    return state, metrics

  def eval_step(self, state: TrainState, batch: Any) -> dict[str, Any]:
    """The forward pass alone over the global batch: ``{"loss", "examples"}`` (and ``"aux"``
    with ``has_aux``, ``"tokens"`` when known); no gradient, no update, ``state`` is kept.
    With pipeline stages the forward runs unpipelined, on the gathered parameters."""
    built = self._require()
    self._check_state(built, state)
    batch = self.shard_batch(batch)
    metrics = dict(built.eval_jit(state, batch))
    metrics.update(self._counts(batch))
    return metrics

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
    return self._global_batch(self._require(), batch)[0]

  def _global_batch(self, built: Built, batch: Any) -> tuple[Any, dict[str, int]]:
    """``shard_batch`` and the batch's counts (``_counts``). Shapes are checked once per batch
    structure and shapes; leaves already in the step's sharding are passed on as they are."""
    leaves, treedef = jax.tree.flatten(batch)
    shapes = (treedef, *((np.shape(x), getattr(x, "dtype", None)) for x in leaves))
    if shapes != self._batch_shapes:
      rows = batch_lib.leading_rows(batch) * jax.process_count()
      built.batch_plan.check(rows)
      if built.plan.num_stages > 1 and rows != built.plan.global_rows:
        raise PlanError(f"The pipeline was built for the global batch of trainer.init "
                        f"({built.plan.global_rows} rows); this batch has {rows}. Pipeline "
                        "stages pass activations of fixed shapes: use batches of "
                        f"{built.plan.global_rows} rows, or a new Trainer for the other size.")
      self._batch_counts = self._counts(batch)
      self._batch_shapes = shapes
    return batch_lib.shard_batch(batch, built.batch_sharding), self._batch_counts

  @property
  def plan(self) -> Plan:
    return self._require().plan

  def _counts(self, batch: Any) -> dict[str, int]:
    """Examples (and tokens) of a global batch, from its shapes (no device sync)."""
    leaves = jax.tree.leaves(batch)
    out = {"examples": int(leaves[0].shape[0])} if leaves else {}
    if self.tokens_key is not None:
      if not (isinstance(batch, dict) and self.tokens_key in batch):
        keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
        raise EPLError(f"tokens_key={self.tokens_key!r} is not a key of the batch ({keys}); "
                       "name the batch entry holding the token ids.")
      out["tokens"] = int(np.prod(jnp.shape(batch[self.tokens_key])))
    else:
      ids = [x for x in leaves if jnp.issubdtype(x.dtype, jnp.integer) and x.ndim >= 2]
      if ids:
        out["tokens"] = int(np.prod(ids[0].shape))
    return out

  def _watch_nonfinite(self, state: TrainState, step: jax.Array) -> None:
    """Raises ``NonFiniteError`` one call after the step that made ``max_nonfinite_steps``
    non-finite steps in a row.

    The device counts the run (``state.feature_state["nonfinite_run"]``); the host reads it only
    at the first step where it could reach the limit (every ``max_nonfinite_steps`` steps while
    steps are finite): a copy, made as that step is queued (the state itself is donated to the
    next step), read at the next call, so the host never waits for the step it just queued.
    """
    limit = self.max_nonfinite_steps
    if self._reading is not None:
      run, read_step = self._reading
      run = int(run)
      self._reading, self._unread = None, limit - run
      if self._unread <= 0:
        self._unread = limit
        raise NonFiniteError(
            f"Step {int(read_step)} is the {run}th step in a row whose loss or gradients are "
            f"not finite (Trainer(max_nonfinite_steps={limit})); none of them was applied. Look "
            "for NaN/Inf in the input batches, lower the learning rate, or resume from a "
            "checkpoint; with communication.fp16, lower communication.fp16_scale.")
    self._unread -= 1   # this step's
    if self._unread <= 0 and self._reading is None:
      run = jnp.copy(state.feature_state[NONFINITE_RUN])
      run.copy_to_host_async()
      self._reading = (run, step)

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
    fns = UserFns(init_result.checked(self.init_fn), self.loss_fn, self.optimizer,
                  self.has_aux, self.mutable, self.clip_norm)
    with constraints.explained():   # a model's constraints on its own mesh
      self._built = build(fns, self._config, self._cluster, rng, batch)
    # What the plan needs to name the config changes that would make it fit (shapes only).
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), batch)

    def build_with(overrides: dict[str, Any]) -> Built:
      with constraints.explained():
        return build(fns, self._config.replace(overrides), self._cluster, rng, shapes)

    self._built.plan.rebuild = Rebuild(self._built, self._config, shapes,
                                       in_this_context(build_with), self._counts)
    self._reading, self._unread = None, self.max_nonfinite_steps or 0
    self._batch_shapes, self._last_return, self._in_flight = None, None, None
    self._returned = None
    _TRAINERS.add(self)
    return self._built


_TRAINERS: weakref.WeakSet[Trainer] = weakref.WeakSet()

_COMPILE_ONLY = """\
This Trainer plans for {n} compile-only devices ({kind}: epl.init(devices=epl.topology(...))):
XLA compiles for them, but nothing can run on them, so there is no state to create. Plan and
compile the step instead, and read the plan:

    plan = trainer.compile(batch)      # arrays or jax.ShapeDtypeStruct of the global batch
    print(plan)                        # bytes per device, fits, collectives, predicted step

To train, call epl.init(config) without devices on the machines themselves."""


class Planned(Exception):
  """Raised out of ``trainer.init`` while ``python -m epljax.plan`` runs a script: the plan
  is made, the script stops there (``stop_at_init``)."""

  def __init__(self, trainer: Trainer, plan: Plan):
    super().__init__("planned")
    self.trainer, self.plan = trainer, plan


class _StopAtInit:
  active = False


_STOP_AT_INIT = _StopAtInit()


@contextlib.contextmanager
def stop_at_init() -> Iterator[None]:
  """While inside, ``Trainer.init`` compiles the plan and raises ``Planned`` instead of
  creating state (``python -m epljax.plan``)."""
  saved, _STOP_AT_INIT.active = _STOP_AT_INIT.active, True
  try:
    yield
  finally:
    _STOP_AT_INIT.active = saved


def trainer_of(state: Any) -> Built | None:
  """The plan of the live Trainer whose states look like ``state`` (structure and shardings),
  for ``Checkpointer.save`` called without a trainer."""
  if not isinstance(state, TrainState):
    return None
  leaves, treedef = jax.tree.flatten(state)
  for trainer in list(_TRAINERS):
    built = trainer._built
    if built is None or built.state_treedef != treedef:
      continue
    shardings = jax.tree.leaves(built.state_shardings,
                                is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    if all(hasattr(x, "sharding") and x.sharding.is_equivalent_to(s, x.ndim)
           for x, s in zip(leaves, shardings)):
      return built
  return None
