"""Which optimizers can train packed stage parameters, checked before training starts.

Pipeline stages keep their parameters packed (``packing.py``): the optimizer updates one
``(num_stages, size)`` buffer per dtype instead of the parameter tree. That is the same
update for optimizers that treat every element alike, and global-norm clipping (padding is
zero and stays zero), but not for those that look at each parameter's path, shape or norm.
``check_optimizer`` refuses the latter with two checks:

1. shapes: every per-parameter leaf of the optimizer state must have its parameter's shape
   (adafactor's factored moments do not);
2. a probe: two updates of a small tree shaped like the parameters (same paths, same ranks,
   sides cut to 3) must equal the same updates on its packed form (weight-decay masks,
   ``multi_transform``, lamb and lars differ here).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax

from epljax.errors import PlanError

_STEPS = 2


def check_optimizer(optimizer: optax.GradientTransformation, params_shape: Any,
                    paths: Sequence[str],
                    pack_with: Callable[[Sequence[Any]], tuple[Callable, Callable]]) -> None:
  """Raises ``PlanError`` unless ``optimizer`` gives the same updates on packed parameters.

  ``pack_with(leaves)`` returns ``(pack, unpack)`` between a flat list shaped like ``leaves``
  and its packed form.
  """
  _check_state_shapes(optimizer, params_shape, paths)
  leaves, treedef = jax.tree.flatten(params_shape)
  rng = np.random.default_rng(0)
  # Parameters of size ~10 make terms proportional to them (weight decay) stand out.
  small = [np.asarray(10 * rng.normal(size=tuple(min(d, 3) for d in x.shape)), x.dtype)
           for x in leaves]
  grads = [[np.asarray(rng.normal(size=x.shape), x.dtype) for x in small]
           for _ in range(_STEPS)]
  pack, unpack = pack_with(small)

  def run(params, grads_seq):
    state, steps = optimizer.init(params), []
    for g in grads_seq:
      updates, state = optimizer.update(g, state, params)
      params = optax.apply_updates(params, updates)
      steps.append(updates)
    return steps

  # Eagerly, op by op: the probe is tiny, and op-by-op executables are cached for the process,
  # where a jit would compile anew for every Trainer.
  expected = run(jax.tree.unflatten(treedef, small),
                 [jax.tree.unflatten(treedef, g) for g in grads])
  try:
    packed = [unpack(u) for u in run(pack(small), [pack(g) for g in grads])]
  except Exception as e:  # the optimizer cannot even run on the packed buffers
    raise PlanError(_NOT_ELEMENTWISE.format(
        why=f"on packed parameters it fails with {type(e).__name__}: {e}")) from e
  for want_step, got_step in zip(expected, packed):
    for path, want, got in zip(paths, jax.tree.leaves(want_step), got_step):
      # Updates, not updated parameters: those would hide small terms in their rounding. The
      # same elementwise math may still differ by a few ulps (vectorized kernels of other
      # shapes, summation order of global norms).
      want, got = np.asarray(want, np.float64), np.asarray(got, np.float64)
      if not np.allclose(got, want, rtol=1e-5, atol=1e-5 * (np.abs(want).max() + 1e-30)):
        raise PlanError(_NOT_ELEMENTWISE.format(
            why=f"a probe update of parameter '{path}' differs between the parameter tree "
                "and the packed buffers"))


def _check_state_shapes(optimizer, params_shape, paths) -> None:
  state = jax.eval_shape(optimizer.init, params_shape)
  bad = []

  def compare(s, p):
    if hasattr(s, "shape") and hasattr(p, "shape") and tuple(s.shape) != tuple(p.shape):
      bad.append((tuple(p.shape), tuple(s.shape)))
    return s

  try:
    optax.tree_map_params(optimizer, compare, state, params_shape,
                          transform_non_params=lambda x: x)
  except (ValueError, TypeError):  # a state optax cannot match to the params: the probe decides
    return
  if bad:
    shape, state_shape = bad[0]
    raise PlanError(_NOT_ELEMENTWISE.format(
        why=f"its state keeps a leaf of shape {state_shape} for a parameter of shape {shape} "
            "(factored or per-parameter statistics)"))


_NOT_ELEMENTWISE = """\
This optimizer cannot train pipeline stages: {why}.
Each pipeline stage keeps its parameters packed in one flat buffer per dtype (so a stage's
devices hold only that stage's parameters) and the optimizer updates those buffers. That is
exactly the update of the parameter tree for optimizers that treat every element alike (sgd,
momentum, adam, adamw, rmsprop, adagrad, lion, and optax.clip_by_global_norm in a chain), but
not for those that look at each parameter's path, shape or norm (weight-decay masks,
optax.multi_transform, adafactor, lamb, lars, per-parameter clipping). Use an elementwise
optimizer, e.g. optax.adamw(1e-3, weight_decay=1e-2) without mask=, or train without
pipeline stages."""
