"""Tensor-parallel pipeline stages: residuals stashed in slots vs inputs kept and recomputed.

    python bench/pipeline.py stash [--record]
    python bench/pipeline.py stash --zoo [--record]   # the zoo's split-stage models instead

A residual MLP (width 256, hidden 1024, 2 blocks per stage) in two ``epl.split(2)`` stages on
8 devices (data 2 x stage 2 x model 2), 4 micro batches, 1F1B, SGD (1e-3: the timing runs
about 50 steps), three ways:
- ``residuals`` (the default): the residuals of each stage's ``jax.vjp`` stashed in slots
  (whole arrays, one ``(slots, *shape)`` buffer per shape, which GSPMD keeps split over
  ``model``);
- the same with ``gradient_checkpoint.type="auto"`` inside the stages;
- ``inputs``: the stage inputs kept and the forward run again in the backward (what split
  stages did before; the loop's stash mode for it is gone, so here a bench-only feature,
  ``RecomputeStages``, wraps each stage in ``jax.checkpoint``, as that mode did).
Compiled train step: FLOPs from ``cost_analysis()``, temporaries from
``memory_analysis()``, bytes of the collectives one device of the busiest stage executes per
step from the HLO (loops counted per iteration, the tick loop's switches by the schedule's tick
table: ``Pipeline.executed_collectives``), the shape of the largest stash buffer, and the step
time as a ratio measured side by side (alternating, median of pairs).

``--zoo``: the models of tests/models whose layers two ``epl.split(2)`` stages can name
(``ZooModel.stage_splits``: Gemma, GPT-2 and its fused-q/k/v layouts, ViT), 64 rows, 2 micro
batches, the same three ways; temporaries, FLOPs, stash bytes per slot (the plan's, before the
``model`` split) and all-gathers of the compiled step.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS") or "--xla_force_host_platform_device_count=8"
BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)
# This checkout's epljax, not an installed one (a worktree beside an editable install).
sys.path.insert(1, os.path.dirname(BENCH))
sys.path.insert(0, os.path.join(os.path.dirname(BENCH), "tests"))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402

import epljax as epl  # noqa: E402
from common import machine, paired_ratio, record, table  # noqa: E402
from epljax import build as build_lib  # noqa: E402
from epljax import hlo  # noqa: E402
from epljax.features import Feature  # noqa: E402

WIDTH, HIDDEN, ROWS, MICRO, MODEL = 256, 1024, 256, 4, 2
CASES = [("residuals", False, {}),
         ("residuals, GC auto", False, {"gradient_checkpoint.type": "auto"}),
         ("inputs", True, {})]


class RecomputeStages(Feature):
  """Each stage's forward under ``jax.checkpoint`` (outermost, after every feature's hook):
  the loop stashes only its inputs and runs the forward again in the backward."""
  name = "recompute_stages"

  def forward(self, fn, ctx):
    return jax.checkpoint(fn)


@contextlib.contextmanager
def recomputed(on: bool):
  """Trainers built inside add ``RecomputeStages`` to their features when ``on``."""
  original = build_lib.features_for
  if on:
    build_lib.features_for = lambda config, clip_norm=None: [*original(config, clip_norm),
                                                             RecomputeStages()]
  try:
    yield
  finally:
    build_lib.features_for = original


class SplitStages(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(WIDTH)(x)
    for i in range(2):
      with epl.split(MODEL, name=f"stage_{i}"):
        for _ in range(2):
          h = h + nn.Dense(WIDTH)(nn.gelu(nn.Dense(HIDDEN)(nn.LayerNorm()(h))))
    return nn.Dense(10)(h)


def trainer_for(recompute: bool, batch: dict, config: dict):
  epl.init({"pipeline.num_micro_batch": MICRO, **config})
  model = SplitStages()

  def loss_fn(variables, b):
    logits = model.apply(variables, b["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

  with recomputed(recompute):
    trainer = epl.Trainer(lambda key, b: model.init(key, b["x"]), loss_fn, optax.sgd(1e-3))
    state = trainer.init(jax.random.key(0), batch)
  return trainer, state


def stash_buffer(residuals: dict, text: str) -> str:
  """The buffer of the plan's largest residual slot as the compiled step holds it on a device:
  ``(slots, *shape)``, each dimension whole or split over ``model`` (GSPMD's choice)."""
  if not residuals:
    return "-"
  shape = max(residuals.values(), key=lambda t: t.nbytes).shape
  dims = ",".join(f"(?:{n}|{n // MODEL})" for n in shape)
  found = re.findall(rf"f32\[\d+,{dims}\]", text)   # and slices of one slot: the largest
  return max(found, key=lambda s: math.prod(map(int, s[4:-1].split(","))), default="?")


def measure(pairs: int) -> str:
  rng = jax.random.key(1)
  batch = {"x": jax.random.normal(rng, (ROWS, 32)),
           "y": jax.random.randint(rng, (ROWS,), 0, 10)}
  rows, runs = [], {}
  for name, recompute, config in CASES:
    trainer, state = trainer_for(recompute, batch, config)
    compiled = trainer.lower(state, batch).compile()
    text = compiled.as_text()
    found = hlo.summarize(trainer.plan.pipeline.executed_collectives(text))
    rows.append([name, f"{compiled.cost_analysis()['flops'] / 1e6:.1f}",
                 f"{compiled.memory_analysis().temp_size_in_bytes / 2**20:.2f}",
                 ", ".join(f"{k} {n} x / {b / 2**20:.2f} MiB" for k, (n, b) in
                           sorted(found.items())),
                 stash_buffer(trainer.plan.pipeline.loop.buffers.residuals, text)])
    box = {"state": state, "batch": trainer.shard_batch(batch)}

    def step(trainer=trainer, box=box):
      box["state"], metrics = trainer.train_step(box["state"], box["batch"])
      return metrics["loss"]

    runs[name] = step
  for row in rows:
    if row[0] == "inputs":
      row.append("1.00")
      continue
    timing = paired_ratio(runs[row[0]], runs["inputs"], pairs=pairs)
    row.append(f"**{timing['ratio']:.2f}** ({timing['ratio_q1']:.2f}-{timing['ratio_q3']:.2f})")
  return table(["stash", "MFLOPs", "temp MiB", "collectives per step", "largest stash buffer",
                "step time vs inputs"], rows)


def zoo_table(rows: int = 64) -> str:
  from models import ZOO

  from epljax.pipeline import packing
  out = []
  for model in (m for m in ZOO.values() if m.stage_splits):
    batch = model.make_batch(rows)
    for name, recompute, config in CASES:
      epl.init({"pipeline.num_stages": 2, "pipeline.num_micro_batch": 2, **config})
      epl.annotate(model.stage_split_rules(2))
      with recomputed(recompute):
        trainer = epl.Trainer(model.init_fn, model.loss_fn, optax.sgd(0.1))
        state = trainer.init(jax.random.key(0), batch)
      compiled = trainer.lower(state, batch).compile()
      buffers = trainer.plan.pipeline.loop.buffers
      per_slot = packing.nbytes(buffers.residuals) + (
          packing.nbytes(buffers.payload) if buffers.keep_inputs else 0)
      gathers = [c for c in hlo.collectives(compiled.as_text()) if c.kind == "all-gather"]
      out.append([model.name, name, f"{compiled.memory_analysis().temp_size_in_bytes / 1024:.0f}",
                  f"{compiled.cost_analysis()['flops'] / 1e6:.2f}", f"{per_slot / 1024:.1f}",
                  len(gathers)])
  return table(["model", "stash", "temp KiB", "MFLOPs", "stash KiB per slot", "all-gathers"],
               out)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--pairs", type=int, default=20)
  parser.add_argument("--zoo", action="store_true")
  parser.add_argument("--record", action="store_true")
  args = parser.parse_args(argv)
  body = zoo_table() if args.zoo else measure(args.pairs)
  print(f"{machine()}\n\n{body}")
  if args.record:
    doc = __doc__.split("\n\n")
    text = doc[-1] if args.zoo else "\n\n".join(doc[2:-1])
    record("Split pipeline stages on the zoo: residuals in slots vs inputs "
           "(bench/pipeline.py stash --zoo)" if args.zoo else
           "Split pipeline stages: residuals in slots vs inputs (bench/pipeline.py stash)",
           text.strip() + "\n\n" + body, argv)
