"""Pipeline bytes per device against a hand-written ``shard_map`` GPipe of the same model.

    python bench/pipeline.py memory            # XLA:CPU, 8 simulated devices
    python bench/pipeline.py memory --gpu      # 8 compile-only H100s (v312 venv, JAX_PLATFORMS=cpu)
    python bench/pipeline.py memory --record   # and record the table in bench/RESULTS.md

A GPT of ``L`` decoder layers of width ``W`` (a Python loop of layers, cut into 4 stages by
``auto.auto_parallel``), 2 pipeline replicas on 8 devices, ``M`` micro batches, AdamW, with
each ``pipeline.param_layout``: 'user' (the default: the train state is the user's tree, each
leaf split over ``stage``, packed into the loop's buffers inside the step) and 'stage' (the
train state is the loop's slots, each stage's leaves whole on its devices). The
hand-written side stacks the layers ``(S, L/S, ...)`` stored over ``stage`` (AdamW's state
likewise), runs a GPipe loop of ``M + S - 1`` ticks with ``ppermute`` in a ``shard_map`` over
``(data, stage)``, differentiates through it with ``jax.grad`` and applies ``optax.adamw``,
jitted with donated state. Both are compiled from shapes alone (nothing runs); the figure is
peak bytes per device, ``arguments + outputs - aliased + temp`` of ``memory_analysis()``, and
temp over one stage's parameter bytes.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS") or "--xla_force_host_platform_device_count=8"
BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)
# This checkout's epljax, not an installed one (a worktree beside an editable install).
sys.path.insert(1, os.path.dirname(BENCH))

import argparse  # noqa: E402
import dataclasses  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import epljax as epl  # noqa: E402
from pipelines import hand_gpipe  # noqa: E402
from gpu_aot import as_devices  # noqa: E402

S, VOCAB, HEADS, SEQ, ROWS = 4, 256, 4, 32, 2   # ROWS: per micro batch per replica
CASES = ((8, 512, 8, "PreferForward"), (8, 512, 8, "PreferBackward"),
         (4, 1024, 4, "PreferForward"),           # (layers, width, M, strategy)
         (4, 256, 4, "PreferForward"))            # (tests/test_cost.py's row)


class Layer(nn.Module):
  width: int

  @nn.compact
  def __call__(self, x):
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    x = x + nn.MultiHeadDotProductAttention(HEADS)(nn.LayerNorm()(x), mask=mask)
    return x + nn.Dense(self.width)(nn.gelu(nn.Dense(4 * self.width)(nn.LayerNorm()(x))))


class Stem(nn.Module):
  width: int

  @nn.compact
  def __call__(self, tokens):
    return nn.Embed(VOCAB, self.width)(tokens) + self.param(
        "position", nn.initializers.normal(0.02), (SEQ, self.width))


class Head(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(VOCAB)(nn.LayerNorm()(x))


class GPT(nn.Module):
  layers: int
  width: int

  @nn.compact
  def __call__(self, tokens):
    x = Stem(self.width)(tokens)
    for _ in range(self.layers):
      x = Layer(self.width)(x)
    return Head()(x)


def batch_shapes(micro: int) -> dict:
  rows = 2 * micro * ROWS
  return {"x": jax.ShapeDtypeStruct((rows, SEQ), jnp.int32),
          "y": jax.ShapeDtypeStruct((rows, SEQ), jnp.int32)}


def ce(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@dataclasses.dataclass(frozen=True)
class Bytes:
  peak: int          # arguments + outputs - aliased + temp, per device
  temp: int

  @classmethod
  def of(cls, compiled) -> Bytes:
    m = compiled.memory_analysis()
    return cls(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
               + m.temp_size_in_bytes, m.temp_size_in_bytes)


def epljax_bytes(layers: int, width: int, micro: int, strategy: str, devices=None,
                 param_layout: str = "user") -> Bytes:
  """The epljax step's bytes (auto cut into ``S`` stages, AdamW, ``pipeline.param_layout``),
  compiled from shapes."""
  model = GPT(layers, width)
  b = {k: np.zeros(v.shape, v.dtype) for k, v in batch_shapes(micro).items()}
  with as_devices((devices or jax.devices())[:2 * S]):
    epl.init({"pipeline.num_micro_batch": micro, "pipeline.num_stages": S,
              "auto.auto_parallel": True, "pipeline.strategy": strategy,
              "pipeline.param_layout": param_layout})
    trainer = epl.Trainer(lambda k, bt: model.init(k, bt["x"]),
                          lambda v, bt: ce(model.apply(v, bt["x"]), bt["y"]), optax.adamw(1e-3))
    return Bytes.of(trainer._build(jax.random.key(0), b).plan.compiled)


def stacked_shapes(layers: int, width: int) -> dict:
  """The hand-written GPipe's parameters: stem, head, and the layers stacked ``(S, L/S, ...)``."""
  h = jnp.zeros((1, SEQ, width))
  one = jax.eval_shape(lambda: Layer(width).init(jax.random.key(0), h)["params"])
  return {"stem": jax.eval_shape(lambda: Stem(width).init(
              jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))["params"]),
          "blocks": jax.tree.map(lambda a: jax.ShapeDtypeStruct((S, layers // S, *a.shape),
                                                                a.dtype), one),
          "head": jax.eval_shape(lambda: Head().init(jax.random.key(0), h)["params"])}


def hand_bytes(layers: int, width: int, micro: int, devices=None) -> Bytes:
  """A GPipe written by hand (``hand_gpipe.py``) with AdamW, compiled from shapes."""
  mesh = hand_gpipe.mesh_of(devices or jax.devices(), S)
  shapes = stacked_shapes(layers, width)
  shard = hand_gpipe.shardings(shapes, mesh)
  loss = hand_gpipe.gpipe_loss(lambda p, x: Stem(width).apply({"params": p}, x),
                               lambda p, a: Layer(width).apply({"params": p}, a),
                               lambda p, h: Head().apply({"params": p}, h), mesh, micro)
  optimizer = optax.adamw(1e-3)

  def step(p, opt, b):
    value, grads = jax.value_and_grad(loss)(p, b)
    updates, opt = optimizer.update(grads, opt, p)
    return optax.apply_updates(p, updates), opt, value

  opt_shapes = jax.eval_shape(optimizer.init, shapes)
  opt_shard = opt_shardings(optimizer, opt_shapes, shard, mesh)
  return Bytes.of(step_jit(step, shard, opt_shard, mesh).lower(
      shaped(shapes, shard), shaped(opt_shapes, opt_shard), batch_args(micro, mesh)).compile())


def opt_shardings(optimizer, opt_shapes, param_shardings, mesh):
  """The optimizer state's shardings: each params-like tree as the parameters', the rest
  (counts) replicated."""
  return optax.tree_map_params(optimizer, lambda _, s: s, opt_shapes, param_shardings,
                               transform_non_params=lambda _: NamedSharding(mesh, P()))


def shaped(tree, shardings):
  """``tree``'s shapes and dtypes as abstract arguments in ``shardings``."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree,
                      shardings)


def batch_args(micro: int, mesh, axes=("data",)) -> dict:
  """The batch as abstract arguments split over ``axes``."""
  sharding = NamedSharding(mesh, P(axes))
  return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)
          for k, v in batch_shapes(micro).items()}


def step_jit(step, param_shardings, opt_shardings, mesh):
  """``step(params, opt_state, batch) -> (params, opt_state, loss)`` jitted with its state
  donated and kept in its shardings."""
  return jax.jit(step, out_shardings=(param_shardings, opt_shardings, NamedSharding(mesh, P())),
                 donate_argnums=(0, 1))


def stage_param_bytes(layers: int, width: int) -> int:
  """One stage's layer parameter bytes (the stacked blocks, per stage device)."""
  return sum(a.size * a.dtype.itemsize
             for a in jax.tree.leaves(stacked_shapes(layers, width)["blocks"])) // S


def rows(devices=None) -> list[list]:
  out = []
  for layers, width, micro, strategy in CASES:
    hand = hand_bytes(layers, width, micro, devices)
    user, stage = (epljax_bytes(layers, width, micro, strategy, devices, layout)
                   for layout in ("user", "stage"))
    per = stage_param_bytes(layers, width)
    name = "GPipe" if strategy == "PreferForward" else "1F1B"
    out.append([f"{layers} layers, width {width}, M={micro}, {name}",
                f"{hand.peak / 2**20:.1f}", f"{user.peak / 2**20:.1f}",
                f"{user.peak / hand.peak:.2f}x", f"{stage.peak / 2**20:.1f}",
                f"**{stage.peak / hand.peak:.2f}x**", f"{hand.temp / per:.2f}",
                f"{user.temp / per:.2f}", f"{stage.temp / per:.2f}"])
    print(out[-1], flush=True)
  return out


HEADER = ["model, schedule", "hand GPipe peak MiB", "epljax 'user' peak MiB", "/ hand",
          "epljax 'stage' peak MiB", "/ hand", "hand temp / stage param B",
          "'user' temp / stage param B", "'stage' temp / stage param B"]


def cli(doc: str, argv=None, add=None):
  """The pipeline benches' command line (``--gpu``, ``--record``, and what ``add(parser)``
  adds): (args, devices, where they compile for, in words)."""
  parser = argparse.ArgumentParser(description=doc.splitlines()[0])
  parser.add_argument("--gpu", action="store_true", help="8 compile-only H100s")
  parser.add_argument("--record", action="store_true")
  if add is not None:
    add(parser)
  args = parser.parse_args(argv)
  if not args.gpu:
    return args, jax.devices(), "XLA:CPU, 8 simulated devices"
  from gpu_aot import h100s
  return args, h100s(), "8 compile-only H100s (XLA:GPU)"


def main(argv=None) -> None:
  from common import record, table
  args, devices, where = cli(__doc__, argv)
  text = table(HEADER, rows(devices))
  print(text)
  if args.record:
    record("Pipeline bytes per device vs a hand-written GPipe", text, used=devices[:2 * S])
