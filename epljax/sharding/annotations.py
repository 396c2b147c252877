"""What the user says about sharding beyond scopes: ``epl.annotate`` rules and Flax metadata.

``epl.annotate`` takes regular expressions over paths:

- ``{"Transformer/layers_.*/mlp": epl.split(8)}``: a *module path* rule. Equations traced inside
  a matching module (Flax Linen modules and ``jax.named_scope`` show up in the traced name
  stack) form that strategy's task graph, as if the module's code were inside a ``with`` scope.
  For models you cannot edit.
- ``{"params/.*/attention/.*/kernel": P(None, "model", None)}``: a *parameter path* rule (paths
  as the plan prints them). The parameter gets exactly this ``PartitionSpec`` over the mesh
  axes ``data``, ``stage``, ``model``.

Flax metadata is honoured too: ``nn.with_logical_partitioning`` / ``nn.with_partitioning``
(Linen) and ``nnx.with_partitioning`` / ``out_sharding`` (NNX). Logical axis names are mapped
to mesh axes with Flax's own rules (``nn.logical_axis_rules(...)`` / ``nn.set_logical_axis_rules``);
a logical name no rule maps is an error (Flax would silently replicate it).

Two sources that give one parameter different specs are an error naming both; a user spec
overrides the automatic split rules.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from flax.core import spmd as flax_spmd
from jax.sharding import PartitionSpec as P

from epljax.errors import PlanError, ScopeError
from epljax.strategy import Strategy


@dataclasses.dataclass(frozen=True)
class ModuleRule:
  pattern: str
  strategy: Strategy


@dataclasses.dataclass(frozen=True)
class ParamRule:
  pattern: str
  spec: P


_MODULE_RULES: list[ModuleRule] = []
_PARAM_RULES: list[ParamRule] = []


def annotate(rules: Mapping[str, Strategy | P]) -> None:
  """Adds sharding rules by path (see the module doc); ``epl.init`` forgets them."""
  if not isinstance(rules, Mapping):
    raise ScopeError("epl.annotate expects a dict {path regex: epl.split(k) | PartitionSpec}, "
                     f"got {type(rules).__name__}.")
  for pattern, value in rules.items():
    try:
      re.compile(pattern)
    except (re.error, TypeError) as e:
      raise ScopeError(f"epl.annotate: {pattern!r} is not a regular expression ({e}).") from None
    if isinstance(value, Strategy):
      _MODULE_RULES.append(ModuleRule(pattern, value))
    elif isinstance(value, P):
      _PARAM_RULES.append(ParamRule(pattern, value))
    else:
      raise ScopeError(f"epl.annotate: the rule for {pattern!r} must be epl.replicate(...) / "
                       f"epl.split(...) (a module path rule) or a PartitionSpec (a parameter "
                       f"path rule); got {value!r}.")


def module_rules() -> list[ModuleRule]:
  return list(_MODULE_RULES)


def reset() -> None:
  _MODULE_RULES.clear()
  _PARAM_RULES.clear()


def module_rule_for(frames: Sequence[str], rules: Sequence[ModuleRule]) -> ModuleRule | None:
  """The rule for the longest module-path prefix some rule matches (the most specific module);
  two rules matching the same module with different strategies are an error."""
  if not rules:
    return None
  names = [f for f in frames if not f.startswith("epl.")]
  for end in range(len(names), 0, -1):
    path = "/".join(names[:end])
    hits = [r for r in rules if re.fullmatch(r.pattern, path)]
    if hits:
      for other in hits[1:]:
        if (other.strategy.kind, other.strategy.device_count, other.strategy.name) != (
            hits[0].strategy.kind, hits[0].strategy.device_count, hits[0].strategy.name):
          raise ScopeError(
              f"Module '{path}' matches two epl.annotate rules that disagree: "
              f"{hits[0].pattern!r} -> {hits[0].strategy!r} and {other.pattern!r} -> "
              f"{other.strategy!r}. Make the patterns exclusive.")
      return hits[0]
  return None


def warn_unmatched(kind: str, patterns: Sequence[str], paths: set[str]) -> None:
  """A rule that matches nothing is most likely a typo that turns its parallelism off: say so,
  with paths the rule could have named."""
  for pattern in patterns:
    if not any(re.fullmatch(pattern, p) for p in paths):
      examples = ", ".join(repr(p) for p in sorted(paths, key=lambda p: (p.count("/"), p))[:4])
      warnings.warn(f"epl.annotate rule {pattern!r} matches no {kind} path of this model, so it "
                    f"changes nothing. The pattern must match a whole path (re.fullmatch); "
                    f"{kind} paths look like {examples or 'none found'}.", stacklevel=2)


@dataclasses.dataclass(frozen=True)
class UserSpec:
  spec: P
  source: str


def user_specs(paths: Sequence[str], shapes: Sequence[tuple[int, ...]],
               metadata: Sequence[tuple | None], mesh_shape: Mapping[str, int]
               ) -> dict[int, UserSpec]:
  """Specs the user gave, per leaf index: parameter path rules and Flax metadata (per leaf:
  ``(axis names, local logical rules)`` or None), checked against each other, the shapes and
  the mesh."""
  context_rules = tuple(flax_spmd.get_logical_axis_rules() or ())
  found: dict[int, UserSpec] = {}
  for i, (path, shape) in enumerate(zip(paths, shapes)):
    candidates: list[UserSpec] = []
    for rule in _PARAM_RULES:
      if re.fullmatch(rule.pattern, path):
        candidates.append(UserSpec(rule.spec, f"epl.annotate rule {rule.pattern!r}"))
    if i < len(metadata) and metadata[i] is not None:
      names, local_rules = metadata[i]
      rules = tuple(local_rules) + context_rules
      candidates.append(UserSpec(_from_names(path, names, rules, mesh_shape),
                                 f"Flax metadata {tuple(names)}"))
    if not candidates:
      continue
    first = candidates[0]
    for other in candidates[1:]:
      if _normal(other.spec, len(shape)) != _normal(first.spec, len(shape)):
        raise PlanError(f"Two rules disagree on parameter '{path}' (shape {shape}): "
                        f"{first.source} gives {first.spec} and {other.source} gives "
                        f"{other.spec}. Remove one, or make them agree.")
    _check_spec(path, shape, first, mesh_shape)
    found[i] = first
  warn_unmatched("parameter", [r.pattern for r in _PARAM_RULES], set(paths))
  return found


def _from_names(path: str, names: tuple, rules, mesh_shape: Mapping[str, int]) -> P:
  """Logical (or mesh) axis names -> a PartitionSpec over mesh axes, strictly."""
  out = []
  rule_map: dict[str, Any] = {}
  for logical, mesh_axes in rules or ():
    rule_map.setdefault(logical, mesh_axes)
  for name in names:
    if name is None or name in mesh_shape:
      out.append(name)
    elif isinstance(name, (tuple, list)):
      out.append(tuple(name))
    elif name in rule_map:
      out.append(rule_map[name])
    else:
      known = ", ".join(repr(r[0]) for r in rules or ()) or "none"
      raise PlanError(f"Parameter '{path}' has the logical axis name {name!r}, which no logical "
                      f"axis rule maps to a mesh axis (rules: {known}; mesh axes: "
                      f"{', '.join(mesh_shape)}). Add one, e.g. "
                      f"`with nn.logical_axis_rules([({name!r}, 'model')])` around "
                      f"trainer.init, or ({name!r}, None) to replicate that dimension.")
  return P(*out)


def _normal(spec: P, ndim: int) -> tuple:
  entries = list(spec) + [None] * (ndim - len(spec))
  return tuple(tuple(e) if isinstance(e, (tuple, list)) else e for e in entries)


def _check_spec(path: str, shape: tuple[int, ...], user: UserSpec,
                mesh_shape: Mapping[str, int]) -> None:
  if len(user.spec) > len(shape):
    raise PlanError(f"{user.source} gives parameter '{path}' of shape {shape} the spec "
                    f"{user.spec}, which has more entries than the parameter has dimensions.")
  for dim, entry in enumerate(user.spec):
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    size = 1
    for axis in axes:
      if axis not in mesh_shape:
        raise PlanError(f"{user.source} splits parameter '{path}' over mesh axis {axis!r}, but "
                        f"the mesh axes are {', '.join(mesh_shape)}.")
      size *= mesh_shape[axis]
    if shape[dim] % size:
      raise PlanError(f"{user.source} splits dimension {dim} (size {shape[dim]}) of parameter "
                      f"'{path}' (shape {shape}) over {'x'.join(axes)} = {size} devices, which "
                      "does not divide it.")
