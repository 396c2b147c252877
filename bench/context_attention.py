"""Context parallelism's two attention forms, ring and all-gather, side by side.

    JAX_PLATFORMS=cpu python bench/context_attention.py [--gpu] [--record]

A bfloat16 Llama (2 layers, d_model 512, 8 query heads of 64, rematerialized layers, AdamW),
its attention through ``epl.nn.dot_product_attention``, one row of ``--length`` tokens split
over ``context.parallel_degree=8`` on 8 devices (XLA:CPU, or with ``--gpu`` 8 compile-only
H100s, ``epl.topology``), with 8 key/value heads (multi-head) and with 2 (grouped-query). Each
form is forced in turn (``epljax.nn.context.choose_method``); each row: bytes per device
(``memory_analysis()``: arguments + outputs - aliased + temp) and collective bytes a device
executes per step (``epljax.hlo``), by kind. Nothing runs: the step is compiled only.
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS") or "--xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import argparse  # noqa: E402
import dataclasses  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import epljax as epl  # noqa: E402
from epljax.nn import context  # noqa: E402
from hand_layouts import Figures  # noqa: E402

HEADERS = ["devices", "kv heads", "form", "MiB/device", "collective MiB", "ratio to ring",
           "by kind (MiB)"]


def figures(kv_heads: int, method: str, length: int, devices) -> Figures:
  from example_models import llama

  size = llama.Size(vocab=1024, d_model=512, heads=8, kv_heads=kv_heads, head_dim=64, mlp=1024,
                    layers=2, dtype=jnp.bfloat16, remat=True, attention="epl")
  init_fn, loss_fn = llama.fns(size)
  ids = jax.ShapeDtypeStruct((1, length), jnp.int32)
  chosen = context.choose_method
  context.choose_method = lambda *args, **kwargs: method   # noqa: E731 (this bench's switch)
  try:
    with nn.logical_axis_rules(llama.LOGICAL_RULES):
      epl.init({"context.parallel_degree": 8}, devices=devices)
      trainer = epl.Trainer(init_fn, loss_fn, optax.adamw(1e-4))
      built = trainer._build(jax.random.key(0), {"x": ids, "y": ids})
      compiled = built.plan.compiled
  finally:
    context.choose_method = chosen
  return Figures.of(compiled, 0.0)


def main(argv=None):
  from common import record, table
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--gpu", action="store_true", help="8 compile-only H100s")
  parser.add_argument("--length", type=int, default=8192)
  parser.add_argument("--record", action="store_true")
  args = parser.parse_args(argv)
  devices = epl.topology("h100", hosts=1, per_host=8) if args.gpu else None
  where = "8 H100 (compile-only)" if args.gpu else "8 CPU"
  mib = 2 ** 20
  rows = []
  for kv in (8, 2):
    ring = None
    for method in ("ring", "gather"):
      f = figures(kv, method, args.length, devices)
      ring = ring or f
      rows.append([where, kv, method, f"{f.bytes_per_device / mib:.1f}",
                   f"{f.collective_bytes / mib:.1f}",
                   f"{f.bytes_per_device / ring.bytes_per_device:.3f} / "
                   f"{f.collective_bytes / max(ring.collective_bytes, 1):.3f}",
                   f.kinds_text(mib)])
      print(table(HEADERS, rows[-1:]), flush=True)
  body = table(HEADERS, rows)
  print(f"\n{body}")
  if args.record:
    record(f"Context attention: ring against all-gather (bench/context_attention.py"
           f"{' --gpu' if args.gpu else ''})", body + (
               f"\n\nLlama (2 layers, d_model 512, 8 heads of 64, bfloat16, remat, AdamW), one "
               f"row of {args.length} tokens, context.parallel_degree=8; ratio to ring: bytes "
               "per device / collective bytes. Compiled only."), argv,
           "compile-only H100s" if args.gpu else None)


if __name__ == "__main__":
  main()
