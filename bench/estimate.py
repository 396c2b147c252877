"""The plan search's estimates against the compiled steps, row by row, on held-out models and
the zoo.

    python bench/estimate.py                          # every model, 8 CPU devices (XLA:CPU)
    python bench/estimate.py --models bert gpt2 --max-rows 6
    JAX_PLATFORMS=cpu python bench/estimate.py --gpu  # 8 compile-only H100s (XLA:GPU)
    python bench/estimate.py --record                 # replace its section in bench/RESULTS.md

For each model (``heldout`` first: nothing in epljax was tuned on them; then ``tests/models``)
the automatic search's candidates are made as ``auto.auto_parallel`` makes them
(``candidates.space``), and every row (or ``--max-rows`` of them, spread over the meshes and
features) is compiled, as the search compiles the rows it chooses (``search.compile_row``).
Per row: the estimate made before any compile against the compiled step, for the bytes per
device (``memory_analysis()``: arguments + outputs - aliased + temp), the FLOPs
(``cost_analysis()``, loop bodies per iteration; a pipeline's from its schedule) and the
collective bytes per device (the HLO's, loop bodies times their trips). Summaries per model and
overall: the share of rows within 10% and 20% (bytes, collectives) or 5% (FLOPs), the worst
ratio. Refused rows (a feature the model refuses) are listed, not counted.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS") or "--xla_force_host_platform_device_count=8"
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.join(HERE, ".."))   # this checkout's epljax
sys.path.insert(2, os.path.join(HERE, "..", "tests"))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402

import epljax as epl  # noqa: E402
from common import record, table  # noqa: E402
from epljax import build as build_lib  # noqa: E402
from epljax import candidates, chips  # noqa: E402
from epljax import search as search_lib  # noqa: E402
from epljax.errors import PlanError  # noqa: E402
from heldout import HELDOUT  # noqa: E402
from models import ZOO  # noqa: E402

ROWS = 16   # global batch rows


@dataclasses.dataclass(frozen=True)
class Model:
  name: str
  init_fn: Callable
  loss_fn: Callable
  make_batch: Callable
  rules: tuple | None   # Flax logical axis rules, if the model names its axes
  heldout: bool


MODELS = {**{n: Model(n, m.init_fn, m.loss_fn, m.make_batch, None, True)
             for n, m in HELDOUT.items()},
          **{n: Model(n, m.init_fn, m.loss_fn, m.make_batch, m.logical_rules, False)
             for n, m in ZOO.items() if n != "gpt2_fused_t"}}   # (gpt2_fused's, transposed)


@dataclasses.dataclass(frozen=True)
class Measured:
  """One row: its estimate (made before any compile) and its compiled step (None: refused)."""
  row: candidates.Candidate
  compiled: Any          # cost.StepCost of the compiled step, or None
  refused: str = ""
  compile_s: float = 0.0


def spread(rows: list, limit: int | None) -> list:
  """At most ``limit`` rows, spread over the meshes (and splits, stages) first, then over the
  features: round-robin over the groups of one mesh, each group's rows in a shuffled order
  so that the first picks differ in their features. Neither order depends on the estimates:
  the same rows are picked whatever the estimator says (a before / after comparison)."""
  if not limit or limit >= len(rows):
    return rows
  groups: dict[tuple, list] = {}
  for r in sorted(rows, key=lambda r: sorted((k, str(v)) for k, v in r.features.items())):
    groups.setdefault((r.stages, r.mesh_shape.get("model", 1), r.split,
                       tuple(sorted(r.mesh_shape.items()))), []).append(r)
  groups = dict(sorted(groups.items()))
  for g in groups.values():
    random.Random(0).shuffle(g)
  out, i = [], 0
  while len(out) < limit:
    for g in groups.values():
      if i < len(g) and len(out) < limit:
        out.append(g[i])
    i += 1
  return out


def measure(model: Model, devices, max_rows: int | None, rows: int = ROWS
            ) -> tuple[list[Measured], float, int]:
  """Every (or ``max_rows``) candidate of ``model``'s search compiled: (rows, seconds the
  candidates took to make, candidates)."""
  env = epl.init({"auto.auto_parallel": True}, devices=devices) if devices else epl.init(
      {"auto.auto_parallel": True})
  trainer = epl.Trainer(model.init_fn, model.loss_fn, optax.adamw(1e-3))
  fns = build_lib.UserFns(trainer.init_fn, trainer.loss_fn, trainer.optimizer,
                          trainer.has_aux, trainer.mutable, trainer.clip_norm)
  rules = nn.logical_axis_rules(model.rules) if model.rules else contextlib.nullcontext()
  batch = model.make_batch(rows)
  chip = chips.agreed(chips.chip_of(env.cluster.devices, env.config.auto))
  out = []
  with rules:
    start = time.perf_counter()
    found = candidates.space(fns, env.config, env.cluster, jax.random.key(0), batch,
                             candidates.Builders(build_lib.build, build_lib.pipeline_plan), chip)
    made = time.perf_counter() - start
    for row in spread(found.rows, max_rows):
      start = time.perf_counter()
      try:
        _, step = search_lib.compile_row(found.bases, found.make, chip, row)
      except PlanError as e:
        out.append(Measured(row, None, str(e).splitlines()[0]))
        continue
      out.append(Measured(row, step, "", time.perf_counter() - start))
  return out, made, len(found.rows)


def ratio(estimated: float, compiled: float) -> float:
  if not compiled:
    return 1.0 if not estimated else float("inf")
  return estimated / compiled


def ratios(m: Measured) -> tuple[float, float, float]:
  """(bytes, FLOPs, collective bytes) estimated / compiled."""
  est, got = m.row.estimate, m.compiled
  return (ratio(est.bytes_per_device, got.bytes_per_device), ratio(est.flops, got.flops),
          ratio(sum(est.collective_bytes.values()), sum(got.collective_bytes.values())))


def within(values: list[float], share: float) -> str:
  return f"{sum(abs(v - 1) <= share for v in values)}/{len(values)}"


def worst(values: list[float]) -> str:
  if not values:
    return "-"
  v = max(values, key=lambda v: abs(v - 1) if v != float("inf") else float("inf"))
  return f"{v:.2f}"


def summary_row(name: str, measured: list[Measured]) -> list[str]:
  done = [ratios(m) for m in measured if m.compiled is not None]
  b, f, c = ([r[i] for r in done] for i in range(3))
  return [name, str(len(done)), within(b, 0.1), within(b, 0.2), worst(b), within(f, 0.05),
          worst(f), within(c, 0.1), worst(c)]


SUMMARY = ["model", "rows", "bytes within 10%", "within 20%", "worst", "FLOPs within 5%",
           "worst", "collectives within 10%", "worst"]


def mesh_text(shape: dict[str, int]) -> str:
  return " x ".join(f"{a}={n}" for a, n in shape.items() if n > 1 or a == "data")


def features_text(f: dict[str, Any]) -> str:
  out = [f"micro {f['num_micro_batch']}"]
  out += [f"zero {f['zero_level']}" + (" HSDP" if f.get("zero_shard") else "")
          ] if f["zero_level"] else []
  out += ["gc"] if f["gradient_checkpoint"] else []
  out += [f"offload {f['offload']}"] if f["offload"] else []
  return ", ".join(out)


def detail_rows(measured: list[Measured]) -> list[list[str]]:
  out = []
  for m in measured:
    r, est = m.row, m.row.estimate
    head = [mesh_text(r.mesh_shape) + (f" ({r.split})" if r.split else ""),
            features_text(r.features)]
    if m.compiled is None:
      out.append(head + ["refused: " + m.refused[:60]] + [""] * 6)
      continue
    b, f, c = ratios(m)
    got = m.compiled
    out.append(head + [f"{est.bytes_per_device / 1e6:.3f}", f"{got.bytes_per_device / 1e6:.3f}",
                       f"{b:.2f}", f"{f:.2f}",
                       f"{sum(est.collective_bytes.values()) / 1e6:.3f}",
                       f"{sum(got.collective_bytes.values()) / 1e6:.3f}", f"{c:.2f}"])
  return out


DETAIL = ["mesh", "features", "est. MB", "compiled MB", "bytes", "FLOPs", "est. coll. MB",
          "compiled coll. MB", "coll."]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
  parser.add_argument("--max-rows", type=int, default=0,
                      help="compile at most this many rows per model (0: all)")
  parser.add_argument("--gpu", action="store_true", help="8 compile-only H100s (XLA:GPU)")
  parser.add_argument("--record", action="store_true")
  args = parser.parse_args(argv)
  devices = None
  if args.gpu:
    from gpu_aot import h100s
    devices = h100s("1x1x8")
  compiler = "8 compile-only H100s" if args.gpu else "XLA:CPU, 8 CPU devices"
  start = time.perf_counter()
  summaries, details, everything, timing = [], [], [], []
  # A run stopped (SIGTERM, Ctrl-C) still prints and records the models it measured.
  signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
  try:
    for name in args.models:
      model_start = time.perf_counter()
      measured, made, total = measure(MODELS[name], devices, args.max_rows or None)
      seconds = time.perf_counter() - model_start
      everything += measured
      summaries.append(summary_row(name + (" (held out)" if MODELS[name].heldout else ""),
                                   measured))
      timing.append(f"{name}: {len(measured)} of {total} rows, {seconds:.0f} s "
                    f"(candidates made in {made:.0f} s)")
      body = table(DETAIL, detail_rows(measured))
      details.append(f"### {name}\n\n{body}")
      print(f"\n{name} ({timing[-1]})\n{body}", flush=True)
  except KeyboardInterrupt:
    print("stopped: recording the models measured so far")
  finally:
    if details:
      write(args, argv, compiler, devices, summaries, everything, details, timing, start,
            len(details) < len(args.models))


def write(args, argv, compiler, devices, summaries, everything, details, timing, start,
          partial: bool) -> None:
  """Prints the summary and, with ``--record``, records the run so far."""
  head = table(SUMMARY, [*summaries, summary_row("all", everything)])
  total_s = time.perf_counter() - start
  print(f"\n{compiler}: {total_s:.0f} s\n{head}")
  if args.record:
    record("Estimates against compiled steps (bench/estimate.py)", head + "\n\n" + (
               f"{compiler}; global batch {ROWS} rows, adamw; "
               + (f"partial: {len(details)} of {len(args.models)} models measured; "
                  if partial else "")
               + ("every row of each search" if not args.max_rows else
                  f"at most {args.max_rows} rows of each search, spread over its meshes")
               + ". Ratios are estimated / compiled per row: bytes per device "
               "(memory_analysis), FLOPs (cost_analysis, loop bodies per iteration) and "
               "collective bytes per device (the HLO's). 'worst': the ratio furthest from 1. "
               f"Run time {total_s:.0f} s on the shared 2-core VM: "
               + "; ".join(timing) + ".\n\n") + "\n\n".join(details), argv, used=devices)


if __name__ == "__main__":
  main()
