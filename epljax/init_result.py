"""What ``init_fn`` returned, checked where the Trainer first calls it.

``init_fn(rng, batch)`` returns the variables: a Flax Linen dict (``model.init(...)``), an
``nnx.Module``, or a pytree of arrays. Two mistakes are common, and without this check both
end in a ``TypeError`` from inside JAX's tracing that names neither ``init_fn`` nor the fix:
returning nothing (a ``def`` without ``return``), and returning the model beside its variables
(``(model, model.init(...))``, the shape of some other libraries' init). ``checked(init_fn)``
raises a ``PlanError`` that says what was returned and what to return instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import nnx

from epljax.errors import PlanError

EXAMPLE = "lambda key, batch: model.init(key, batch['x'])"

_NONE = f"""\
init_fn returned None. It must return the variables, for example

    init_fn = {EXAMPLE}

(a `def init_fn(key, batch):` needs a `return model.init(...)`)."""

_WITH_MODEL = f"""\
init_fn returned a {{kind}} ({{parts}}): return only the variables, e.g.

    init_fn = {EXAMPLE}

loss_fn then calls `model.apply(variables, ...)` with the model it closes over (for Flax NNX,
return the nnx.Module alone)."""

_LINEN_MODULE = f"""\
init_fn returned the Flax module {{name}} itself, not its variables: return them, e.g.

    init_fn = {EXAMPLE}"""

_NOT_AN_ARRAY = """\
init_fn returned a {kind} at {path}: every leaf of the variables must be an array (a
jax.Array, a numpy array or a number). Return the variables alone, e.g. model.init(key, x)."""


def checked(init_fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
  """``init_fn`` with its result checked (module doc); the result itself is unchanged."""

  @functools.wraps(init_fn)
  def init(rng, batch):
    out = init_fn(rng, batch)
    mistake = mistake_in(out)
    if mistake:
      raise PlanError(mistake)
    return out

  return init


def mistake_in(out: Any) -> str | None:
  """The message for a result ``init_fn`` must not return, or None when it is variables."""
  if out is None:
    return _NONE
  if isinstance(out, nnx.Module):
    return None
  if isinstance(out, nn.Module):
    return _LINEN_MODULE.format(name=type(out).__name__)
  if isinstance(out, (tuple, list)) and any(isinstance(x, (nn.Module, nnx.Module)) for x in out):
    parts = ", ".join(_kind(x) for x in out)
    return _WITH_MODEL.format(kind=type(out).__name__, parts=parts)
  is_leaf = lambda x: isinstance(x, (nn.Module, nnx.Module))  # noqa: E731
  for path, leaf in jax.tree_util.tree_leaves_with_path(out, is_leaf=is_leaf):
    if not (isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, complex))
            or hasattr(leaf, "__jax_array__")):
      return _NOT_AN_ARRAY.format(kind=_kind(leaf), path=jax.tree_util.keystr(path) or "its top")
  return None


def _kind(x: Any) -> str:
  """A value's kind for a message: ``Module Dense``, ``dict``, ``Array``."""
  if isinstance(x, (nn.Module, nnx.Module)):
    return f"Module {type(x).__name__}"
  return type(x).__name__
