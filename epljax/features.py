"""Features: small transforms of the training step or of the shardings, chained by the Trainer.

Each optional behaviour set by the configuration (mixed precision, gradient checkpointing,
ZeRO, offload, grouped apply, communication options) is one ``Feature``. A feature overrides
only the hooks it needs; every hook defaults to "leave it as it is". The Trainer applies the
features in order, so each sees the result of the ones before it (like ``optax.chain``).

The hooks, in the order the Trainer calls them while building the step:

- ``shardings(shardings, ctx)``: change where state lives (``StateShardings``: params,
  optimizer state, model state; their specs and memory kinds).
- ``forward(fn, ctx)``: wrap a forward function ``fn(params, *args) -> out`` whose first
  argument is the tree of parameters it uses, returning a function of the same signature. The
  Trainer wraps the whole loss, ``fn(params, model_state, batch, fstate) -> (loss, aux,
  new_model_state)``; the pipeline wraps each stage's forward, ``fn(stage_params, *inputs)``.
  So a forward transform (casting parameters at use, rematerialization) must only rely on the
  first argument being parameters, and then works inside pipeline stages too.
- ``gradients(fn, ctx)``: wrap ``fn(params, model_state, micro_batches, fstate) -> (loss, aux,
  grads, new_model_state)``, the gradient of all micro batches (reduction, clipping).
- ``update(fn, ctx)``: wrap ``fn(params, opt_state, grads, fstate) -> (params, opt_state,
  fstate)``, the optimizer step (grouped apply, skipping non-finite steps).
- ``init_state(ctx)``: the feature's own state, kept in ``TrainState.feature_state[name]``.
- ``metrics(fstate)``: numbers to add to the step's metrics.
- ``after_first_step(metrics)``: called once, on the host, with the first step's metrics; a
  feature that verifies something (``gradient_checkpoint.check_gradients``) raises here.
- ``describe()``: one line for the plan printout.

Loss scaling contract: a feature may keep a float32 scalar under ``fstate[LOSS_SCALE]``. Every
gradient computation (gradient accumulation here, the pipeline schedules) multiplies each micro
batch's loss by it before differentiating, i.e. seeds the backward pass with it, and reports the
unscaled loss; the gradients come out scaled and that feature's ``gradients`` hook unscales them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jax.sharding import Mesh

LOSS_SCALE = "loss_scale"

ForwardFn = Callable[[Any, Any, Any, dict], tuple[Any, Any, Any]]
GradientFn = Callable[[Any, Any, Any, dict], tuple[Any, Any, Any, Any]]
UpdateFn = Callable[[Any, Any, Any, dict], tuple[Any, Any, dict]]


@dataclasses.dataclass(frozen=True)
class StateShardings:
  """Where each part of the training state lives (trees of ``NamedSharding``).

  ``grads``: the layout of the reduced gradients (None: like ``params``); ``params_at_use``:
  the layout a parameter is computed with at its uses, before ZeRO v3 split its storage
  (None: like ``params``). Memory kinds say where each part lives.
  """
  params: Any
  opt_state: Any
  model_state: Any
  grads: Any = None
  params_at_use: Any = None

  @property
  def reduced_grads(self) -> Any:
    """Where the reduced gradients live: ``grads``, or like ``params``."""
    return self.grads if self.grads is not None else self.params


@dataclasses.dataclass(frozen=True)
class BuildContext:
  """What a feature may look at while the step is built.

  Features share facts through these fields only, never by looking each other up:
  ``shardings`` is the state's layout after every feature's ``shardings`` hook (set by the
  Trainer before it calls the ``forward`` hooks), so the forward rewrite of parameter uses
  reads where ZeRO and offload put each parameter from it.
  """
  mesh: Mesh
  num_replicas: int
  num_micro_batch: int
  capture: Any            # sharding.capture.Capture of the loss
  params_shape: Any       # tree of ShapeDtypeStruct, structure of the trained params
  optimizer: Any          # the user's optax.GradientTransformation
  shardings: StateShardings | None = None
  # TrainState.params' shapes where they are not the user's tree (pipeline.param_layout=
  # 'stage': the pipeline loop's slots); None: ``params_shape``.
  state_params_shape: Any = None

  @property
  def stored_params_shape(self) -> Any:
    """The shapes of the parameters as the train state holds them (what ``shardings.params``
    places)."""
    return self.params_shape if self.state_params_shape is None else self.state_params_shape


def loss_scale(fstate: dict) -> Any:
  """The loss scale the gradient computations must apply, or None."""
  return fstate.get(LOSS_SCALE)


class Feature:
  """Base class: every hook leaves things as they are."""

  name: str = "feature"
  # The update hook re-runs the traced update equation by equation (grouped apply): the step
  # skips a non-finite update by a select then, which such a rewrite sees through, not by a
  # cond, one opaque equation (step.skips_by_cond).
  rewrites_update: bool = False

  def shardings(self, shardings: StateShardings, ctx: BuildContext) -> StateShardings:
    return shardings

  def forward(self, fn: ForwardFn, ctx: BuildContext) -> ForwardFn:
    return fn

  def gradients(self, fn: GradientFn, ctx: BuildContext) -> GradientFn:
    return fn

  def update(self, fn: UpdateFn, ctx: BuildContext) -> UpdateFn:
    return fn

  def init_state(self, ctx: BuildContext) -> Any:
    return None

  def metrics(self, fstate: Any) -> dict[str, Any]:
    return {}

  def after_first_step(self, metrics: dict[str, Any]) -> None:
    return None

  def describe(self) -> str:
    return self.name
