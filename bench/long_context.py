"""Long sequences on compile-only H100s: Llama-3-8B at 32k and 128k tokens per row under
``context.parallel_degree``, against the same model at 1/k of the sequence without it and
against a hand-written ``shard_map`` ring (``ring_llama.py``).

    JAX_PLATFORMS=cpu python bench/long_context.py                       # every cell
    JAX_PLATFORMS=cpu python bench/long_context.py --cells 32768:8:8     # tokens:H100s:k
    JAX_PLATFORMS=cpu python bench/long_context.py --cells 32768:8:8 --layers 2   # quick check
    JAX_PLATFORMS=cpu python bench/long_context.py --record              # bench/RESULTS.md

(the jax with its CUDA plugin, ``gpu_aot.py``). The zoo's Llama-3-8B (bfloat16 compute over
float32 weights, each layer rematerialized, AdamW) with ``attention="epl"``, planned by epljax
with ``zero.level: v3`` and ``context.parallel_degree: k`` for ``H100s / k`` rows of ``tokens``
(data x context). Each cell compiles three steps:

- epljax with context k: bytes per device (``memory_analysis()``: arguments + outputs - aliased
  + temp), collective bytes per step per device by kind and mesh axis (``epljax.hlo``), and how
  many of the async collective-permutes and all-gathers (the key/value exchange) have compute
  scheduled between their start and done in the compiled HLO (overlap), and how many XLA left
  synchronous (no overlap possible).
- epljax without context parallelism at ``tokens / k`` per row, ``H100s`` rows (the same tokens
  per device): the ratio of bytes per device says whether activations split k ways.
- the hand ring (``ring_llama.ring``): bytes and collective bytes, and epljax's ratios to them.
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import epljax as epl  # noqa: E402
import hand_layouts  # noqa: E402
import ring_llama  # noqa: E402
from epljax import hlo  # noqa: E402
from epljax.mesh import hosts  # noqa: E402
from hand_layouts import Figures  # noqa: E402

HOST = 8                         # H100s per host
FITS = 80 * 2**30                # an H100's 80 GiB (79.1 GiB usable, chips.py)
CELLS = ("32768:8:8", "131072:8:8", "32768:16:8", "131072:16:8")
COMPUTE = re.compile(r"\s(fusion|custom-call|dot|convolution)\(")
ASYNC = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=.*?\s"
                   r"(?P<op>collective-permute|all-gather)-start\(", re.M)
SYNC = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=.*?\s(?P<op>collective-permute|all-gather)\(",
                  re.M)


def optimizer():
  return optax.adamw(1e-4, weight_decay=0.1)


def size_of(layers: int | None):
  from example_models import llama

  size = dataclasses.replace(llama.SIZES["8b"], attention="epl")
  return dataclasses.replace(size, layers=layers) if layers else size


def batch(rows: int, tokens: int) -> dict:
  ids = jax.ShapeDtypeStruct((rows, tokens), jnp.int32)
  return {"x": ids, "y": ids}


def overlap(hlo_text: str) -> dict[str, tuple[int, int, int]]:
  """Per kind (collective-permute, all-gather): (async starts with compute scheduled before
  their done, async starts, synchronous instructions), instructions of the compiled HLO
  (a loop body's once). The compiled module is scheduled: each computation's instructions in
  execution order."""
  found: dict[str, list[int]] = {}
  for m in SYNC.finditer(hlo_text):
    found.setdefault(m.group("op"), [0, 0, 0])[2] += 1
  for body in re.split(r"\n\}\n", hlo_text):
    lines = body.splitlines()
    for i, line in enumerate(lines):
      m = ASYNC.match(line)
      if not m:
        continue
      done = next((j for j in range(i + 1, len(lines))
                   if f"-done(%{m.group('name')})" in lines[j]
                   or f"-done({m.group('name')})" in lines[j]), None)
      between = lines[i + 1:done] if done is not None else []
      counts = found.setdefault(m.group("op"), [0, 0, 0])
      counts[0] += any(COMPUTE.search(x) for x in between)
      counts[1] += 1
  return {k: tuple(v) for k, v in found.items()}


def by_axis(compiled, mesh) -> str:
  """Collective GiB per step per device by kind and the mesh axes it runs over."""
  n = mesh.devices.size
  out: dict[str, int] = {}
  for c in hlo.executed_collectives(compiled.as_text()):
    groups = c.connected() if c.kind == "collective-permute" else c.device_groups(n)
    axes, _, across = hosts.describe(groups or [], mesh)
    key = f"{c.kind} over {axes}{' (across hosts)' if across else ''}"
    out[key] = out.get(key, 0) + c.bytes
  return ", ".join(f"{k} {b / 2**30:.2f}" for k, b in sorted(out.items(), key=lambda kv: -kv[1])
                   if b >= 2**20)


def compile_epl(size, rows: int, tokens: int, devices: list, context: int):
  from example_models import llama

  init_fn, loss_fn = llama.fns(size)
  config = {"zero.level": "v3"}
  if context > 1:
    config["context.parallel_degree"] = context
  epl.init(config, devices=devices)
  trainer = epl.Trainer(init_fn, loss_fn, optimizer())
  built = trainer._build(jax.random.key(0), batch(rows, tokens))
  start = time.perf_counter()
  compiled = built.plan.compiled
  return Figures.of(compiled, time.perf_counter() - start), compiled, built.plan


def gib(n: int) -> str:
  return f"{n / 2**30:.2f}"


def cell(tokens: int, n: int, k: int, layers: int | None) -> tuple[list, list[str]]:
  """One table row and its detail lines (the model's Flax logical axis rules in effect, as a
  MaxText user gives them)."""
  from example_models import llama

  with nn.logical_axis_rules(llama.LOGICAL_RULES):
    return _cell(tokens, n, k, layers)


def _cell(tokens: int, n: int, k: int, layers: int | None) -> tuple[list, list[str]]:
  from example_models import llama

  size = size_of(layers)
  devices = epl.topology("h100", hosts=max(1, n // HOST), per_host=min(n, HOST))
  rows = n // k
  ours, compiled, plan = compile_epl(size, rows, tokens, devices, k)
  seen = overlap(compiled.as_text())
  axes = by_axis(compiled, plan.mesh)
  base, base_compiled, _ = compile_epl(size, n, tokens // k, devices, 1)
  variables = hand_layouts.abstract_params(llama.fns(size)[0], batch(rows, tokens))
  hand, hand_compiled, hand_mesh = ring_llama.ring(size, optimizer(), variables,
                                                   batch(rows, tokens), devices, k)
  hand_axes = by_axis(hand_compiled, hand_mesh)
  hand_seen = overlap(hand_compiled.as_text())
  mesh = " x ".join(f"{a}={s}" for a, s in plan.mesh.shape.items() if s > 1)
  ratio = lambda a, b: f"{a / b:.3f}" if b else "-"  # noqa: E731
  shown = lambda d: ", ".join(f"{k} {a}/{b} async, {c} sync"  # noqa: E731
                              for k, (a, b, c) in sorted(d.items())) or "none"
  row = [f"{tokens // 1024}k", f"{n} ({max(1, n // HOST)} host{'s' * (n > HOST)})", k, mesh,
         rows, gib(ours.bytes_per_device), gib(base.bytes_per_device),
         ratio(ours.bytes_per_device, base.bytes_per_device), gib(hand.bytes_per_device),
         ratio(ours.bytes_per_device, hand.bytes_per_device), gib(ours.collective_bytes),
         gib(hand.collective_bytes), ratio(ours.collective_bytes, hand.collective_bytes),
         shown(seen), "yes" if ours.bytes_per_device <= FITS else "no",
         f"{ours.compile_s:.0f}/{base.compile_s:.0f}/{hand.compile_s:.0f}"]
  where = f"{tokens // 1024}k on {n}, k={k}"
  temp = lambda c: gib(c.memory_analysis().temp_size_in_bytes)  # noqa: E731
  state = lambda c: gib(c.memory_analysis().argument_size_in_bytes)  # noqa: E731
  details = [f"- {where} epljax: {axes}", f"- {where} hand ring: {hand_axes}; overlapped "
             f"{shown(hand_seen)}",
             f"- {where} GiB arguments (state, batch) / temp: epljax {state(compiled)} / "
             f"{temp(compiled)}, 1/k seq no context {state(base_compiled)} / "
             f"{temp(base_compiled)}, hand ring {state(hand_compiled)} / {temp(hand_compiled)}"]
  return row, details


HEADERS = ["tokens/row", "H100s", "k", "epljax mesh", "rows", "GiB/device epljax",
           "1/k seq, no context", "ratio", "hand ring", "ratio", "collective GiB epljax",
           "hand ring", "ratio", "overlapped/async, sync", "fits 80 GiB", "compile s"]


def main(argv=None):
  from common import record, table
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cells", nargs="+", default=list(CELLS), metavar="TOKENS:H100S:K")
  parser.add_argument("--layers", type=int, help="compile this many layers (a quick check)")
  parser.add_argument("--record", action="store_true")
  args = parser.parse_args(argv)
  rows, details = [], []
  for spec in args.cells:
    tokens, n, k = (int(x) for x in spec.split(":"))
    start = time.perf_counter()
    try:
      row, more = cell(tokens, n, k, args.layers)
    except Exception as e:  # noqa: BLE001 (the table says which cell fails and why)
      row, more = [f"{tokens // 1024}k", n, k, f"{type(e).__name__}: {str(e)[:200]}"] + [
          ""] * (len(HEADERS) - 4), []
    rows.append(row)
    details += more
    print(table(HEADERS, [row]), *more, f"({time.perf_counter() - start:.0f} s)", sep="\n",
          flush=True)
  body = (table(HEADERS, rows) + "\n\nCollective GiB per step per device by kind and mesh "
          "axis ('?': device pairs along no one mesh axis, the zig-zag moves), and bytes per "
          "device split into arguments and temp:"
          "\n\n" + "\n".join(details))
  print(f"\n{body}")
  if args.record and not args.layers:
    record("Long sequences on compile-only H100s (bench/long_context.py)",
           body + (
               "\n\nLlama-3-8B (32 layers, attention='epl'), AdamW, bfloat16 compute over "
               "float32 weights, every layer rematerialized; epljax: zero.level v3 + "
               "context.parallel_degree k, H100s/k rows. GiB/device: memory_analysis() "
               "arguments + outputs - aliased + temp. '1/k seq, no context': epljax, zero v3, "
               "tokens/k per row, H100s rows (the same tokens per device). Hand ring: "
               "bench/ring_llama.py (FSDP over every device, batch pre-ordered zig-zag as "
               "Megatron's loader does, ppermute ring). Overlapped/async, sync: of the "
               "collective-permute / all-gather instructions of the compiled HLO (a loop body's "
               "once), the async starts with a fusion or custom-call scheduled before their done"
               ", the async starts, and the synchronous ones. "
               "Compile s: epljax / no context / hand, XLA:GPU on a shared 2-core VM."),
           argv, "compile-only H100s")


if __name__ == "__main__":
  main()
