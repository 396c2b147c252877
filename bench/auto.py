"""The plan search (``auto.auto_parallel`` without ``pipeline.num_stages``) on the model zoo.

    python bench/auto.py                  # GPT-2 and Llama of tests/models, 8 CPU devices
    python bench/auto.py --record         # and replace their section in bench/RESULTS.md
    python bench/auto.py --models gpt2 vit --limit 600000
    python bench/auto.py --time 30        # on a GPU: time the 5 fastest-predicted candidates
    JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python bench/auto.py --gpus 1x2x4
                                          # compile-only H100s, 2 hosts of 4 (gpu_aot.py)

For each model: how long the search took, how many steps it compiled (XLA compiles of the
step, counted from jax's compile log), the chosen plan, its estimated bytes beside the compiled
``memory_analysis()``, and every candidate's predicted compute / communication / bubble / step
time with why it lost. On CPU the chip figures are nominal: the times rank plans, they predict
nothing about a GPU. ``--gpus`` searches for compile-only H100s (the plan XLA:GPU's programs
give; nothing runs); ``--time`` trains each of the 5 fastest-predicted candidates that fit and
reports their measured step times beside the prediction.
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS") or "--xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(__file__))
# This checkout's epljax, not an installed one (a worktree beside an editable install).
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import logging  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402

import numpy as np  # noqa: E402

import epljax as epl  # noqa: E402
from common import StepCompiles, record, table  # noqa: E402
from epljax.errors import size  # noqa: E402
from epljax.plan import search_rows  # noqa: E402
from models import ZOO  # noqa: E402

ROWS = 16


def search(name: str, limit: int, rows: int = ROWS,
           compile_only: bool = False) -> tuple[epl.Trainer, float, int]:
  model = ZOO[name]
  epl.init({"auto.auto_parallel": True, "auto.memory_limit": limit})
  rules = (nn.logical_axis_rules(model.logical_rules) if model.logical_rules
           else contextlib.nullcontext())
  handler = StepCompiles()
  logger = logging.getLogger("jax")
  logger.addHandler(handler)
  start = time.perf_counter()
  try:
    with rules, jax.log_compiles():
      trainer = epl.Trainer(model.init_fn, model.loss_fn, optax.adamw(1e-3))
      if compile_only:   # plan and compile; no state on devices that cannot run
        trainer._build(jax.random.key(0), model.make_batch(rows))
      else:
        trainer.init(jax.random.key(0), model.make_batch(rows))
  finally:
    logger.removeHandler(handler)
  return trainer, time.perf_counter() - start, handler.steps


def timed(name: str, candidates, rows: int, steps: int) -> list[list[object]]:
  """Each candidate trained for ``steps`` steps after 3 warm-ups: its median step time next to
  the predicted one; the fastest measured marked."""
  model = ZOO[name]
  batch = model.make_batch(rows)
  out = []
  for row in candidates:
    epl.init(row.overrides)
    split = row.mesh_shape.get("model", 1)
    if split > 1 and row.split == "all":   # the candidate's split, as a user would write it
      epl.set_default_strategy(epl.split(split))
    elif split > 1 and row.split:
      epl.annotate({re.escape(row.split): epl.split(split)})
    rules = (nn.logical_axis_rules(model.logical_rules) if model.logical_rules
             else contextlib.nullcontext())
    try:
      with rules:
        trainer = epl.Trainer(model.init_fn, model.loss_fn, optax.adamw(1e-3))
        state = trainer.init(jax.random.key(0), batch)
        sharded = trainer.shard_batch(batch)
        seconds = []
        for i in range(3 + steps):
          start = time.perf_counter()
          state, metrics = trainer.train_step(state, sharded)
          jax.block_until_ready(metrics["loss"])
          if i >= 3:
            seconds.append(time.perf_counter() - start)
      measured = float(np.median(seconds))
    except Exception as e:  # noqa: BLE001 (the table says which candidate fails and why)
      measured, why = float("nan"), f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
    else:
      why = ""
    out.append([row, measured, why])
  fastest = min((m for _, m, _ in out if m == m), default=float("nan"))
  return [["**chosen**" if r.chosen else "", " x ".join(f"{a}={n}" for a, n in
                                                      r.mesh_shape.items()),
           ", ".join(f"{k}={v!r}" for k, v in r.features.items() if v not in ("", 1)) or "-",
           f"{r.predicted_step_s * 1e3:.3f}", f"{m * 1e3:.3f}", f"{m / fastest:.3f}", why]
          for r, m, why in out]


def rows_of(trainer) -> list[list[object]]:
  """``trainer.plan.search`` as the plan prints it, the chosen row marked in bold."""
  return [["**chosen**" if row[0] else "", *row[1:]]
          for row in search_rows(trainer.plan.search)]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", default=["gpt2", "llama"], choices=sorted(ZOO))
  parser.add_argument("--limit", type=int, default=0, help="auto.memory_limit (0: device's)")
  parser.add_argument("--rows", type=int, default=ROWS, help="global batch rows")
  parser.add_argument("--gpus", default="", help="search for compile-only H100s of this "
                      "topology (slices x hosts x GPUs per host, e.g. 1x1x8); nothing runs")
  parser.add_argument("--time", type=int, default=0, metavar="STEPS",
                      help="train the 5 fastest-predicted candidates that fit, STEPS steps each")
  parser.add_argument("--record", action="store_true")
  args = parser.parse_args(argv)
  if args.gpus:
    from gpu_aot import as_devices, h100s
    gpus = h100s(args.gpus)
  summary, details, times = [], [], []
  for name in args.models:
    with as_devices(gpus) if args.gpus else contextlib.nullcontext():
      trainer, seconds, compiles = search(name, args.limit, args.rows, bool(args.gpus))
    best = trainer.plan.search[0]
    summary.append([name, f"{seconds:.1f}", compiles, sum(r.compiled for r in trainer.plan.search),
                    len(trainer.plan.search), " x ".join(
                        f"{a}={n}" for a, n in best.mesh_shape.items()),
                    size(best.estimate.bytes_per_device), size(best.bytes_per_device),
                    f"{best.estimate.bytes_per_device / best.bytes_per_device:.2f}"])
    body = table(["", "mesh", "features", "estimated bytes", "compiled bytes", "compute ms",
                  "comm ms", "bubble ms", "step ms", "why not"], rows_of(trainer))
    details.append(f"### {name}\n\n" + "\n".join(
        f"- {n}" for n in trainer.plan.search_notes) + "\n\n" + body)
    print(f"\n{name}\n" + "\n".join(trainer.plan.search_notes) + "\n" + body)
    if args.time:
      limit = args.limit or float("inf")
      fits = [r for r in trainer.plan.search if not r.refused and r.bytes_per_device <= limit]
      top = sorted(fits, key=lambda r: r.predicted_step_s)[:5]
      measured = table(["", "mesh", "features", "predicted ms", "measured ms", "/ fastest",
                        "failed"], timed(name, top, args.rows, args.time))
      times.append(f"### {name}, the 5 fastest-predicted candidates timed\n\n{measured}")
      print(f"\n{name}: measured\n{measured}")
  head = table(["model", "search s", "step compiles (XLA log)", "rows compiled", "candidates",
                "chosen mesh", "estimated bytes", "compiled bytes", "estimate / compiled"],
               summary)
  print("\n" + head)
  where = (f"{args.gpus} compile-only H100s (gpu_aot.py); " if args.gpus else "")
  if args.record:
    record("Automatic plans (bench/auto.py)", head + "\n\n" + (
        f"{where}Global batch {args.rows} rows, adamw, auto.memory_limit={args.limit} (0: the "
        "device's). "
        "Search s: trainer.init wall time, compiles included. Step compiles: XLA compiles of "
        "the step during the search (jax's compile log); the chosen plan's train_step compiles "
        "once more. Estimated bytes: the pre-compile estimate of the chosen plan, used only to "
        "prune and order candidates. CPU chip figures are nominal: times rank, they do not "
        "predict.\n\n") + "\n\n".join(details + times), argv,
        used=gpus if args.gpus else None)


if __name__ == "__main__":
  main()
