"""What ``init_fn`` returns, seen the same way whatever the model library.

- Flax Linen (a dict with a ``"params"`` collection): the optimizer trains ``"params"``; the
  other collections (``batch_stats``) are model state, updated through ``mutable``.
- Flax NNX (an ``nnx.Module``): the optimizer trains the ``nnx.Param`` variables; every other
  variable (BatchNorm statistics, RNG counters) is model state, updated in place by the model
  as NNX users expect.
- Anything else (a pytree of arrays, for plain JAX functions): the whole tree is trained.

Internally the Trainer always holds ``(params, model_state)``; ``Model`` converts between that
and what ``loss_fn`` receives and ``Trainer.variables`` returns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from flax import nnx
from flax.core import meta

from epljax.errors import PlanError

LINEN, NNX, PYTREE = "flax", "nnx", "pytree"


@dataclasses.dataclass
class Model:
  """How to split what ``init_fn`` returned into (params, model_state) and back."""
  kind: str
  collections: tuple[str, ...] = ()   # Linen: the collection names, in init's order
  graphdef: Any = None                # NNX: the module's static structure
  # Per leaf of (params, model_state), flattened: (axis names, local logical rules) from Flax
  # partitioning metadata, or None.
  metadata: tuple = ()

  @staticmethod
  def split(out: Any) -> tuple[Model, Any, Any]:
    """``init_fn``'s result -> (Model, params, model_state), Flax metadata boxes removed."""
    if isinstance(out, nnx.Module):
      graphdef, params, rest = nnx.split(out, nnx.Param, ...)
      return Model(NNX, graphdef=graphdef,
                   metadata=_nnx_metadata(params) + _nnx_metadata(rest)), params, rest
    if isinstance(out, Mapping) and "params" in out:
      rest = {k: v for k, v in out.items() if k != "params"}
      metadata = _box_metadata(out["params"]) + _box_metadata(rest)
      return (Model(LINEN, collections=tuple(out.keys()), metadata=metadata),
              meta.unbox(out["params"]), meta.unbox(rest))
    return Model(PYTREE, metadata=_box_metadata(out)), meta.unbox(out), {}

  def merge(self, params: Any, model_state: Any) -> Any:
    """(params, model_state) -> the variables in the structure ``init_fn`` returned."""
    if self.kind == NNX:
      # copy: fresh Variables at the current trace level, so the model may update its state
      # (BatchNorm) inside jax.grad even though the state came in from an outer jit.
      return nnx.merge(self.graphdef, params, model_state, copy=True)
    if self.kind == LINEN:
      return {k: params if k == "params" else model_state[k] for k in self.collections}
    return params

  def user_tree(self, params: Any, model_state: Any) -> Any:
    """A pytree shaped like the variables (for NNX: the module's state as a nested dict)."""
    if self.kind == NNX:
      return nnx.to_pure_dict(nnx.state(self.merge(params, model_state)))
    return self.merge(params, model_state)

  def leaf_paths(self, params: Any, model_state: Any) -> tuple[list[str], list[str]]:
    """Readable paths of the params leaves and of the model-state leaves."""
    prefix = "params/" if self.kind == LINEN else ""
    return _paths(params, prefix), _paths(model_state, "")

  def loss_call(self, loss_fn: Callable, has_aux: bool,
                mutable: Sequence[str]) -> Callable[[Any, Any, Any], tuple[Any, Any, Any]]:
    """A function ``(params, model_state, batch) -> (loss, aux, new_model_state)``."""

    def call(params, model_state, batch):
      variables = self.merge(params, model_state)
      out = loss_fn(variables, batch)
      if self.kind == NNX:
        _, _, new_state = nnx.split(variables, nnx.Param, ...)
      elif mutable:
        out, updates = _expect_pair(
            out, "(output, updates)",
            f"With mutable={list(mutable)}, loss_fn returns (loss, updates), the updates being "
            f"what model.apply(..., mutable={list(mutable)}) returned beside its output; "
            "return them, or leave mutable out.")
        new_state = _merge_updates(model_state, updates)
      else:
        new_state = model_state
      if has_aux:
        loss, aux = _expect_pair(out, "(loss, aux)", "With has_aux=True, loss_fn returns "
                                 "(loss, aux); return the pair, or leave has_aux out.")
        if not mutable and self.kind == LINEN:
          _refuse_updates_as_aux(aux, model_state)
      else:
        loss, aux = out, None
      _check_loss(loss, has_aux, mutable)
      return loss, aux, new_state

    return call


def _box_metadata(tree: Any) -> tuple:
  """Linen ``nn.with_partitioning`` / ``with_logical_partitioning`` boxes -> per-leaf names."""
  boxes = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, meta.AxisMetadata))
  return tuple((tuple(b.names), tuple(getattr(b, "rules", None) or ()))
               if isinstance(b, meta.Partitioned) else None for b in boxes)


def _nnx_metadata(state: Any) -> tuple:
  """NNX ``out_sharding`` (``nnx.with_partitioning``) metadata -> per-leaf names."""
  out = []
  for v in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
    info = v.get_metadata() if isinstance(v, nnx.Variable) else {}
    names = info.get("out_sharding") or info.get("sharding")
    out.append((tuple(names), tuple(info.get("sharding_rules") or ())) if names else None)
  return tuple(out)


def _paths(tree: Any, prefix: str) -> list[str]:
  out = []
  for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
    text = jax.tree_util.keystr(path, simple=True, separator="/")
    out.append(prefix + text.removesuffix("/value"))
  return out


def _expect_pair(out: Any, what: str, hint: str) -> tuple[Any, Any]:
  if not (isinstance(out, tuple) and len(out) == 2):
    raise PlanError(f"loss_fn should return {what} here, but returned {_describe(out)}. {hint}")
  return out


def _refuse_updates_as_aux(aux: Any, model_state: Mapping[str, Any]) -> None:
  """Updates of the model's collections returned as aux would be dropped: say so."""
  if not isinstance(aux, Mapping) or not aux or any(k not in model_state for k in aux):
    return
  if all(jax.tree.structure(aux[k]) == jax.tree.structure(model_state[k]) for k in aux):
    names = sorted(aux)
    raise PlanError(f"loss_fn's aux has the structure of the model's collections {names}: "
                    f"updates returned as aux are not applied. Pass mutable={names} to "
                    "epl.Trainer and return (loss, updates), or, to report them as metrics only, "
                    f"wrap them (aux={{'stats': ...}}).")


def _merge_updates(model_state: dict, updates: Mapping[str, Any]) -> dict:
  unknown = [k for k in updates if k not in model_state]
  if unknown:
    raise PlanError(f"loss_fn returned updates for collections {unknown} that init_fn did not "
                    f"create (it created {sorted(model_state)}). Only collections that exist "
                    "after init can be updated; create them in init_fn or drop them from "
                    "mutable.")
  return {**model_state, **updates}


def _check_loss(loss: Any, has_aux: bool, mutable: Sequence[str]) -> None:
  shape = getattr(loss, "shape", None)
  if shape == () and jax.numpy.issubdtype(loss.dtype, jax.numpy.floating):
    return
  if isinstance(loss, tuple):
    raise PlanError(f"loss_fn returned a tuple where the loss (a float scalar) belongs. "
                    f"{_AUX_RETURN if not has_aux else ''}"
                    f"{_MUTABLE_RETURN if not mutable else ''}")
  raise PlanError(f"The loss must be a float scalar, got {_describe(loss)}. Reduce it with "
                  "jnp.mean over the batch.")


def _describe(x: Any) -> str:
  if isinstance(x, tuple):
    return f"a tuple of {len(x)}"
  shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
  return f"an array of shape {shape} and dtype {dtype}" if shape is not None else repr(x)


_AUX_RETURN = "If it returns (loss, aux), pass has_aux=True to epl.Trainer. "
_MUTABLE_RETURN = (
    "If it returns (loss, updates) from model.apply(..., mutable=['batch_stats']), pass "
    "mutable=['batch_stats'] to epl.Trainer.")
