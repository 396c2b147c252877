"""Tokens per second and MFU of a ~1B Llama trained by epljax, against a hand-written ``jax.jit``.

    python bench/mfu.py                          # on a GPU: the 1B shape, 4 rows of 2048 tokens
    python bench/mfu.py --record                 # and replace its section in bench/RESULTS.md
    python bench/mfu.py --size tiny --seq 64 --rows 16 --pairs 4    # a CPU smoke run

The model is the zoo's Llama (``tests/models/llama.py``: layers under ``nn.scan``, bfloat16
compute over float32 parameters, each layer rematerialized) in Llama-3.2-1B's shape (16 layers,
width 2048, 32 heads, 8 kv heads, ffn 8192, vocab 128256; its head untied here: 1.50B
parameters). Both steps train it with the same AdamW on the same global batch, split over every
device (``jax.devices()``, a 'data' axis; one GPU: no split): epljax's default data parallelism
(``epl.Trainer``) and ``value_and_grad`` + the optax update under ``jax.jit`` with the same
shardings and donated state. They are timed alternately in one process (``common.paired_ratio``):
the figure of merit is the median of the per-pair time ratios.

MFU is model FLOPs per second over the devices' peak dense bfloat16 FLOP/s
(``epljax.chips``): per token ``6 x`` the parameters a matmul reads (the embedding lookup is not
one) plus the attention's ``6 x 2 x layers x seq x heads x head_dim``, halved for the causal mask
(MaxText's and torchtitan's count). HFU counts what the compiled step does instead: the
matmuls of its HLO (``epljax.flops.matmul_flops``: the rematerialized forward and the full
attention matrix included; XLA:CPU's ``cost_analysis()`` undercounts bfloat16 dots).
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS") or "--xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(__file__))
# This checkout's epljax, not an installed one (a worktree beside an editable install).
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import argparse  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import epljax as epl  # noqa: E402
from common import hand_step, record, table, time_against_hand  # noqa: E402
from epljax import chips  # noqa: E402
from epljax.flops import matmul_flops  # noqa: E402
from models import llama  # noqa: E402
from models.common import token_batch  # noqa: E402

# Llama-3.2-1B (Meta's params.json: dim 2048, 16 layers, 32 heads, 8 kv heads, ffn 8192,
# vocab 128256; its embedding is tied to the head, the zoo's Llama unties them).
SIZES = {"1b": llama.Size(128256, 2048, 32, 8, 64, 8192, 16, jnp.bfloat16, remat=True),
         "tiny": llama.SIZES["tiny"]}


def model_flops_per_token(size: llama.Size, seq: int) -> float:
  """Training FLOPs a token needs (forward and backward, no recomputation): the matmuls'
  ``6 x`` parameters (all but the embedding table and the norms) and causal attention's
  scores and mixing, ``6 x 2 x layers x seq x heads x head_dim / 2``."""
  matmul_params = size.params - size.vocab * size.d_model - (2 * size.layers + 1) * size.d_model
  attention = 6 * 2 * size.layers * seq * size.heads * size.head_dim / 2
  return 6 * matmul_params + attention


def hand_jit(loss_fn, optimizer, mesh: Mesh, params, batch):
  """``jax.jit`` of ``common.hand_step`` with parameters and optimizer state replicated and the
  batch split over 'data', its state donated; returns the jitted step and its placed inputs.
  ``params`` are copied (the step donates its own buffers)."""
  whole, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  state = jax.jit(lambda p: (jax.tree.map(jnp.copy, p), optimizer.init(p)),
                  out_shardings=whole)(params)
  step = jax.jit(hand_step(loss_fn, optimizer), in_shardings=(whole, rows),
                 out_shardings=(whole, whole), donate_argnums=0)
  return step, state, jax.device_put(batch, rows)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", default="1b", choices=list(SIZES))
  parser.add_argument("--seq", type=int, default=2048, help="tokens per row")
  parser.add_argument("--rows", type=int, default=4, help="rows per global batch")
  parser.add_argument("--pairs", type=int, default=20, help="timed pairs of steps")
  parser.add_argument("--record", action="store_true")
  args = parser.parse_args(argv)

  devices = jax.devices()
  size = SIZES[args.size]
  init_fn, loss_fn = llama.fns(size)
  optimizer = optax.adamw(1e-4, b2=0.95, weight_decay=0.1)
  batch = token_batch(args.rows, args.seq, size.vocab)

  epl.init()
  with nn.logical_axis_rules(llama.LOGICAL_RULES):
    trainer = epl.Trainer(init_fn, loss_fn, optimizer)
    state = trainer.init(jax.random.key(0), batch)
  epl_batch = trainer.shard_batch(batch)
  step, hand_state, hand_batch = hand_jit(loss_fn, optimizer, trainer.plan.mesh, state.params,
                                          batch)
  flops = {"epljax": matmul_flops(trainer.lower(state, epl_batch).compile().as_text()),
           "hand": matmul_flops(step.lower(hand_state, hand_batch).compile().as_text())}
  timing, _, _ = time_against_hand(trainer, state, epl_batch, step, hand_state, hand_batch,
                                   pairs=args.pairs)

  tokens = args.rows * args.seq
  peak = chips.peak_flops(devices[0].device_kind)
  model = model_flops_per_token(size, args.seq) * tokens
  rows = []
  for name, key, seconds in (("epljax", "epljax", timing["first_s"]),
                             ("hand-written jax.jit", "hand", timing["second_s"])):
    hlo_flops = flops[key] * len(devices)
    per_s = lambda f, s=seconds: f / s / (peak * len(devices)) if peak else float("nan")  # noqa: E731
    rows.append([name, f"{seconds * 1e3:.1f}", f"{tokens / seconds:,.0f}",
                 f"{100 * per_s(model):.1f}%", f"{100 * per_s(hlo_flops):.1f}%"])
  rows.append(["epljax / hand (median of paired ratios)", f"{timing['ratio']:.3f}x "
               f"(q1 {timing['ratio_q1']:.3f}, q3 {timing['ratio_q3']:.3f})", "", "", ""])
  body = (f"{size.params / 1e6:,.1f}M parameters ({args.size}), {args.rows} rows x {args.seq} "
          f"tokens, AdamW, {len(devices)} x {devices[0].device_kind}; peak "
          f"{(peak or float('nan')) / 1e12:.0f} TFLOP/s dense bf16 per device; model FLOPs "
          f"{model / tokens / 1e6:,.1f} MFLOP per token; {args.pairs} timed pairs.\n\n"
          + table(["step", "ms", "tokens/s", "MFU", "HFU (compiled FLOPs)"], rows))
  print(body)
  if args.record:
    record("Tokens per second and MFU against a hand-written jax.jit (bench/mfu.py)", body)
  return timing


if __name__ == "__main__":
  main()
