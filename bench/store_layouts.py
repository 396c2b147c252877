"""Peak bytes per device of one hand-written GPipe under six ways of storing its train state.

    python bench/store_layouts.py                              # XLA:CPU, 8 simulated devices
    JAX_PLATFORMS=cpu python bench/store_layouts.py --gpu      # 8 compile-only H100s (v312 venv)

The model, mesh (2 replicas x 4 stages) and GPipe loop are ``pipeline_memory.py``'s; only where
the parameters and AdamW's state live between steps, and which tree optax sees, change:

    (a) hand     params and AdamW state stacked ``(S, L/S, ...)`` over ``stage`` (``hand_bytes``)
    (b) leaves   both a per-layer tree {stem, layer_i, head}, every leaf split over ``stage`` on its
                 largest dimension divisible by S (epljax today); restacked for the loop each step
    (c) stored   params stacked as (a), AdamW state as (b): gradients and params cut into the
                 per-layer tree for ``optax.adamw``, the new params restacked
    c+           (c) with an ``optimization_barrier`` on (params, AdamW state, gradients) after
                 the loop, meant to keep XLA from moving the params into the per-layer layout
                 before the loop (they need only the arguments), where that copy stays live
                 (XLA:GPU keeps the barrier; XLA:CPU drops it before scheduling)
    (d) sliced   (a)'s storage; AdamW on the per-layer slices of params and state, each slice
                 resharded as in (b)
    dl           (a)'s storage; AdamW in a ``shard_map`` over the stages: each stage device
                 updates the per-layer slices it holds, nothing moves (optax sees stem, head and
                 its own L/S layers: elementwise transforms are kept, global norms are not)

All compiled from shapes with donated state (nothing runs); peak is ``arguments + outputs -
aliased + temp`` of ``memory_analysis()``. Without ``--gpu`` one small case also runs one step
of every variant on the CPU devices and checks the updated params agree.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS") or "--xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import hand_gpipe  # noqa: E402
from epljax.pipeline.storage import add_axis  # noqa: E402
from pipeline_memory import (S, SEQ, VOCAB, Bytes, Head, Layer, Stem,  # noqa: E402
                             batch_args, batch_shapes, cli, hand_bytes, opt_shardings, shaped,
                             stacked_shapes, step_jit)

CASES = ((8, 512, 8), (4, 1024, 4), (4, 256, 4))   # (layers, width, M), GPipe
VARIANTS = ("a", "b", "c", "c+", "d", "dl")


def split_spec(shape) -> P:
  """``stage`` on the largest dimension divisible by S (the first such, on ties), else none:
  how epljax stores a leaf over stages (``storage.add_axis``)."""
  return add_axis(P(), tuple(shape), "stage", S) or P()


class Layouts:
  """The stacked ``{stem, blocks, head}`` and per-layer ``{stem, layer_i, head}`` trees of one
  model: shapes, shardings, and the conversions (inside jit; GSPMD makes the collectives)."""

  def __init__(self, layers: int, width: int, mesh):
    self.layers, self.per = layers, layers // S
    self.stacked = stacked_shapes(layers, width)
    self.stacked_sh = hand_gpipe.shardings(self.stacked, mesh)
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[2:], a.dtype),
                       self.stacked["blocks"])
    self.tree = {"stem": self.stacked["stem"], **{f"layer_{i}": one for i in range(layers)},
                 "head": self.stacked["head"]}
    self.tree_sh = jax.tree.map(lambda a: NamedSharding(mesh, split_spec(a.shape)), self.tree)

  def to_tree(self, p):
    t = {"stem": p["stem"], "head": p["head"]}
    for i in range(self.layers):
      t[f"layer_{i}"] = jax.tree.map(lambda a, i=i: a[i // self.per, i % self.per], p["blocks"])
    return jax.lax.with_sharding_constraint(t, self.tree_sh)

  def to_stacked(self, t):
    ls = [t[f"layer_{i}"] for i in range(self.layers)]
    blocks = jax.tree.map(lambda *a: jnp.stack(a).reshape(S, self.per, *a[0].shape), *ls)
    return jax.lax.with_sharding_constraint(
        {"stem": t["stem"], "blocks": blocks, "head": t["head"]}, self.stacked_sh)

  def local_tree(self, p):
    """Inside a ``shard_map`` over ``stage``: this stage's ``(1, L/S, ...)`` blocks as layers."""
    return {"stem": p["stem"], "head": p["head"], **{
        f"layer_{j}": jax.tree.map(lambda a, j=j: a[0, j], p["blocks"]) for j in range(self.per)}}

  def local_stacked(self, t):
    ls = [t[f"layer_{j}"] for j in range(self.per)]
    return {"stem": t["stem"], "head": t["head"],
            "blocks": jax.tree.map(lambda *a: jnp.stack(a)[None], *ls)}

  def host_tree(self, p) -> dict:
    """Any layout's params as a per-layer tree of numpy arrays (to compare results)."""
    p = jax.tree.map(np.asarray, p)
    if "blocks" not in p:
      return p
    return {"stem": p["stem"], "head": p["head"],
            **{f"layer_{i}": jax.tree.map(lambda a, i=i: a[i // self.per, i % self.per],
                                          p["blocks"]) for i in range(self.layers)}}


def on_params(fn, opt, key: str):
  """``fn`` applied to each params-like tree (a dict holding ``key``) inside an optax state."""
  like = lambda x: isinstance(x, dict) and key in x  # noqa: E731
  return jax.tree.map(lambda x: fn(x) if like(x) else x, opt, is_leaf=like)


def build(kind: str, layers: int, width: int, micro: int, mesh, optimizer=None):
  """Variant ``kind``'s jitted step and its abstract arguments (params, AdamW state, batch)."""
  lay = Layouts(layers, width, mesh)
  loss = hand_gpipe.gpipe_loss(lambda p, x: Stem(width).apply({"params": p}, x),
                               lambda p, a: Layer(width).apply({"params": p}, a),
                               lambda p, h: Head().apply({"params": p}, h), mesh, micro)
  optimizer = optimizer or optax.adamw(1e-3)
  p_stacked, o_stacked = kind[0] in "acd", kind[0] in "ad"
  shapes, shard = (lay.stacked, lay.stacked_sh) if p_stacked else (lay.tree, lay.tree_sh)
  o_shapes, o_from = (lay.stacked, lay.stacked_sh) if o_stacked else (lay.tree, lay.tree_sh)
  opt_shapes = jax.eval_shape(optimizer.init, o_shapes)
  opt_shard = opt_shardings(optimizer, opt_shapes, o_from, mesh)
  spec = lambda tree: jax.tree.map(lambda s: s.spec, tree)  # noqa: E731

  def local_update(p, opt, grads):
    pt, ot = lay.local_tree(p), on_params(lay.local_tree, opt, "blocks")
    updates, ot = optimizer.update(lay.local_tree(grads), ot, pt)
    return (lay.local_stacked(optax.apply_updates(pt, updates)),
            on_params(lay.local_stacked, ot, "layer_0"))

  def step(p, opt, b):
    value, grads = jax.value_and_grad(loss)(p if p_stacked else lay.to_stacked(p), b)
    if kind == "a":
      updates, opt = optimizer.update(grads, opt, p)
      return optax.apply_updates(p, updates), opt, value
    if kind == "dl":
      return (*jax.shard_map(local_update, mesh=mesh, in_specs=(spec(shard), spec(opt_shard),
                                                                spec(shard)),
                             out_specs=(spec(shard), spec(opt_shard)), check_vma=False)(
                                 p, opt, grads), value)
    if kind.endswith("+"):        # the layout changes below wait for the gradients
      p, opt, grads = jax.lax.optimization_barrier((p, opt, grads))
    pt = lay.to_tree(p) if p_stacked else p
    ot = on_params(lay.to_tree, opt, "blocks") if o_stacked else opt
    updates, ot = optimizer.update(lay.to_tree(grads), ot, pt)
    new = optax.apply_updates(pt, updates)
    return (lay.to_stacked(new) if p_stacked else new,
            on_params(lay.to_stacked, ot, "layer_0") if o_stacked else ot, value)

  args = (shaped(shapes, shard), shaped(opt_shapes, opt_shard), batch_args(micro, mesh))
  return step_jit(step, shard, opt_shard, mesh), args, lay, optimizer


def variant_bytes(kind: str, layers: int, width: int, micro: int, devices) -> Bytes:
  if kind == "a":
    return hand_bytes(layers, width, micro, devices)
  jitted, args, _, _ = build(kind, layers, width, micro, hand_gpipe.mesh_of(devices, S))
  return Bytes.of(jitted.lower(*args).compile())


def check(layers: int = 4, width: int = 64, micro: int = 4) -> float:
  """One step of every variant from the same values on the CPU devices: the largest difference
  of the updated params (per-layer layout) from (a)'s. AdamW's ``eps`` is 1e-3 here: its first
  step is ``-lr * g / (|g| + eps)``, and the attention key biases' gradients are zero up to
  rounding (~1e-10), so the default 1e-8 turns float noise in them into 1e-4 differences."""
  mesh = hand_gpipe.mesh_of(jax.devices(), S)
  keys = jax.random.split(jax.random.key(0), layers + 3)
  h = jnp.zeros((1, SEQ, width))
  tree = {"stem": Stem(width).init(keys[0], jnp.zeros((1, SEQ), jnp.int32))["params"],
          "head": Head().init(keys[1], h)["params"],
          **{f"layer_{i}": Layer(width).init(keys[2 + i], h)["params"] for i in range(layers)}}
  rows = batch_shapes(micro)["x"].shape
  batch = {k: np.asarray(jax.random.randint(keys[-1 - j], rows, 0, VOCAB))
           for j, k in enumerate(("x", "y"))}
  out, values = {}, {}
  for kind in VARIANTS:
    jitted, (p_abs, o_abs, b_abs), lay, optimizer = build(
        kind, layers, width, micro, mesh, optax.adamw(1e-3, eps=1e-3))
    stacked = jax.jit(lay.to_stacked)(tree)
    p = stacked if kind[0] in "acd" else tree
    o = optimizer.init(stacked if kind[0] in "ad" else tree)
    place = lambda x, a: jax.device_put(x, a.sharding)  # noqa: E731
    new, _, values[kind] = jitted(jax.tree.map(place, p, p_abs), jax.tree.map(place, o, o_abs),
                                  jax.tree.map(place, batch, b_abs))
    out[kind] = lay.host_tree(new)
  diff = {k: max(float(np.max(np.abs(x - y))) for x, y in zip(
      jax.tree.leaves(out["a"]), jax.tree.leaves(out[k]))) for k in VARIANTS}
  moved = max(float(np.max(np.abs(x - np.asarray(y)))) for x, y in zip(
      jax.tree.leaves(out["a"]), jax.tree.leaves(tree)))
  print(f"check {layers} layers, width {width}, M={micro}: losses "
        f"{ {k: round(float(v), 6) for k, v in values.items()} }, max |param - (a)'s| "
        f"{diff}, largest update {moved:.2e}", flush=True)
  assert all(d <= 1e-5 for d in diff.values()), diff
  return max(diff.values())


def rows(devices) -> list[list]:
  out, mib = [], lambda n: f"{n / 2**20:.1f}"  # noqa: E731
  for layers, width, micro in CASES:
    got = {k: variant_bytes(k, layers, width, micro, devices) for k in VARIANTS}
    for k in VARIANTS:
      out.append([f"{layers} layers, width {width}, M={micro}", k, mib(got[k].peak),
                  mib(got[k].temp), f"**{got[k].peak / got['a'].peak:.2f}x**"])
      print(out[-1], flush=True)
  return out


HEADER = ["model (GPipe)", "variant", "peak MiB", "temp MiB", "peak / (a)"]


def main(argv=None) -> None:
  from common import record, table
  args, devices, where = cli(__doc__, argv)
  checked = "" if args.gpu else (
      f"One step of every variant (4 layers, width 64, on the CPU devices) gives params within "
      f"{check():.2g} of (a)'s.")
  text = table(HEADER, rows(devices))
  print(f"{where}, peak and temp in MiB per device\n{text}\n{checked}")
  if args.record:
    about = "\n\n".join(__doc__.split("\n\n")[2:5])   # the model, the variants, how measured
    record(f"Pipeline train-state layouts, one hand-written GPipe, {where}",
           f"{about}\n\n{text}\n\n{checked}".strip())


if __name__ == "__main__":
  main()
