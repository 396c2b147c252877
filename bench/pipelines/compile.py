"""Pipeline compile cost against depth, next to a hand-written ``shard_map`` GPipe.

    python bench/pipeline.py compile --depth [--record]
    python bench/pipeline.py compile --roll [--scan] [--record]   # roll_layers off/on: GPT,
                                                                  # plain jit; nn.scan
    python bench/pipeline.py compile --baseline 48 [--gpu] [--record]  # the loop GPT: hand
                                     # GPipe, plain jax.jit, epljax; init and step apart

The same residual MLP (``Block`` of ``schedule.py``, width 256) with L in {4, 24, 48}
blocks, S=4 stages (``set_default_strategy`` every L/4 blocks), M=8 micro batches, 2 replicas
on 8 devices:

- epljax: ``trainer.init`` (trace, capture, stage cut, plan) plus lowering and compiling the
  train step; HLO size = characters of the compiled step's HLO text. Three ways a user writes
  the model: a Python loop of blocks (``set_default_strategy`` every L/4 blocks), the same with
  ``pipeline.roll_layers``, and the blocks under ``nn.scan`` cut by ``auto.auto_parallel`` (the
  scan split into one scan per stage, its stacked weights stored ``P("stage", ...)``);
- hand-written: the blocks' parameters stacked ``(S, L/S, ...)`` on the ``stage`` axis, one
  ``lax.scan`` over a stage's blocks, a GPipe loop of ``M + S - 1`` ticks with ``ppermute`` in a
  ``shard_map`` over ``(data, stage)``, ``jax.grad`` through it and an SGD update, lowered and
  compiled the same way (its program does not grow with depth: the scan body is one block).
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
import re  # noqa: E402
import time  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import epljax as epl  # noqa: E402
from epljax import hlo  # noqa: E402
from pipelines import hand_gpipe  # noqa: E402
from gpu_aot import as_devices  # noqa: E402

S, M, WIDTH, ROWS, FEATURES, CLASSES = 4, 8, 256, 16, 32, 10


class Block(nn.Module):
  @nn.compact
  def __call__(self, h):
    return h + nn.Dense(WIDTH)(nn.gelu(nn.Dense(WIDTH)(nn.LayerNorm()(h))))


class Deep(nn.Module):
  layers: int

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(WIDTH)(x)
    for i in range(self.layers):
      if i % (self.layers // S) == 0:
        epl.set_default_strategy(epl.replicate(1))
      h = Block()(h)
    return nn.Dense(CLASSES)(h)


class ScanBlock(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    return Block()(h), None


class Scanned(nn.Module):
  """``Deep`` with its blocks under ``nn.scan`` (weights stacked on a leading layers axis)."""
  layers: int

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(WIDTH)(x)
    blocks = nn.scan(ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                     length=self.layers)
    h, _ = blocks()(h, None)
    return nn.Dense(CLASSES)(h)


VARIANTS = ("loop", "loop + roll_layers", "nn.scan")


def batch(rows: int) -> dict:
  rng = np.random.default_rng(0)
  return {"x": rng.normal(size=(rows, FEATURES)).astype(np.float32),
          "y": rng.integers(0, CLASSES, rows).astype(np.int32)}


def epljax_trainer(model: nn.Module, config: dict, rows: int) -> tuple[epl.Trainer, dict]:
  """An epljax Trainer of ``model`` (cross-entropy, SGD) under ``config``, and a batch."""
  epl.init(config)

  def loss_fn(variables, bt):
    logits = model.apply(variables, bt["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, bt["y"]).mean()

  return (epl.Trainer(lambda k, bt: model.init(k, bt["x"]), loss_fn, optax.sgd(0.1)),
          batch(rows))


def epljax_cost(layers: int, variant: str = "loop") -> tuple[float, float, int, float]:
  """Seconds (init + step, the step's lowering and compile alone), HLO characters and temp MiB
  per device of the compiled step (``VARIANTS``)."""
  if variant == "nn.scan":
    config = {"pipeline.num_micro_batch": M, "auto.auto_parallel": True, "pipeline.num_stages": S}
    model = Scanned(layers)
  else:
    config = {"pipeline.num_micro_batch": M, "pipeline.roll_layers": variant != "loop"}
    model = Deep(layers)
  trainer, b = epljax_trainer(model, config, 2 * M * ROWS)
  start = time.perf_counter()
  state = trainer.init(jax.random.key(0), b)
  step_start = time.perf_counter()
  compiled = trainer.lower(state, b).compile()
  end = time.perf_counter()
  return (end - start, end - step_start, len(compiled.as_text()),
          compiled.memory_analysis().temp_size_in_bytes / 2**20)


def _block(p, h):
  mu = h.mean(-1, keepdims=True)
  var = ((h - mu) ** 2).mean(-1, keepdims=True)
  y = (h - mu) * lax.rsqrt(var + 1e-6) * p["scale"] + p["bias"]
  return h + nn.gelu(y @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def _mlp_params(key, layers: int) -> dict:
  """The residual MLP's parameters for a hand-written GPipe: blocks stacked ``(S, L/S, ...)``."""
  k = jax.random.split(key, 4)
  per = (S, layers // S)
  return {"stem": jax.random.normal(k[0], (FEATURES, WIDTH)) * 0.1,
          "head": jax.random.normal(k[1], (WIDTH, CLASSES)) * 0.1,
          "blocks": {"w1": jax.random.normal(k[2], (*per, WIDTH, WIDTH)) * 0.05,
                     "w2": jax.random.normal(k[3], (*per, WIDTH, WIDTH)) * 0.05,
                     "b1": jnp.zeros((*per, WIDTH)), "b2": jnp.zeros((*per, WIDTH)),
                     "scale": jnp.ones((*per, WIDTH)), "bias": jnp.zeros((*per, WIDTH))}}


def handwritten_step(layers: int):
  """A GPipe written by hand over stacked blocks (see the module doc): the jitted step and its
  arguments."""
  params = _mlp_params(jax.random.key(0), layers)
  step = gpipe(lambda p, x: x @ p, _block, lambda p, h: h @ p, params)
  return step, (params, batch(2 * M * ROWS))


def handwritten_cost(layers: int) -> tuple[float, int]:
  """Seconds to lower and compile the hand-written step, and its HLO characters."""
  step, args = handwritten_step(layers)
  start = time.perf_counter()
  compiled = step.lower(*args).compile()
  return time.perf_counter() - start, len(compiled.as_text())


# -- rolled layers by default (``--roll``): the GPT and plain-jit figures ---------------
VOCAB, GPT_WIDTH, HEADS, SEQ = 128, 64, 2, 16


class GPTLayer(nn.Module):
  """A pre-LayerNorm decoder layer (causal self-attention, gelu MLP)."""
  @nn.compact
  def __call__(self, x):
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    x = x + nn.MultiHeadDotProductAttention(HEADS)(nn.LayerNorm()(x), mask=mask)
    return x + nn.Dense(GPT_WIDTH)(nn.gelu(nn.Dense(4 * GPT_WIDTH)(nn.LayerNorm()(x))))


class GPTStem(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    return nn.Embed(VOCAB, GPT_WIDTH)(tokens) + self.param(
        "position", nn.initializers.normal(0.02), (SEQ, GPT_WIDTH))


class GPTHead(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(VOCAB)(nn.LayerNorm()(x))


class GPT(nn.Module):
  """A GPT whose layers are a Python loop (cut into stages by ``auto.auto_parallel``)."""
  layers: int

  @nn.compact
  def __call__(self, tokens):
    x = GPTStem()(tokens)
    for _ in range(self.layers):
      x = GPTLayer()(x)
    return GPTHead()(x)


def gpt_batch(rows: int) -> dict:
  tokens = np.random.default_rng(0).integers(0, VOCAB, (rows, SEQ + 1)).astype(np.int32)
  return {"x": tokens[:, :-1], "y": tokens[:, 1:]}


def gpt_cost(layers: int, roll: bool) -> tuple[float, int, float]:
  """epljax on the Python-loop GPT (auto, S stages, M micro batches, SGD): seconds of
  ``trainer.init`` + lower + compile of the step, the step's HLO characters and temp MiB."""
  epl.init({"pipeline.num_micro_batch": M, "auto.auto_parallel": True,
            "pipeline.num_stages": S, "pipeline.roll_layers": roll})
  model = GPT(layers)

  def loss_fn(variables, bt):
    logits = model.apply(variables, bt["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, bt["y"]).mean()

  trainer = epl.Trainer(lambda k, bt: model.init(k, bt["x"]), loss_fn, optax.sgd(0.1))
  b = gpt_batch(2 * M * 2)
  start = time.perf_counter()
  state = trainer.init(jax.random.key(0), b)
  compiled = trainer.lower(state, b).compile()
  return (time.perf_counter() - start, len(compiled.as_text()),
          compiled.memory_analysis().temp_size_in_bytes / 2**20)


def gpt_handwritten_cost(layers: int) -> tuple[float, int]:
  """The GPT's layers stacked ``(S, L/S, ...)`` in the hand-written GPipe (``gpipe``), SGD:
  seconds to compile its parameters' init and to lower and compile its step, and the step's
  HLO characters (both init compiles are counted, as epljax's ``trainer.init`` compiles its
  own)."""
  b = gpt_batch(2 * M * 2)
  start = time.perf_counter()
  params = jax.jit(gpt_stacked_init(layers))(jax.random.key(0))
  compiled = gpt_gpipe(params).lower(params, b).compile()
  return time.perf_counter() - start, len(compiled.as_text())


def gpt_stacked_init(layers: int):
  """The hand-written GPipe's init: stem and head, and the layers stacked ``(S, L/S, ...)``
  by ``vmap`` (one layer's init, vmapped)."""
  x, h = jnp.zeros((1, SEQ), jnp.int32), jnp.zeros((1, SEQ, GPT_WIDTH))

  def init(key):
    k = jax.random.split(key, 3)
    layer_keys = jax.random.split(k[1], layers).reshape(S, layers // S)
    return {"stem": GPTStem().init(k[0], x)["params"],
            "blocks": jax.vmap(jax.vmap(lambda kk: GPTLayer().init(kk, h)["params"]))(
                layer_keys),
            "head": GPTHead().init(k[2], h)["params"]}

  return init


def gpt_gpipe(params):
  """The jitted hand-written GPipe step of the GPT (``gpipe``) for ``params`` (or their
  shapes) made by ``gpt_stacked_init``."""
  return gpipe(lambda p, t: GPTStem().apply({"params": p}, t),
               lambda p, a: GPTLayer().apply({"params": p}, a),
               lambda p, a: GPTHead().apply({"params": p}, a), params)


def gpipe(stem, block, head, params):
  """A jitted GPipe step (cross-entropy, SGD) written by hand (``hand_gpipe.py``) over
  ``jax.devices()``: ``params["blocks"]`` stacked ``(S, L/S, ...)`` and stored over ``stage``."""
  mesh = hand_gpipe.mesh_of(jax.devices(), S)
  loss = hand_gpipe.gpipe_loss(stem, block, head, mesh, M)

  def step(p, bt):
    grads = jax.grad(loss)(p, bt)
    return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads)

  shard = hand_gpipe.shardings(params, mesh)
  return jax.jit(step, in_shardings=(shard, NamedSharding(mesh, P("data"))),
                 out_shardings=shard)


def plain_jit_hlo(layers: int) -> int:
  """HLO characters of plain ``jax.jit`` of the residual MLP ``Deep(layers)``'s SGD step on one
  device (the program a user would write without epljax)."""
  model, b = Deep(layers), batch(2 * M * ROWS)
  variables = jax.eval_shape(lambda: model.init(jax.random.key(0), b["x"]))

  def step(v, bt):
    def loss(v):
      logits = model.apply(v, bt["x"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, bt["y"]).mean()
    return jax.tree.map(lambda a, g: a - 0.1 * g, v, jax.grad(loss)(v))

  return len(jax.jit(step).lower(variables, b).compile().as_text())


def roll_rows(loop_layers: int = 32, gpt_layers: int = 48) -> list[list]:
  """The issue's figures, roll_layers off and on: the loop MLP's pipeline step HLO over plain
  ``jax.jit``'s, and the loop GPT's trace + compile over the hand-written GPipe's."""
  rows = []
  plain = plain_jit_hlo(loop_layers)
  hand_s, hand_hlo = gpt_handwritten_cost(gpt_layers)
  for roll in (False, True):
    variant = "loop + roll_layers" if roll else "loop"
    _, _, hlo_chars, temp = epljax_cost(loop_layers, variant)
    rows.append([f"residual MLP {loop_layers}", "on" if roll else "off", "plain jax.jit",
                 "-", "-", "-", f"{hlo_chars / 1e3:.0f}", f"{plain / 1e3:.0f}",
                 f"**{hlo_chars / plain:.2f}x**", f"{temp:.1f}"])
    print(f"mlp roll={roll} done", flush=True)
  for roll in (False, True):
    gpt_s, gpt_hlo, temp = gpt_cost(gpt_layers, roll)
    rows.append([f"GPT {gpt_layers} (auto)", "on" if roll else "off", "hand-written GPipe",
                 f"{gpt_s:.1f}", f"{hand_s:.1f}", f"**{gpt_s / hand_s:.2f}x**",
                 f"{gpt_hlo / 1e3:.0f}", f"{hand_hlo / 1e3:.0f}", f"{gpt_hlo / hand_hlo:.2f}x",
                 f"{temp:.1f}"])
    print(f"gpt roll={roll} done", flush=True)
  return rows


def scan_rows(layers: int = 48) -> list[list]:
  """Like for like on ``nn.scan`` blocks: epljax's GPipe schedule (``PreferForward``) of
  ``Scanned(layers)`` and the hand-written GPipe of the same blocks, SGD on both, each side's
  parameter init compiled and counted."""
  epl.init({"pipeline.num_micro_batch": M, "auto.auto_parallel": True, "pipeline.num_stages": S,
            "pipeline.strategy": "PreferForward"})
  model, b = Scanned(layers), batch(2 * M * ROWS)

  def loss_fn(variables, bt):
    logits = model.apply(variables, bt["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, bt["y"]).mean()

  trainer = epl.Trainer(lambda k, bt: model.init(k, bt["x"]), loss_fn, optax.sgd(0.1))
  start = time.perf_counter()
  state = trainer.init(jax.random.key(0), b)
  compiled = trainer.lower(state, b).compile()
  epl_s, epl_hlo = time.perf_counter() - start, len(compiled.as_text())
  temp = compiled.memory_analysis().temp_size_in_bytes / 2**20

  start = time.perf_counter()
  params = jax.jit(_mlp_params, static_argnums=1)(jax.random.key(0), layers)
  step = gpipe(lambda p, x: x @ p, _block, lambda p, h: h @ p, params)
  hand = step.lower(params, b).compile()
  hand_s, hand_hlo = time.perf_counter() - start, len(hand.as_text())
  return [[f"residual MLP {layers} (nn.scan, GPipe)", "-", "hand-written GPipe",
           f"{epl_s:.1f}", f"{hand_s:.1f}", f"**{epl_s / hand_s:.2f}x**", f"{epl_hlo / 1e3:.0f}",
           f"{hand_hlo / 1e3:.0f}", f"{epl_hlo / hand_hlo:.2f}x", f"{temp:.1f}"]]


def baseline_rows(layers: int = 48, devices: list | None = None) -> list[list]:
  """The loop GPT's compile three ways, side by side: the hand-written GPipe (its layers
  stacked), plain ``jax.jit`` of the user's own model on one device (no pipeline), and epljax
  (auto cut, layers rolled). Init and step are compiled separately, from abstract values, so
  ``devices`` may be compile-only GPUs (``gpu_aot.h100s``, made ``jax.devices()`` while epljax
  and the GPipe build their meshes); default: this machine's."""
  devices = devices or jax.devices()
  mesh = hand_gpipe.mesh_of(devices, S)
  model, b = GPT(layers), gpt_batch(2 * M * 2)
  abstract = lambda tree, sharding: jax.tree.map(  # noqa: E731
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)
  key = jax.eval_shape(lambda: jax.random.key(0))

  def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out

  def loss_fn(variables, bt):
    return optax.softmax_cross_entropy_with_integer_labels(model.apply(variables, bt["x"]),
                                                           bt["y"]).mean()

  # hand-written GPipe: its init (the layers stacked (S, L/S, ...) by vmap) and its step
  stacked_init = gpt_stacked_init(layers)
  with as_devices(devices):
    shapes = jax.eval_shape(stacked_init, jax.random.key(0))
    shard = hand_gpipe.shardings(shapes, mesh)
    hand_init, _ = timed(lambda: jax.jit(stacked_init, out_shardings=shard).lower(
        abstract(key, NamedSharding(mesh, P()))).compile())
    step = gpt_gpipe(shapes)
    params = jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
                          shapes, shard)
    hand_step, hand = timed(lambda: step.lower(
        params, abstract(b, NamedSharding(mesh, P("data")))).compile())

  # plain jax.jit of the same model on one device: what the user compiles without epljax
  one = jax.sharding.SingleDeviceSharding(devices[0])

  def plain_step(v, bt):
    return jax.tree.map(lambda a, g: a - 0.1 * g, v, jax.grad(loss_fn)(v, bt))

  plain_init, _ = timed(lambda: jax.jit(model.init).lower(
      abstract(key, one), abstract(b["x"], one)).compile())
  variables = jax.eval_shape(model.init, jax.random.key(0), b["x"])
  plain_s, plain = timed(lambda: jax.jit(plain_step).lower(
      abstract(variables, one), abstract(b, one)).compile())

  # epljax: trace and plan (nothing compiled), then its init and its step
  with as_devices(devices):
    epl.init({"pipeline.num_micro_batch": M, "auto.auto_parallel": True,
              "pipeline.num_stages": S})
    trainer = epl.Trainer(lambda k, bt: model.init(k, bt["x"]), loss_fn, optax.sgd(0.1))
    plan_s, built = timed(lambda: trainer._build(jax.random.key(0), b))
    whole = NamedSharding(built.plan.mesh, P())
    epl_init, _ = timed(lambda: built.init_jit.lower(abstract(key, whole),
                                                     abstract(b, whole)).compile())
    epl_step, ours = timed(lambda: built.plan.compiled)

  hand_total, plain_total = hand_init + hand_step, plain_init + plain_s
  rows = []
  for name, init_s, step_s, compiled in [
      ("hand-written GPipe (layers stacked)", hand_init, hand_step, hand),
      ("plain jax.jit, one device, no pipeline", plain_init, plain_s, plain),
      ("epljax (trace + plan, init, step)", plan_s + epl_init, epl_step, ours)]:
    total = init_s + step_s
    rows.append([f"GPT {layers}", name, f"{init_s:.1f}", f"{step_s:.1f}", f"{total:.1f}",
                 f"**{total / hand_total:.2f}x**", f"{total / plain_total:.2f}x",
                 f"{step_s / plain_s:.2f}x", f"{len(compiled.as_text()) / 1e3:.0f}",
                 kernel_counts(compiled.as_text())[1]])
  rows[-1][2] = f"{plan_s:.1f} + {epl_init:.1f}"
  return rows


BASELINE_HEADERS = ["model", "program", "init s", "step s", "total s", "vs hand GPipe",
                    "vs plain jax.jit", "step vs plain jit's step", "step HLO kchars",
                    "step's distinct kernels"]

BASELINE_NOTE = (
    "The GPT of --roll (pre-LayerNorm decoder layers of width 64 written as a Python loop, 2 "
    "heads, 16 tokens, SGD), S=4 stages, M=8 micro batches, 2 replicas; every program lowered "
    "from abstract values and compiled, init and step apart. Hand-written GPipe: the layers "
    "stacked (S, L/S, ...) by vmap, one scan over a stage's layers. Plain jax.jit: the user's "
    "own `model.init` and SGD step on one device, no pipeline. epljax: `auto.auto_parallel` "
    "with roll_layers on (the default); its init column is trace + plan (`Trainer._build`, "
    "nothing compiled) + compiling the parameters' init in their stage shardings; its step is "
    "the plan's compiled step. Distinct kernels: the step's fusions whose computations differ "
    "(names and metadata aside), what the compiler generates code for (`kernel_counts`).")


ROLL_NOTE = (
    "S=4 stages, M=8 micro batches, 2 replicas on 8 devices, SGD on both sides. Residual MLP: "
    "`Deep(32)` (width 256, `set_default_strategy` every 8 blocks); HLO ratio: characters of "
    "the compiled pipeline step over those of plain `jax.jit` of the same model's step on one "
    "device. GPT: 48 pre-LayerNorm decoder layers (width 64, 2 heads, 16 tokens) written as a "
    "Python loop, cut by `auto.auto_parallel`; epljax s: `trainer.init` (trace, plan, the "
    "parameters' init compiled) + lower + compile of the step; hand-written s: compiling its "
    "parameters' init (the layers stacked `(S, L/S, ...)` by `vmap`) + lower + compile of "
    "its GPipe step (a scan over a stage's layers). Temp: `memory_analysis()` of the "
    "compiled step. nn.scan (with --scan): `Scanned(48)` cut by `auto.auto_parallel` under "
    "epljax's GPipe schedule (PreferForward) against the hand-written GPipe of the same "
    "blocks, SGD on both, each side's parameter init compiled and counted. Timings ran one "
    "after the other on a shared 2-core machine: ratios hold only roughly.")


ROLL_HEADERS = ["model", "roll_layers", "against", "epljax s", "against s",
                "time ratio", "epljax HLO kchars", "against HLO kchars", "HLO ratio",
                "epljax temp MiB/dev"]


def measure(depths=(4, 24, 48)) -> list[list]:
  rows = []
  for layers in depths:
    hand_s, hand_hlo = handwritten_cost(layers)
    for variant in VARIANTS:
      epl_s, step_s, epl_hlo, temp = epljax_cost(layers, variant)
      rows.append([layers, variant, f"{epl_s:.1f}", f"{step_s:.1f}", f"{hand_s:.1f}",
                   f"**{epl_s / hand_s:.1f}x**", f"{step_s / hand_s:.1f}x",
                   f"{epl_hlo / 1e3:.0f}", f"{hand_hlo / 1e3:.0f}",
                   f"{epl_hlo / hand_hlo:.1f}x", f"{temp:.1f}"])
    print(f"L={layers} done", flush=True)
  return rows


def memory_rows(micros=(4, 8, 16), layers: int = 8) -> list[list]:
  """Per-device temp bytes (``memory_analysis``) and stash slots of 1F1B and GPipe vs M."""
  rows = []
  for micro in micros:
    for strategy in ("PreferBackward", "PreferForward"):
      config = {"pipeline.num_micro_batch": micro, "pipeline.strategy": strategy}
      trainer, b = epljax_trainer(Deep(layers), config, 2 * micro * ROWS)
      trainer.init(jax.random.key(0), b)
      sched = trainer.plan.pipeline.schedule
      rows.append([micro, strategy, sched.num_ticks, str(sched.kept_per_stage),
                   sched.num_slots, f"{trainer.plan.memory.temp_size_in_bytes / 2**20:.2f}"])
  return rows


# -- where the compile time goes (``--compile-split``) ------------------------------------------
_KERNEL = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = .*? fusion\(.*calls=%?([\w.\-]+)")


def kernel_counts(text: str) -> tuple[int, int, int]:
  """(fusion kernels, distinct kernels, distinct kernels found only inside conditional
  branches) of a compiled step. Two fusions whose fused computations are equal up to names and
  metadata are one kernel to generate; a conditional's branches are the pipeline's
  bubble-skipping switch."""
  comps, inside = hlo.computations_in_branches(text)
  bodies = {}
  for name, lines in comps.items():
    body = "\n".join(re.sub(r"%[\w.\-]+|, metadata=\{[^}]*\}", "", ln) for ln in lines)
    bodies[name] = re.sub(r"\b(param|parameter)_?[\d.]*", "p", body)
  kernels = [m.group(1) for lines in comps.values() for ln in lines if (m := _KERNEL.match(ln))]

  def distinct(names):
    return {bodies[m.group(1)] for name in names for ln in comps[name]
            if (m := _KERNEL.match(ln)) and m.group(1) in bodies}

  only_inside = distinct(inside) - distinct(set(comps) - inside)
  return len(kernels), len(distinct(comps)), len(only_inside)


def split_rows(layers: int = 48, reps: int = 5) -> list[list]:
  """Lower and compile times of the epljax step (blocks under ``nn.scan``) and the
  hand-written one, alternately ``reps`` times (medians), with their kernel counts."""
  times = {"epljax": [], "hand-written": []}
  texts = {}
  for rep in range(reps):
    step, args = handwritten_step(layers)
    start = time.perf_counter()
    lowered = step.lower(*args)
    mid = time.perf_counter()
    texts["hand-written"] = lowered.compile().as_text()
    times["hand-written"].append((mid - start, time.perf_counter() - mid))

    config = {"pipeline.num_micro_batch": M, "auto.auto_parallel": True, "pipeline.num_stages": S}
    trainer, b = epljax_trainer(Scanned(layers), config, 2 * M * ROWS)
    state = trainer.init(jax.random.key(rep), b)
    start = time.perf_counter()
    lowered = trainer.lower(state, b)
    mid = time.perf_counter()
    texts["epljax"] = lowered.compile().as_text()
    times["epljax"].append((mid - start, time.perf_counter() - mid))
    print(f"rep {rep + 1}/{reps} done", flush=True)
  rows = []
  hand_lower, hand_compile = (float(np.median([t[i] for t in times["hand-written"]]))
                              for i in (0, 1))
  for who in ("epljax", "hand-written"):
    lower, comp = (float(np.median([t[i] for t in times[who]])) for i in (0, 1))
    total, distinct, branches = kernel_counts(texts[who])
    both = (lower + comp) / (hand_lower + hand_compile)
    rows.append([who, f"{lower:.2f}", f"{comp:.2f}", f"{lower / hand_lower:.1f}x",
                 f"{comp / hand_compile:.1f}x", f"**{both:.1f}x**", total, distinct, branches,
                 f"{len(texts[who]) / 1e3:.0f}"])
  return rows


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="bench/pipeline.py compile")
  # (bench/pipeline.py runs these two in schedule.py, whose residual MLP they measure)
  parser.add_argument("--depth", action="store_true", help="compile time and HLO size vs "
                      "depth, next to a hand-written GPipe")
  parser.add_argument("--split", action="store_true", help="where the 48-block step's "
                      "compile time goes: lower vs XLA compile, and kernels")
  parser.add_argument("--roll", action="store_true", help="roll_layers off and on: the 32-layer "
                      "loop MLP against plain jax.jit, the 48-layer loop GPT against a GPipe")
  parser.add_argument("--scan", action="store_true", help="with --roll: also nn.scan blocks "
                      "like for like (GPipe schedule, SGD, init compiles counted on both sides)")
  parser.add_argument("--baseline", type=int, metavar="LAYERS", help="the loop GPT of LAYERS "
                      "layers: hand-written GPipe, plain jax.jit of the model, epljax (init and "
                      "step compiles apart)")
  parser.add_argument("--gpu", action="store_true", help="with --baseline: compile for 8 "
                      "compile-only H100s (gpu_aot.py; needs the CUDA plugin)")
  parser.add_argument("--record", action="store_true")
  args = parser.parse_args(argv)
  if args.baseline:
    from common import record, table
    devices = None
    if args.gpu:
      from gpu_aot import h100s
      devices = h100s("1x1x8")
    where = "Compiled for 8 compile-only H100s (XLA:GPU). " if args.gpu else ""
    body = (table(BASELINE_HEADERS, baseline_rows(args.baseline, devices)) + "\n\n" + where
            + BASELINE_NOTE)
    print(body)
    if args.record:
      record("Loop GPT compile against plain jax.jit and a hand-written GPipe "
             "(bench/pipeline.py compile --baseline)", body, used=devices)
  elif args.roll:
    from common import record, table
    rows = roll_rows() + (scan_rows() if args.scan else [])
    body = table(ROLL_HEADERS, rows) + "\n\n" + ROLL_NOTE
    print(body)
    if args.record:
      record("Pipelines of Python-loop layers, roll_layers off and on "
             "(bench/pipeline.py compile --roll)", body)
