"""Memory features: rematerialization, ZeRO, offload, mixed precision, grouped apply.

Each is an ``epljax.features.Feature`` built from its own config section; ``features(config)``
returns those the configuration asks for, in the order they wrap the step.

- ``remat.py``: ``gradient_checkpoint.*`` and ``epl.add_to_collection``; ``blocks.py`` chooses
  where to cut (by the program's structure), ``recompute.py`` recomputes unrolled segments in
  the backward pass, ``jax.checkpoint`` the bodies of scans over layers;
- ``zero.py``: ``zero.level`` (sharded optimizer state, gradients, parameters);
- ``offload.py``: ``offload.level`` (state in host memory);
- ``amp.py``: ``amp.*`` (op policy, loss scaling, skipped steps);
- ``grouped.py``: ``optimizer.num_apply_group``;
- ``uses.py``: the one forward rewrite of parameter uses that offload, ZeRO and mixed
  precision share, also inside ``scan`` bodies (one layer's weights at a time), reading where
  each parameter lives from ``BuildContext.shardings``. All of them re-run a traced function
  step by step with the shared walker's evaluation (``sharding.program.run_steps``);
  ``routes.py`` chooses, per ZeRO v3 use of a vocabulary-sized weight, whether the weight or
  the other operand moves.
"""

from __future__ import annotations

from epljax.features import Feature
from epljax.memory import amp, grouped, offload, remat, uses, zero


def features(config) -> list[Feature]:
  """The memory features ``config`` (an ``epl.Config``) asks for, in the order they apply.

  Hooks nest in list order, the last one outermost:
  - forward: the parameter-use rewrite, then gradient checkpointing around it, so what is
    inserted before a parameter's use (transfer, gather, cast) lands inside the
    rematerialized blocks and is redone in the backward pass instead of being kept;
  - update: grouped apply innermost (it re-runs the optimizer's own equations), ZeRO's
    sharded update around it, offload's placement, then mixed precision, which skips the
    whole update when a gradient is not finite.
  """
  parts: list[Feature] = []
  if config.optimizer.num_apply_group > 1:
    parts.append(grouped.GroupedApply(config.optimizer))
  if config.zero.level:
    parts.append(zero.Zero(config.zero))
  if config.offload.level:
    parts.append(offload.Offload(config.offload))
  mixed = amp.MixedPrecision(config.amp) if config.amp.level else None
  if mixed is not None:
    parts += [mixed.loss_scale, mixed]
  if config.zero.level or config.offload.level or mixed is not None:
    parts.append(uses.ParamUses(mixed.policy if mixed is not None else None))
  if config.gradient_checkpoint.type:
    parts.append(remat.GradientCheckpoint(config.gradient_checkpoint))
  return parts
