"""Sharding constraints a model brings on a mesh of its own, carried onto epljax's.

MaxText's decoder calls ``jax.lax.with_sharding_constraint`` on the mesh its config builds
(``data``, ``stage``, ``fsdp``, ``tensor`` ...): a ``NamedSharding(its_mesh, P(...))``, or a
bare ``PartitionSpec`` under ``with its_mesh:``. Where epljax runs the loss in its own jit the
constraint is a layout hint over the same devices and is kept as written; inside a pipeline
stage the loss runs in epljax's ``shard_map``, whose mesh is epljax's, and JAX refuses any
other ("Mesh for all inputs should be equal"). There every constraint (``fit``) is

- **translated**: each mesh axis it names maps to epljax's axis by ``MESH_AXIS_RULES``
  (override or extend them with ``with epl.mesh_axis_rules({"sequence": None}):`` around
  ``trainer.init``; ``None`` drops the axis on purpose);
- **dropped where an axis cannot matter**: size 1 on the model's mesh or on epljax's; manual in
  the stage (``data`` and ``stage`` always: a stage holds its own rows; ``model`` unless the
  stages are ``epl.split``); a dimension the kept axes do not divide. A constraint left with
  no axis is removed; a plan line (``pipeline.constraints``) says what happened to each;
- **refused** (``PlanError``): an axis of size > 1 that no rule maps, two dimensions
  on one of epljax's axes, or a sharding that is not a ``NamedSharding``; the message names the
  constraint, where the model calls it and the fix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Callable, Iterator, Mapping

import jax
from jax._src import core as jax_core   # ShardingTypeError
from jax.extend import core as jcore
from jax.extend import source_info_util
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from epljax.errors import PlanError
from epljax.mesh import AXES, DATA, HYBRID_AXES, MODEL, REPLICA, STAGE
from epljax.sharding.program import rewrite_eqns, walk

# Mesh axis names of common codebases (MaxText, t5x, Megatron, praxis) -> epljax's axis.
MESH_AXIS_RULES: Mapping[str, str | None] = {
    # The rows of the batch: data parallelism, FSDP (activations split by batch).
    DATA: DATA, "replica": DATA, "batch": DATA, "dp": DATA, "fsdp": DATA,
    "fsdp_transpose": DATA,
    # Tensor (and expert) parallelism: epl.split's axis.
    MODEL: MODEL, "tensor": MODEL, "mp": MODEL, "tp": MODEL, "tensor_transpose": MODEL,
    "tensor_sequence": MODEL, "expert": MODEL,
    # Pipeline stages.
    STAGE: STAGE, "pipeline": STAGE, "pp": STAGE,
}
# Not in the table on purpose: "sequence", "context", "autoregressive" (epljax has no sequence
# parallelism); a constraint splitting a dimension over one of them is refused.

_overrides: list[Mapping[str, str | None]] = []

# JAX raises sharding type errors as ShardingTypeError (not exported, not a ValueError) on some
# paths and as ValueError on others.
_SHARDING_ERRORS = (ValueError, getattr(jax_core, "ShardingTypeError", ValueError))


@contextlib.contextmanager
def mesh_axis_rules(rules: Mapping[str, str | None]) -> Iterator[None]:
  """Maps more mesh axis names (or others than ``MESH_AXIS_RULES``) onto epljax's axes
  ``data``, ``model``, ``stage``, or to ``None`` (drop), for the plans made inside."""
  bad = {k: v for k, v in rules.items() if v not in (DATA, MODEL, STAGE, None)}
  if bad:
    raise PlanError(f"mesh_axis_rules maps {bad}; each axis name maps to one of "
                          f"'{DATA}', '{MODEL}', '{STAGE}' or None (drop it).")
  _overrides.append(dict(rules))
  try:
    yield
  finally:
    _overrides.pop()


@contextlib.contextmanager
def explained(place: str = "") -> Iterator[None]:
  """Turns JAX's errors about a constraint on another mesh, raised while epljax traces the
  model (a bare ``PartitionSpec`` under the model's ``with mesh:``; a constraint in a body
  ``fit`` cannot reach, such as a ``custom_vjp`` backward; values typed by a mesh with Explicit
  axes), into a ``PlanError``."""
  try:
    yield
  except _SHARDING_ERRORS as e:
    text = str(e)
    explicit = re.search(r"AbstractMesh\(([^()]*), axis_types=\(([^)]*Explicit[^)]*)\)", text)
    if explicit:
      raise PlanError(_EXPLICIT_TYPES.format(mesh=explicit[1], types=explicit[2],
                                             jax=text.splitlines()[0])) from e
    bare = re.search(r"Resource axis: (\S+) of (.*) is not found in mesh: (\(.*?\))", text)
    if bare:
      raise PlanError(_BARE.format(axis=bare[1], spec=bare[2], ours=bare[3])) from e
    if "Mesh for all inputs should be equal" in text:
      raise PlanError(_UNREACHED.format(place=place or "a pipeline stage",
                                              jax=text.splitlines()[0])) from e
    raise


@contextlib.contextmanager
def outside_set_mesh() -> Iterator[None]:
  """epljax plans under its own mesh. A mesh the caller set with ``jax.set_mesh`` is set aside
  meanwhile, as a ``with mesh:`` is (a bare ``PartitionSpec`` in the model is then read against
  epljax's mesh: ``_BARE``); one with Explicit axes is refused, since JAX would type the
  values of epljax's programs by it."""
  outer = jax.sharding.get_abstract_mesh()
  if outer.empty or tuple(outer.axis_names) in (AXES, HYBRID_AXES):   # none, or epljax's own
    yield
    return
  if AxisType.Explicit in tuple(outer.axis_types):
    raise PlanError(_CONTEXT_MESH.format(mesh=_show_mesh(dict(outer.shape)),
                                         types=", ".join(t.name for t in outer.axis_types)))
  with jax.set_mesh(None):
    yield


@dataclasses.dataclass(frozen=True)
class Fitted:
  """What became of one constraint: its spec on epljax's mesh (None: removed) and why."""
  before: str
  after: P | None
  why: str
  where: str
  place: str


def fit(closed: jcore.ClosedJaxpr, mesh, auto: frozenset[str], place: str,
        notes: dict[tuple, list[Fitted]] | None = None) -> jcore.ClosedJaxpr:
  """``closed`` with every sharding constraint (in every nested body) on ``mesh``: translated
  over the ``auto`` axes of size > 1, or removed. ``notes`` collects one ``Fitted`` per
  constraint for the plan; ``place`` (a stage's name) goes into errors."""
  rules = dict(MESH_AXIS_RULES)
  for o in _overrides:   # mesh_axis_rules scopes, innermost last
    rules.update(o)
  sizes = dict(mesh.shape)
  # On the stage's own abstract mesh (its manual axes marked), as a constraint written inside
  # the loop's shard_map would be: a value carries its constraint's mesh in its type.
  inside = mesh.abstract_mesh.update_axis_types(
      {a: AxisType.Manual for a in mesh.axis_names if a not in auto})

  def one(eqn: jcore.JaxprEqn) -> jcore.JaxprEqn | None:
    if eqn.primitive.name != "sharding_constraint":
      return _rehome(eqn, inside, place)
    done = _fit_one(eqn, sizes, auto, rules, place)
    if notes is not None:
      notes.setdefault((place, done.before, str(done.after), done.why), []).append(done)
    if done.after is None:
      return None
    return eqn.replace(params={**eqn.params, "sharding": NamedSharding(inside, done.after)})

  def retype(aval):
    sharding = getattr(aval, "sharding", None)
    if (not isinstance(sharding, NamedSharding) or sharding.mesh.empty
        or sharding.mesh == inside):
      return aval
    return aval.update(sharding=NamedSharding(inside, sharding.spec))

  return rewrite_eqns(closed, one, retype)


def _rehome(eqn: jcore.JaxprEqn, inside, place: str) -> jcore.JaxprEqn:
  """``eqn`` with the output shardings JAX recorded from its operands' types (a
  ``broadcast_in_dim`` after a constrained value carries the model's mesh) on ``inside``."""
  moved = {}
  for k, v in eqn.params.items():
    if isinstance(v, NamedSharding) and not v.mesh.empty and v.mesh.abstract_mesh != inside:
      if any(e is not None for e in v.spec):   # explicit axes: a type, not a hint
        raise PlanError(_EXPLICIT.format(prim=eqn.primitive.name, sharding=v,
                                               where=_source(eqn), place=place))
      moved[k] = NamedSharding(inside, v.spec)
  return eqn.replace(params={**eqn.params, **moved}) if moved else eqn


def refused_inside(fn: Callable, mesh, place: str) -> Callable:
  """``fn`` for a ``shard_map`` that calls the model itself (the per-replica gradients of
  ``communication``): a constraint on another mesh than ``mesh`` is refused by name there,
  before JAX fails on it; ``fn`` runs as is otherwise."""

  def wrapped(*args):
    leaves, tree = jax.tree.flatten(args)
    sds = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    with jax.sharding.use_abstract_mesh(AbstractMesh((), ())):
      closed = jax.make_jaxpr(lambda *flat: fn(*jax.tree.unflatten(tree, flat)))(*sds)
    for v in walk(closed).steps:
      sharding = v.eqn.params.get("sharding") if v.eqn.primitive.name == \
          "sharding_constraint" else None
      if sharding is not None and _foreign(sharding, mesh):
        raise PlanError(_INSIDE.format(
            sharding=sharding, where=_source(v.eqn), place=place, ours=_show_mesh(
                dict(mesh.shape))))
    return fn(*args)

  return wrapped


def _foreign(sharding, mesh) -> bool:
  return not isinstance(sharding, NamedSharding) or (
      not sharding.mesh.empty and dict(sharding.mesh.shape) != dict(mesh.shape))


def plan_lines(notes: dict[tuple, list[Fitted]]) -> list[str]:
  """One plan line per kind of constraint and stage: how many, from where, what it became
  and why."""
  lines = []
  for found in notes.values():
    f = found[0]
    after = "removed" if f.after is None else f"kept as {f.after} on epljax's mesh"
    lines.append(f"constraint {f.place}: {len(found)} x {f.before} at {f.where}: {after} "
                 f"({f.why})")
  return lines


def _fit_one(eqn, sizes: dict[str, int], auto: frozenset[str], rules, place: str) -> Fitted:
  sharding = eqn.params["sharding"]
  where = _source(eqn)
  shape = tuple(eqn.invars[0].aval.shape)
  if not isinstance(sharding, NamedSharding):
    raise PlanError(_NOT_NAMED.format(sharding=sharding, where=where, place=place))
  theirs = dict(sharding.mesh.shape)
  before = f"{sharding.spec} on mesh {_show_mesh(theirs)}"
  spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
  out, used = [], {}
  why: dict[str, list[str]] = {}      # reason -> the model's axis names it applies to
  for dim, entry in enumerate(spec):
    if entry is None or entry is P.UNCONSTRAINED:
      out.append(entry)
      continue
    kept = []
    for name in (entry if isinstance(entry, tuple) else (entry,)):
      if theirs.get(name, 1) == 1:
        why.setdefault("size 1 on the model's mesh", []).append(name)
        continue
      if name not in rules:
        raise PlanError(_UNMAPPED.format(
            name=name, size=theirs[name], before=before, shape=shape, where=where, place=place,
            ours=_show_mesh(sizes), known=", ".join(sorted(rules))))
      ours = rules[name]
      if ours is None:
        why.setdefault("mapped to None", []).append(name)
      elif sizes.get(ours, 1) == 1:
        why.setdefault(f"-> {ours}, size 1 here", []).append(name)
      elif ours not in auto:
        why.setdefault(f"-> {ours}, manual in the stage: each device holds its part", []
                       ).append(name)
      elif ours not in kept:
        why.setdefault(f"-> {ours}", []).append(name)
        # Hybrid sharding: rows split over the data replicas are split over both data axes.
        kept += [REPLICA] if ours == DATA and sizes.get(REPLICA, 1) > 1 else []
        kept.append(ours)
    total = 1
    for a in kept:
      total *= sizes[a]
    if kept and shape[dim] % total:
      why.setdefault(f"dimension {dim} ({shape[dim]}) not divisible by {total}", []).extend(
          kept)
      kept = []
    for a in kept:
      if a in used and used[a] != dim:
        raise PlanError(_TWICE.format(before=before, shape=shape, axis=a, where=where,
                                      place=place, dims=(used[a], dim)))
      used[a] = dim
    out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  reasons = "; ".join(f"{', '.join(repr(n) for n in names)} {reason}"
                      for reason, names in why.items()) or "no mesh axis"
  if not used:
    return Fitted(before, None, reasons, where, place)
  while out and out[-1] is None:
    out.pop()
  return Fitted(before, P(*out), reasons, where, place)


def _show_mesh(sizes: dict[str, int]) -> str:
  return "(" + ", ".join(f"{k}={v}" for k, v in sizes.items()) + ")"


def _source(eqn) -> str:
  """``file.py:line (function)`` of the model's call, and its module path."""
  stack = "/".join(getattr(s, "name", str(s)) for s in eqn.source_info.name_stack.stack)
  return os.path.basename(source_info_util.summarize(eqn.source_info)) + (
      f" in {stack}" if stack else "")


_UNMAPPED = """\
with_sharding_constraint {before} on a value of shape {shape}, called at {where},
in {place}: its mesh axis '{name}' (size {size}) has no counterpart on
epljax's mesh {ours}, so the split the model asks for cannot be carried into the stage. Map
the axis onto one of epljax's axes, or to None to drop the constraint on it:
    with epl.mesh_axis_rules({{'{name}': 'data'}}):   # or 'model', or None
      state = trainer.init(rng, batch)
Known axis names: {known}."""

_TWICE = """\
with_sharding_constraint {before} on a value of shape {shape}, called at {where},
in {place}: dimensions {dims} both map to epljax's axis '{axis}', and one
mesh axis can split only one dimension. Map one of the model's axes elsewhere (or to None)
with epl.mesh_axis_rules({{...}}) around trainer.init."""

_NOT_NAMED = """\
with_sharding_constraint with {sharding}, called at {where},
in {place}: only a NamedSharding can be carried onto epljax's mesh. Write
the constraint as NamedSharding(mesh, PartitionSpec(...))."""

_EXPLICIT = """\
{prim} with output sharding {sharding}, at {where}, in {place}: the model
traces with Explicit mesh axes (shardings in the types), which epljax's pipeline cannot carry
onto its own mesh. Make the model's mesh with Auto axes:
    jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))"""

_EXPLICIT_TYPES = """\
The model's values carry shardings on a mesh with Explicit axes ({mesh}, axis_types=({types})):
jax.make_mesh makes Explicit axes unless told otherwise, and jax.sharding.reshard needs them.
epljax lays out every value itself over its own mesh, so it cannot take a model's sharding
types; it carries sharding hints (Auto axes) instead. Make the model's mesh with Auto axes and
constrain with with_sharding_constraint where the model calls reshard:
    mesh = jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))
    x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(...)))
JAX says: {jax}"""

_CONTEXT_MESH = """\
A mesh {mesh} with Explicit axes ({types}) is set around epljax (jax.set_mesh; jax.make_mesh
makes Explicit axes unless told otherwise): JAX would type every value of epljax's programs by
it, while epljax lays them out over its own mesh. Set a mesh with Auto axes, which epljax sets
aside while it plans, or call trainer.init outside jax.set_mesh:
    mesh = jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))"""

_BARE = """\
with_sharding_constraint with the bare PartitionSpec {spec} names mesh axis '{axis}', which
epljax's mesh {ours} does not have: while epljax traces the model its own mesh is the context
mesh, whatever `with mesh:` the model enters, so a bare spec is read against it. Name the
model's mesh in the constraint, which epljax carries onto its own (see the pipeline docs):
    jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(...)))
or write the spec in epljax's axis names ('data', 'model')."""

_UNREACHED = """\
A with_sharding_constraint on another mesh than epljax's reached {place} where epljax could not
rewrite it (inside a custom_vjp backward or a custom_jvp rule?); JAX says: {jax}
Move the constraint out of the custom derivative rule, or write it on epljax's mesh."""

_INSIDE = """\
with_sharding_constraint {sharding}, called at {where}: {place} run the model in a shard_map
manual over 'data' of epljax's mesh {ours}, where JAX accepts no constraint on another mesh.
Leave communication.fp16 off and clip after the all-reduce (the defaults), which run the
model in epljax's jit where the constraint is kept as written, or constrain on epljax's mesh
(trainer.plan.mesh)."""
