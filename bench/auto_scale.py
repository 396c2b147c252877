"""The plan search at real sizes on compile-only H100s: what ``auto.auto_parallel`` chooses.

    JAX_PLATFORMS=cpu python bench/auto_scale.py                     # every cell
    JAX_PLATFORMS=cpu python bench/auto_scale.py --cells 7b:16:16 8b:64:64
    JAX_PLATFORMS=cpu python bench/auto_scale.py ... --record        # into bench/RESULTS.md

(the jax with its CUDA plugin, ``epl.topology``). Cells ``SIZE:H100S:ROWS``: the zoo's Llama
(``tests/models/llama``: ``nn.scan`` layers, bfloat16 compute over float32 weights, each layer
rematerialized, AdamW) at its 8B and 70B presets on 8, 16 and 64 H100s (8 per host), one row of
2048 tokens per device, and Llama-2-7B on 16 H100s with 16 rows of 2048 tokens (the issue's
case). Each search is ``trainer._build`` with ``auto.auto_parallel`` (at most
``search.MAX_COMPILES`` compiles), timed. Printed per cell: the chosen row, the fastest
predicted rows of each kind (FSDP, HSDP, tensor x data with ZeRO v1, tensor x pipeline x data),
and whether a chosen pipeline across hosts has a bubble over a quarter of its step while an
unpipelined plan that fits is predicted faster (the issue's bar: must be "no").
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))   # (this checkout's epljax)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import epljax as epl  # noqa: E402
from epljax.errors import PlanError, size  # noqa: E402

SIZES = {"7b": ("8b", (("vocab", 32000), ("kv_heads", 32), ("mlp", 11008))),
         "8b": ("8b", ()), "70b": ("70b", ())}
CELLS = ["7b:16:16", "8b:8:8", "8b:16:16", "8b:64:64", "70b:8:8", "70b:16:16", "70b:64:64"]
LENGTH = 2048


class _Compiles(logging.Handler):
  def __init__(self):
    super().__init__()
    self.steps = 0

  def emit(self, rec):
    text = rec.getMessage()
    if "Finished XLA compilation" in text and "epl_step" in text:
      self.steps += 1


def kind(row) -> str:
  """FSDP, HSDP, TPk x data, TPk x PPs x data, ... (ZeRO level beside)."""
  f, m, s = row.features, row.mesh_shape.get("model", 1), row.stages
  zero = f["zero_level"]
  if s > 1:
    name = (f"TP{m} x " if m > 1 else "") + f"PP{s} x data"
  elif m > 1:
    name = f"TP{m} x data"
  elif zero == "v3":
    name = "HSDP" if f.get("zero_shard") else "FSDP"
  else:
    name = "data"
  return name + (f" (ZeRO {zero}{' in a host' if f.get('zero_shard') else ''})"
                 if zero and name not in ("FSDP", "HSDP") else "")


def search(cell: str):
  name, n, rows = cell.split(":")
  n, rows = int(n), int(rows)
  from models import llama
  preset, changes = SIZES[name]
  model = dataclasses.replace(llama.SIZES[preset], **dict(changes))
  init_fn, loss_fn = llama.fns(model)
  ids = jax.ShapeDtypeStruct((rows, LENGTH), jnp.int32)
  epl.init({"auto.auto_parallel": True}, devices=epl.topology("h100", hosts=n // 8, per_host=8))
  handler, logger = _Compiles(), logging.getLogger("jax")
  logger.addHandler(handler)
  start = time.perf_counter()
  try:
    with nn.logical_axis_rules(llama.LOGICAL_RULES), jax.log_compiles():
      trainer = epl.Trainer(init_fn, loss_fn, optax.adamw(1e-4, weight_decay=0.1))
      try:
        trainer._build(jax.random.key(0), {"x": ids, "y": ids})
        error = ""
      except PlanError as e:
        error = str(e).splitlines()[0]
  finally:
    logger.removeHandler(handler)
  return trainer, error, time.perf_counter() - start, handler.steps, n, rows


def ms(s: float) -> str:
  return f"{s * 1e3:.0f}"


def describe(row) -> list[str]:
  mesh = " x ".join(f"{a}={k}" for a, k in row.mesh_shape.items() if k > 1) or "data=1"
  f = row.features
  feats = ", ".join([f"micro {f['num_micro_batch']}"]
                    + ([f"zero {f['zero_level']}" + (" host" if f.get("zero_shard") else "")]
                       if f["zero_level"] else [])
                    + (["gc auto"] if f["gradient_checkpoint"] else []))
  return [kind(row), mesh, feats, size(row.bytes_per_device)
          + ("" if row.compiled else " (est.)"), ms(row.compute_s), ms(row.communication_s),
          ms(row.bubble_s), ms(row.predicted_step_s)]


def cell_rows(cell: str, limit: int | None = None):
  trainer, error, seconds, compiles, n, rows = search(cell)
  where = (f"{cell.split(':')[0].upper()} on {n} H100s ({n // 8} host{'s' * (n > 8)}), "
           f"{rows} x {LENGTH}")
  if error:
    return [[where, "none fits", "", "", "", "", "", "", "", "", f"{seconds:.0f}", compiles,
             error[:160]]], []
  table_rows = trainer.plan.search
  best = table_rows[0]
  fits = [r for r in table_rows if not r.refused and r.bytes_per_device <= (
      limit or 80 << 30)]
  flat = [r for r in fits if r.stages == 1 and not r.skipped.startswith("not compiled: zero.")]
  bad = (best.stages > 1 and best.bubble_s > best.predicted_step_s / 4
         and any(r.predicted_step_s < best.predicted_step_s for r in flat))
  head = [[where, "chosen", *describe(best), f"{seconds:.0f}", compiles,
           "pipeline with bubble > 1/4 and a faster unpipelined plan: YES" if bad else ""]]
  seen, others = {kind(best)}, []
  for r in sorted(table_rows, key=lambda r: r.predicted_step_s):
    if kind(r) in seen or r.refused:
      continue
    seen.add(kind(r))
    others.append(["", "best of its kind", *describe(r), "", "", r.reason[:200]])
  return head + others, [f"{where}: " + "; ".join(trainer.plan.search_notes)]


HEADERS = ["search", "row", "layout", "mesh", "features", "bytes/device", "compute ms",
           "exposed comm ms", "bubble ms", "step ms", "search s", "compiles", "why not / check"]


def main(argv=None):
  from common import record, table
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cells", nargs="+", default=CELLS, metavar="SIZE:H100S:ROWS")
  parser.add_argument("--record", action="store_true")
  args = parser.parse_args(argv)
  out, notes = [], []
  for cell in args.cells:
    try:
      found, said = cell_rows(cell)
    except Exception as e:  # noqa: BLE001 (the table says which cell failed and why)
      found, said = [[cell, "failed", "", "", "", "", "", "", "", "", "", "",
                      f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"]], []
    out += found
    notes += said
    print(table(HEADERS, found), *said, sep="\n", flush=True)
  body = table(HEADERS, out) + "\n\n" + "\n".join(f"- {n}" for n in notes)
  print("\n" + body)
  if args.record:
    record("Automatic plans at real sizes (bench/auto_scale.py)", body + (
        "\n\nCompile-only H100s (XLA:GPU, jax with its CUDA plugin); nothing runs. Search s: "
        "trainer._build wall time on the shared 2-core VM, compiles included; compiles: XLA "
        "compiles of the step (jax's compile log). 'best of its kind': the fastest predicted row "
        "of each layout, with why it lost. HSDP rows are estimates (zero.shard_size is not in "
        "epljax yet)."), argv)


if __name__ == "__main__":
  main()
