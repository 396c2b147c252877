"""nanoGPT's baby GPT on tiny Shakespeare in every layout of ``examples/shakespeare_char.py``.

    python bench/shakespeare.py            # the table (data: examples/data/tinyshakespeare.txt)
    python bench/shakespeare.py --record   # + RESULTS.md

Trains each layout (``single``: plain ``jax.jit`` on one device, the reference; ``dp``,
``split``, ``pipeline``, ``3d``) for 2000 iterations on the same global batches of 12 windows
and prints tokens/s (training steps only: no compile, no evaluation) and the final train and
validation losses (nanoGPT's ``estimate_loss``: 200 batches each), with each layout's
distance to ``single``. A layout epljax refuses gets its error's first line in the table.
The data-parallel step is then timed against a hand-written ``jax.jit`` with the same
shardings (parameters replicated, batch split over the same 4-device ``data`` mesh, same optax
optimizer), alternately in one process; the figure is the median of the per-pair ratios.
It writes ``docs/shakespeare_loss.png``: train and validation loss per layout.
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS") or "--xla_force_host_platform_device_count=8"
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
# This checkout's epljax, not an installed one (a worktree beside an editable install).
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import argparse  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import epljax as epl  # noqa: E402
import shakespeare_char as sc  # noqa: E402
from common import machine, record, table, time_against_hand  # noqa: E402

DEFAULT_DATA = os.path.join(HERE, "..", "examples", "data", "tinyshakespeare.txt")
SHAPES = {"single": "1 device", "dp": "data 4", "split": "data 2 x model 2",
          "pipeline": "data 2 x stage 2, M=3", "3d": "data 2 x stage 2 x model 2, M=3"}


def dp_against_hand_jit(result: dict, pairs: int) -> dict:
  """The dp step of ``result`` against a hand-written jit with the same shardings."""
  trainer, model, opt = result["trainer"], result["model"], result["optimizer"]
  batch = next(result["data"])
  epl_batch = trainer.shard_batch(batch)
  mesh = trainer.plan.mesh
  replicated, split_rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  params = jax.device_put(jax.device_get(result["variables"]["params"]), replicated)
  hand_state = (params, jax.jit(opt.init, out_shardings=replicated)(params))
  hand_batch = jax.device_put(batch, split_rows)

  def hand_step(state, b):
    params, opt_state = state
    loss, grads = jax.value_and_grad(lambda p: sc.loss_fn(model, {"params": p}, b))(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  hand_jit = jax.jit(hand_step, in_shardings=((replicated, replicated), split_rows),
                     out_shardings=((replicated, replicated), replicated), donate_argnums=0)
  return time_against_hand(trainer, result["state"], epl_batch, hand_jit, hand_state,
                           hand_batch, pairs=pairs)[0]


def plot(results: list[dict], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4.5))
  for i, r in enumerate(results):
    steps, train, val = zip(*r["evals"])
    color = f"C{i}"
    ax.plot(steps, train, color=color, label=f"{r['layout']} train")
    ax.plot(steps, val, color=color, linestyle="--", label=f"{r['layout']} val")
  ax.axhline(1.93, color="grey", linewidth=0.8, linestyle=":")
  ax.set_xlabel("iteration")
  ax.set_ylabel("loss (200 batches of 12 x 64 characters)")
  ax.set_title("baby GPT on tiny Shakespeare: epljax layouts and plain jax.jit")
  ax.set_ylim(1.4, 3.0)
  ax.legend(ncol=2, fontsize=8)
  fig.tight_layout()
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fig.savefig(path, dpi=110)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--data", default=DEFAULT_DATA)
  parser.add_argument("--layouts", default="single,dp,split,pipeline,3d")
  parser.add_argument("--steps", type=int, default=2000)
  parser.add_argument("--eval_interval", type=int, default=250)
  parser.add_argument("--pairs", type=int, default=40)
  parser.add_argument("--plot", default=os.path.join(HERE, "..", "docs", "shakespeare_loss.png"),
                      help="where the loss plot goes ('': no plot)")
  parser.add_argument("--record", action="store_true",
                      help="replace its section in bench/RESULTS.md (history: RESULTS-archive.md)")
  args = parser.parse_args(argv)

  text = sc.read_text(args.data)
  results, rows, refused, timing = [], [], {}, None
  for layout in args.layouts.split(","):
    print(f"--- {layout}", flush=True)
    try:
      r = sc.train(layout, text, steps=args.steps, eval_interval=args.eval_interval)
    except epl.EPLError as e:
      refused[layout] = str(e).splitlines()[0]
      print(f"{layout} refused: {e}", flush=True)
      continue
    if layout == "dp":
      timing = dp_against_hand_jit(r, args.pairs)
    for key in ("state", "variables", "trainer", "data"):
      r.pop(key)              # free the devices' buffers before the next layout
    results.append(r)

  single = next((r for r in results if r["layout"] == "single"), None)
  for r in results:
    gap = "" if single is None else f"{r['val_loss'] - single['val_loss']:+.4f}"
    rows.append([r["layout"], SHAPES[r["layout"]], "12", f"{r['tokens_per_s']:,.0f}",
                 f"{r['train_loss']:.4f}", f"**{r['val_loss']:.4f}**", gap])
  for layout in refused:
    rows.append([layout, SHAPES[layout], "12", "refused (below)", "", "", ""])
  body = table(["layout", "mesh", "global batch", "tokens/s", "train loss", "val loss",
                "val - single"], rows)
  for layout, why in refused.items():
    body += f"\n\n{layout} refused (EPLError): {why}"
  if timing is not None:
    body += (f"\n\ndp step against a hand-written `jax.jit` with the same shardings (data 4, "
             f"{args.pairs} pairs): {timing['first_s'] * 1e3:.2f} ms vs "
             f"{timing['second_s'] * 1e3:.2f} ms, median ratio **{timing['ratio']:.3f}** "
             f"({timing['ratio_q1']:.3f}-{timing['ratio_q3']:.3f})")
  body += (f"\n\n{args.steps} iterations, losses from 200 batches of 12 windows of 64 "
           "characters (train and val), tokens/s over the training steps without compile and "
           "evaluation." + (" Plot: `docs/shakespeare_loss.png`." if args.plot else ""))
  print(machine())
  print(body)
  if results and args.plot:
    plot(results, args.plot)
    print(f"wrote {os.path.normpath(args.plot)}")
  if args.record:
    record("nanoGPT baby GPT on tiny Shakespeare, per layout", body, argv)


if __name__ == "__main__":
  main()
