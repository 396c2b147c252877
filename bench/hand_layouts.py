"""Hand-written training steps in the layouts people use, what ``bench/scale.py`` and
``tests/test_scale_layouts.py`` hold epljax's programs against.

Each is the plain ``jax.jit`` a JAX user writes for the layout: ``value_and_grad`` of the same
loss and the optax update (``common.hand_step``), parameters and optimizer state with explicit
shardings, the state donated. Nothing runs here: ``lower`` takes ``jax.ShapeDtypeStruct``
trees, so the steps of 70B models are compiled without creating an array.

- ``fsdp``: one ``data`` axis over every device; each parameter (and its optimizer state)
  split over it along its largest dimension that divides, the batch rows over it too.
- ``megatron``: a ``data x model`` mesh, ``model`` the inner (intra-host) axis; parameters by
  the model's Megatron specs (``ZooModel.megatron``-style regexes), rows over ``data``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import optax
from flax.core import meta
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from common import hand_step


@dataclasses.dataclass(frozen=True)
class Figures:
  """What a compiled step costs one device: ``memory_analysis()`` bytes (arguments + outputs
  - aliased + temp) and the bytes of the collectives it executes (``epljax.hlo``)."""
  bytes_per_device: int
  collective_bytes: int
  compile_s: float
  by_kind: tuple[tuple[str, int], ...] = ()   # ("all-gather f32", bytes), largest first

  @staticmethod
  def of(compiled, compile_s: float, found: list | None = None) -> "Figures":
    """``found``: the collectives a device executes, if not ``hlo.executed_collectives``'
    reading (a pipeline's: ``Plan.collectives``)."""
    from epljax import hlo

    mem = compiled.memory_analysis()
    used = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
            + mem.temp_size_in_bytes)
    if found is None:
      found = hlo.executed_collectives(compiled.as_text())
    kinds: dict[str, int] = {}
    for c in found:
      key = f"{c.kind} {c.shapes[0].split('[')[0] if c.shapes else '?'}"
      kinds[key] = kinds.get(key, 0) + c.bytes
    return Figures(used, sum(c.bytes for c in found), compile_s,
                   tuple(sorted(kinds.items(), key=lambda kv: -kv[1])))

  def kinds_text(self, unit: int = 2**30) -> str:
    """The collectives by kind and element type, e.g. ``all-gather f32 20.1``."""
    return ", ".join(f"{k} {b / unit:.1f}" for k, b in self.by_kind if b >= unit / 100)


def keypath(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def abstract_params(init_fn: Callable, batch: Any) -> Any:
  """``init_fn``'s variables as ``ShapeDtypeStruct`` (unboxed), traced on one row."""
  one_row = jax.tree.map(lambda x: jax.ShapeDtypeStruct((1, *x.shape[1:]), x.dtype), batch)
  return meta.unbox(jax.eval_shape(init_fn, jax.random.key(0), one_row))


def fsdp_spec(shape: tuple[int, ...], devices: int) -> P:
  """Split along the largest dimension ``devices`` divides (the first such on ties)."""
  fits = [d for d in range(len(shape)) if shape[d] % devices == 0]
  if not fits:
    return P()
  axis = max(fits, key=lambda d: (shape[d], -d))
  return P(*[("data" if d == axis else None) for d in range(len(shape))])


def megatron_spec(path: str, rules: Mapping[str, tuple]) -> P:
  hits = [spec for pattern, spec in rules.items() if re.fullmatch(pattern, path)]
  if len(hits) != 1:
    raise KeyError(f"{len(hits)} Megatron rules match {path!r}")
  return P(*hits[0])


def _abstract(tree: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


def compile_hand(loss_fn: Callable, optimizer: optax.GradientTransformation, variables: Any,
                 batch: Any, mesh: Mesh, spec_of: Callable[[str, tuple], P],
                 batch_axes: tuple[str, ...]) -> Figures:
  """The hand step over ``mesh`` with ``spec_of(path, shape)`` for every parameter (and the
  optimizer state leaf of the same shape under it), batch rows over ``batch_axes``."""
  import time

  params = variables["params"]
  specs = jax.tree_util.tree_map_with_path(lambda p, x: spec_of(keypath(p), x.shape), params)
  param_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  opt_shape = jax.eval_shape(optimizer.init, params)
  opt_sh = optax.tree_map_params(optimizer, lambda _, s: s, opt_shape, param_sh,
                                 transform_non_params=lambda _: NamedSharding(mesh, P()))
  state_sh = (param_sh, opt_sh)
  rows = NamedSharding(mesh, P(batch_axes))
  state = _abstract((params, opt_shape), state_sh)
  batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rows), batch)
  step = jax.jit(hand_step(loss_fn, optimizer),
                 out_shardings=(state_sh, NamedSharding(mesh, P())), donate_argnums=0)
  start = time.perf_counter()
  compiled = step.lower(state, batch).compile()
  return Figures.of(compiled, time.perf_counter() - start)


def fsdp(loss_fn, optimizer, variables, batch, devices: list) -> Figures:
  mesh = Mesh(np.asarray(devices), ("data",))
  return compile_hand(loss_fn, optimizer, variables, batch, mesh,
                      lambda _, shape: fsdp_spec(shape, len(devices)), ("data",))


def megatron(loss_fn, optimizer, variables, batch, devices: list, model: int,
             rules: Mapping[str, tuple]) -> Figures:
  """``model`` consecutive devices (one host's) split each layer; the rest is data."""
  mesh = Mesh(np.asarray(devices).reshape(len(devices) // model, model), ("data", "model"))
  return compile_hand(loss_fn, optimizer, variables, batch, mesh,
                      lambda path, _: megatron_spec("params/" + path, rules), ("data",))
