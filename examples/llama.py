"""A Llama trained on tiny Shakespeare (characters) with epljax; real sizes planned for GPUs.

    python examples/llama.py
    python examples/llama.py --layout tp --tp 2 --steps 300
    python examples/llama.py --layout tp_pp --config amp.level=O1
    python -m epljax.plan examples/llama.py --topology h100:8x8 -- --size 70b --layout fsdp

It needs epljax alone (``pip install -e .`` in the repository; planning for H100s, the CUDA
plugin too: ``pip install -e ".[cuda12]"``). The text is the repository's copy of tiny
Shakespeare (``examples/data/tinyshakespeare.txt``; ``--data`` reads another). Each step trains
on random windows of it, drawn as nanoGPT's ``get_batch`` draws them, the same global batch on
every process, each process feeding its own rows (``epl.io.process_slice``).

The model (``examples/example_models/llama.py``, the test zoo's Llama too: layers under
``nn.scan``, Flax logical axis names, grouped-query attention, SwiGLU, rotary positions).
``--size`` picks its shape:

=====  ====================================  ========  ===========  ==================
size   shape                                 compute   seq x batch  for
=====  ====================================  ========  ===========  ==================
small  4 layers, 32 wide (the zoo's)         float32   64 x 16      8 CPU devices
tiny   2 layers, 64 wide, 8 heads            bfloat16  64 x 16      8 CPU devices
8b     Llama-3-8B (32 x 4096, vocab 128256)  bfloat16  2048 x 64    GPUs / epljax.plan
70b    Llama-2-70B (80 x 8192, vocab 32000)  bfloat16  2048 x 64    GPUs / epljax.plan
=====  ====================================  ========  ===========  ==================

The weights are float32 in every size (bfloat16 compute casts them at use); 8b and 70b
rematerialize each layer. Small sizes read their vocabulary from the text (characters, padded
to a multiple of 64 so that it splits over the model axis); the real sizes keep theirs (the
characters are its first ids). ``--layout`` is how epljax lays it out, over every device
(``jax.devices()``):

========  =============================================================================
dp        data parallel (epljax's default)
fsdp      ``zero.level: v3``: parameters, gradients and optimizer state split over data
tp        the model ``epl.split(--tp)`` (Megatron from its logical axis names) x data
tp_pp     ``tp`` cut into ``--stages`` pipeline stages of ``--micro_batches`` (auto_parallel)
========  =============================================================================

``--config key=value`` passes any other epl.init key (``zero.level=v1``,
``gradient_checkpoint.type=auto``...). With ``--size 8b`` or ``70b`` the script is what a GPU
cluster runs (``python -m epljax.launch``); on this machine, plan it for a cluster with
``python -m epljax.plan``, which stops at ``trainer.init`` and compiles for that topology
instead: nothing of the real size is ever created.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import time  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import epljax as epl  # noqa: E402
from epljax.data import CharVocab, split_train_val  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
from example_models import llama  # noqa: E402  (one Llama for this script, the zoo, the benches)

DATA = os.path.join(HERE, "data", "tinyshakespeare.txt")
# size -> (tokens per row, rows per global batch) when --seq / --batch are not given
DEFAULTS = {"small": (64, 16), "tiny": (64, 16), "8b": (2048, 64), "70b": (2048, 64)}
LAYOUTS = ("dp", "fsdp", "tp", "tp_pp")


def parse_config(pairs: list[str]) -> dict:
  """``["zero.level=v1", "pipeline.num_micro_batch=4"]`` -> a dict for ``epl.init``; values
  are read as Python literals where they are one (``4``, ``True``), else kept as text."""
  import ast

  out = {}
  for pair in pairs:
    key, sep, value = pair.partition("=")
    if not sep or not key:
      raise epl.ConfigError(f"--config {pair!r}: write key=value, e.g. --config zero.level=v3")
    try:
      out[key] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      out[key] = value
  return out


def layout_config(layout: str, stages: int, micro_batches: int) -> dict:
  if layout not in LAYOUTS:
    raise epl.ConfigError(f"--layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
  config = {"fsdp": {"zero.level": "v3"}}.get(layout, {})
  if layout == "tp_pp":
    config = {"auto.auto_parallel": True, "pipeline.num_stages": stages,
              "pipeline.num_micro_batch": micro_batches}
  return config


def model_size(name: str, vocab: int) -> llama.Size:
  if name not in llama.SIZES:
    raise epl.ConfigError(f"--size {name!r}: choose one of {', '.join(llama.SIZES)}")
  size = llama.SIZES[name]
  if size.vocab < 1000:   # the CPU sizes: the text's characters, padded to a multiple of 64
    return dataclasses.replace(size, vocab=-(-vocab // 64) * 64)   # (splits over the model axis)
  if vocab > size.vocab:
    raise epl.ConfigError(f"the text has {vocab} characters, more than --size {name}'s "
                          f"vocabulary of {size.vocab}")
  return size


def batches(tokens: np.ndarray, seq: int, rows: int, seed: int):
  """Global batches ``{"x": ids, "y": next ids}`` of ``rows`` windows of ``seq + 1`` tokens at
  random starts (nanoGPT's ``get_batch``), the same on every process: each passes its own rows
  to the trainer (``epl.io.process_slice``)."""
  if len(tokens) <= seq:
    raise epl.ConfigError(f"the text has {len(tokens)} tokens, too few for windows of {seq + 1} "
                          "(--seq); pass a longer --data or a smaller --seq")
  rng = np.random.default_rng(seed)
  while True:
    starts = rng.integers(0, len(tokens) - seq, rows)
    window = np.stack([tokens[start:start + seq + 1] for start in starts])
    yield {"x": window[:, :-1], "y": window[:, 1:]}


def main(argv=None) -> list[float]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--data", default=DATA,
                      help="a text file (default: the repository's tiny Shakespeare)")
  parser.add_argument("--size", default="small", choices=list(llama.SIZES))
  parser.add_argument("--seq", type=int, help="tokens per row (default: by --size)")
  parser.add_argument("--batch", type=int, help="rows per global batch (default: by --size)")
  parser.add_argument("--layout", default="fsdp", choices=LAYOUTS)
  parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree of tp, tp_pp")
  parser.add_argument("--stages", type=int, default=2, help="pipeline stages of tp_pp")
  parser.add_argument("--micro_batches", type=int, default=2, help="micro batches of tp_pp")
  parser.add_argument("--config", nargs="*", default=[], metavar="KEY=VALUE",
                      help="more epl.init keys, e.g. amp.level=O1 zero.level=v1")
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--log_every", type=int, default=20)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--plan", action="store_true", help="print the plan after init")
  args = parser.parse_args(argv)

  if not os.path.exists(args.data):
    raise epl.ConfigError(f"--data {args.data}: no such file; pass the path of a text file "
                          f"(the repository's tiny Shakespeare: {DATA})")
  with open(args.data, encoding="utf-8") as f:
    text = f.read()
  vocab = CharVocab.of(text)
  train_tokens, val_tokens = split_train_val(vocab.encode(text))
  size = model_size(args.size, len(vocab))
  seq, rows = (args.seq or DEFAULTS[args.size][0]), (args.batch or DEFAULTS[args.size][1])
  init_fn, loss_fn = llama.fns(size)

  epl.init({**layout_config(args.layout, args.stages, args.micro_batches),
            **parse_config(args.config)})
  if args.layout in ("tp", "tp_pp"):
    epl.annotate({"Llama": epl.split(args.tp)})   # Megatron from the logical axis names
  warmup = min(20, args.steps // 2)   # (a short run keeps steps to decay over)
  optimizer = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.steps),
                          b2=0.95, weight_decay=0.1)
  data = batches(train_tokens, seq, rows, args.seed)
  # The rules a MaxText user gives Flax: logical axis names -> the "model" mesh axis.
  with nn.logical_axis_rules(llama.LOGICAL_RULES):
    trainer = epl.Trainer(init_fn, loss_fn, optimizer)
    state = trainer.init(jax.random.key(args.seed), epl.io.process_slice(next(data)))
    if args.plan:
      print(trainer.plan, "\n")
    losses, start = [], time.perf_counter()
    for step in range(1, args.steps + 1):
      state, metrics = trainer.train_step(state, epl.io.process_slice(next(data), trainer.plan))
      losses.append(metrics["loss"])
      if step % args.log_every == 0 or step == args.steps:
        seconds = (time.perf_counter() - start) / args.log_every
        print(f"step {step}: loss {float(metrics['loss']):.4f}  ({seconds * 1e3:.0f} ms/step)",
              flush=True)
        start = time.perf_counter()
    held_out = batches(val_tokens, seq, rows, args.seed + 1)
    val = np.mean([float(trainer.eval_step(state, epl.io.process_slice(next(held_out),
                                                                       trainer.plan))["loss"])
                   for _ in range(4)])
  print(f"held-out loss {val:.4f} ({size.params / 1e6:.2f}M parameters, {args.layout}, "
        f"{seq} tokens x {rows} rows)")
  return [float(x) for x in losses]


if __name__ == "__main__":
  main()
