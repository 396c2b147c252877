"""Pipeline stages: memory, executed FLOPs and step time of GPipe and 1F1B against the
unpipelined model.

    python bench/pipeline.py schedule            # print the tables
    python bench/pipeline.py schedule --record   # and replace their section in bench/RESULTS.md
    python bench/pipeline.py compile --depth     # compile time and HLO size vs depth (compile.py)
    python bench/pipeline.py compile --split     # where the 48-block step's compile time goes
    python bench/pipeline.py schedule --memory   # 1F1B stash (S - s per stage) and temp vs M
    python bench/pipeline.py schedule --interleaved   # 1F1B vs interleaved 1F1B (v=2 chunks)
    python bench/pipeline.py schedule --interleaved-scan   # the same, blocks under nn.scan

A residual MLP of 8 blocks cut into S=4 stages of 2 blocks (``set_default_strategy`` between
them, EPL's BERT style) on 8 devices: 2 pipeline replicas. For M in {4, 8, 16, 32} micro
batches of 64 rows per replica:

- temp bytes per device: ``memory_analysis()`` of the compiled step, for GPipe and 1F1B (the
  loop keeps the ``jax.vjp`` residuals; the ``inputs`` stash mode, which recomputed the
  forward in the backward, is gone: gradient checkpointing features do that);
- executed FLOPs over the unpipelined FLOPs: each stage branch compiled alone
  (``cost_analysis()``) times the busy slots of the schedule (idle slots run no compute),
  over ``cost_analysis()`` of the unpipelined loss-and-gradient on the same rows;
- step time over the unpipelined model's (the same model without the stage cuts, data
  parallel over the same 8 devices with the same M micro batches), timed alternately.

``--interleaved``: the same model cut into 8 chunks of one block, v=2 per stage
(``pipeline.num_virtual_stages``), next to 1F1B on 4 stages of 2 blocks: the bubble measured
from the tick table against ``(S - 1) / (vM + S - 1)``, kept chunks, temp memory, executed
FLOPs, and step time against 1F1B's.

``--interleaved-scan``: 16 blocks under ``nn.scan`` cut by ``auto.auto_parallel`` into S=4
stages, 1F1B (v=1: each stage reads its 4 layers where stored) against interleaved 1F1B (v=2:
the scan in 8 chunks of 2 layers, stage ``s`` runs chunks ``s`` and ``s + 4`` but stores
chunks ``2s`` and ``2s + 1``, so each step moves chunks there and their gradients back with
``ppermute``): bubble, temp memory, the bytes of the step's collective-permutes (the loop's
activation hops and the chunk moves) from the compiled HLO, and step time.
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS") or "--xla_force_host_platform_device_count=8"
BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)
# This checkout's epljax, not an installed one (a worktree beside an editable install).
sys.path.insert(1, os.path.dirname(BENCH))

import argparse  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import epljax as epl  # noqa: E402
from common import paired_ratio, record, table  # noqa: E402
from epljax import hlo  # noqa: E402
from epljax.pipeline import cost as pipeline_cost  # noqa: E402

STAGES, BLOCKS, WIDTH, ROWS = 4, 2, 256, 64


class Block(nn.Module):
  @nn.compact
  def __call__(self, h):
    return h + nn.Dense(WIDTH)(nn.gelu(nn.Dense(WIDTH)(nn.LayerNorm()(h))))


class Net(nn.Module):
  cut: bool = True
  chunks: int = STAGES     # stage task graphs: S x v

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(WIDTH)(x)
    for _ in range(self.chunks):
      if self.cut:
        epl.set_default_strategy(epl.replicate(1))
      for _ in range(STAGES * BLOCKS // self.chunks):
        h = Block()(h)
    return nn.Dense(10)(h)


def batch_of(rows: int) -> dict:
  rng = np.random.default_rng(0)
  return {"x": rng.normal(size=(rows, 32)).astype(np.float32),
          "y": rng.integers(0, 10, rows).astype(np.int32)}


def trainer_for(model: nn.Module, config: dict, batch: dict):
  epl.init(config)

  def loss_fn(variables, b):
    logits = model.apply(variables, b["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

  trainer = epl.Trainer(lambda key, b: model.init(key, b["x"]), loss_fn, optax.adamw(1e-3))
  state = trainer.init(jax.random.key(0), batch)
  return trainer, state, loss_fn


def unpipelined_flops(loss_fn, rows: int) -> float:
  """FLOPs of loss and gradient of the unpipelined model on ``rows`` rows, on one device."""
  model = Net(cut=False)
  b = batch_of(rows)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), b["x"]))
  grad = jax.jit(jax.value_and_grad(lambda v: loss_fn(v, b)))
  return grad.lower(params).compile().cost_analysis()["flops"]


def executed_flops(trainer) -> float:
  """All devices of one replica together: every busy slot of the schedule runs its branch."""
  pipe = trainer.plan.pipeline
  costs = pipeline_cost.branch_flops(pipe.loop, pipe.aux_avals, pipe.batch_avals)
  return float(pipeline_cost.tick_flops(costs, pipe.loop.branch_of, pipe.schedule).sum())


def measure(micro: int, pairs: int) -> tuple[list, list]:
  rows = 2 * micro * ROWS            # 2 replicas x M micro batches x ROWS rows
  batch = batch_of(rows)
  flat_trainer, flat_state, loss_fn = trainer_for(
      Net(cut=False), {"pipeline.num_micro_batch": micro}, batch)
  reference = unpipelined_flops(loss_fn, micro * ROWS)    # one replica's rows per step
  memory, timing = [], []
  flat = {"state": flat_state}     # train_step donates its state: keep the latest here
  flat_temp = flat_trainer.plan.memory.temp_size_in_bytes
  for strategy in ("PreferForward", "PreferBackward"):
    config = {"pipeline.num_micro_batch": micro, "pipeline.strategy": strategy}
    trainer, state, _ = trainer_for(Net(), config, batch)
    pipe = trainer.plan.pipeline
    temp = trainer.plan.memory.temp_size_in_bytes
    memory.append([micro, f"{strategy} ({'GPipe' if strategy == 'PreferForward' else '1F1B'})",
                   pipe.schedule.num_slots, f"{temp / 2**20:.2f}",
                   f"{flat_temp / 2**20:.2f}", f"{executed_flops(trainer) / reference:.3f}"])
    box = {"state": state}
    p_batch, f_batch = trainer.shard_batch(batch), flat_trainer.shard_batch(batch)

    def run_p(box=box, trainer=trainer, p_batch=p_batch):
      box["state"], m = trainer.train_step(box["state"], p_batch)
      return m["loss"]

    def run_f(f_batch=f_batch):
      flat["state"], m = flat_trainer.train_step(flat["state"], f_batch)
      return m["loss"]

    r = paired_ratio(run_p, run_f, pairs=pairs)
    timing.append([micro, strategy, f"{r['first_s'] * 1e3:.1f}", f"{r['second_s'] * 1e3:.1f}",
                   f"**{r['ratio']:.2f}** ({r['ratio_q1']:.2f}-{r['ratio_q3']:.2f})", pairs])
  return memory, timing


def _time_against_first(rows: list, runs: list, pairs: int) -> None:
  """Appends the step time of ``runs`` = ``[(trainer, {"state": ...}, batch)] * 2`` to
  ``rows``: the first's, then the second's with its ratio to the first, timed alternately."""
  def step(trainer, box, b):
    def go():
      box["state"], m = trainer.train_step(box["state"], b)
      return m["loss"]
    return go

  r = paired_ratio(step(*runs[1]), step(*runs[0]), pairs=pairs)
  rows[0].append(f"{r['second_s'] * 1e3:.1f}")
  rows[1].append(f"{r['first_s'] * 1e3:.1f} (**{r['ratio']:.2f}**x, {r['ratio_q1']:.2f}-"
                 f"{r['ratio_q3']:.2f})")


def measure_interleaved(micro: int, pairs: int, virtual: int = 2) -> list:
  """1F1B (S stages) and interleaved 1F1B (S x v chunks) of the same model and batch."""
  rows = 2 * micro * ROWS
  batch = batch_of(rows)
  _, _, loss_fn = trainer_for(Net(cut=False), {"pipeline.num_micro_batch": micro}, batch)
  reference = unpipelined_flops(loss_fn, micro * ROWS)
  runs = []
  for v in (1, virtual):
    config = {"pipeline.num_micro_batch": micro, "pipeline.num_virtual_stages": v}
    trainer, state, _ = trainer_for(Net(chunks=STAGES * v), config, batch)
    runs.append((v, trainer, {"state": state}, trainer.shard_batch(batch)))
  out = []
  for v, trainer, _, _ in runs:
    sched = trainer.plan.pipeline.schedule
    out.append([micro, sched.name, v, sched.num_ticks, f"{sched.measured_bubble():.3f}",
                f"{(STAGES - 1) / (v * micro + STAGES - 1):.3f}", sched.num_slots,
                f"{trainer.plan.memory.temp_size_in_bytes / 2**20:.2f}",
                f"{executed_flops(trainer) / reference:.3f}"])

  _time_against_first(out, [run[1:4] for run in runs], pairs)
  return out


def measure_interleaved_scan(micro: int, pairs: int, layers: int = 16) -> list:
  """1F1B and interleaved 1F1B (v=2) of blocks under ``nn.scan`` (see the module doc)."""
  from pipelines import compile as pc
  rows = 2 * micro * ROWS
  batch = batch_of(rows)
  model = pc.Scanned(layers)
  runs = []
  for v in (1, 2):
    config = {"auto.auto_parallel": True, "pipeline.num_stages": STAGES,
              "pipeline.num_micro_batch": micro, "pipeline.num_virtual_stages": v}
    trainer, state, _ = trainer_for(model, config, batch)
    text = trainer.lower(state, batch).compile().as_text()
    permuted = sum(c.bytes for c in hlo.collectives(text) if c.kind == "collective-permute")
    runs.append((v, trainer, {"state": state}, trainer.shard_batch(batch), permuted))
  stacked = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(runs[0][2]["state"].params)
                if x.shape[:1] == (layers,))
  out = []
  for v, trainer, _, _, permuted in runs:
    sched = trainer.plan.pipeline.schedule
    out.append([micro, sched.name, v, f"{sched.measured_bubble():.3f}",
                f"{trainer.plan.memory.temp_size_in_bytes / 2**20:.2f}",
                f"{permuted / 2**20:.2f}", f"{stacked / STAGES / 2**20:.2f}"])

  _time_against_first(out, [run[1:4] for run in runs], pairs)
  return out


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--micro", type=int, nargs="+", default=[4, 8, 16, 32])
  parser.add_argument("--pairs", type=int, default=10)
  parser.add_argument("--record", action="store_true")
  parser.add_argument("--memory", action="store_true",
                      help="only 1F1B / GPipe stash slots and temp memory vs micro batches")
  parser.add_argument("--compile", "--depth", action="store_true",
                      help="only compile time and HLO size vs depth, next to a hand-written GPipe")
  parser.add_argument("--compile-split", "--split", action="store_true",
                      help="only where the 48-block step's compile time goes: lower vs XLA "
                           "compile, and kernels, next to the hand-written GPipe")
  parser.add_argument("--interleaved", action="store_true",
                      help="only 1F1B vs interleaved 1F1B (pipeline.num_virtual_stages=2)")
  parser.add_argument("--interleaved-scan", action="store_true",
                      help="the same, the blocks under nn.scan (chunks moved per step)")
  args = parser.parse_args(argv)
  if args.interleaved_scan:
    rows = []
    for micro in args.micro:
      rows += measure_interleaved_scan(micro, args.pairs)
      print(f"M={micro} done", flush=True)
    body = table(["M", "schedule", "v", "bubble (tick table)", "temp MiB/dev",
                  "collective-permute MiB/dev", "stacked layers stored MiB/dev",
                  "step ms (interleaved / 1F1B)"], rows)
    body += (f"\n\n16 residual blocks of width {WIDTH} under nn.scan, auto.auto_parallel with "
             f"S={STAGES} stages: 1F1B reads each stage's 4 layers where stored; interleaved 1F1B "
             "(v=2) splits the scan into 8 chunks of 2 layers, chunk c on stage c % S, and moves "
             "the chunks a stage runs but does not store (and their gradients back) with "
             f"ppermute each step. {ROWS} rows per micro batch and replica, 2 pipeline replicas "
             "on 8 devices. collective-permute: result bytes per device of every "
             "collective-permute in the compiled step's HLO (a loop's counted once: the "
             "activation hops per tick, and the chunk moves); temp from memory_analysis(); step "
             "time: median over pairs, timed alternately.")
    print(body)
    if args.record:
      record("Pipeline interleaved 1F1B of nn.scan layers "
             "(bench/pipeline.py schedule --interleaved-scan)", body)
    return
  if args.interleaved:
    rows = []
    for micro in args.micro:
      rows += measure_interleaved(micro, args.pairs)
      print(f"M={micro} done", flush=True)
    body = table(["M", "schedule", "v", "ticks", "bubble (tick table)", "(S-1)/(vM+S-1)",
                  "kept slots", "temp MiB/dev", "executed FLOPs / unpipelined",
                  "step ms (interleaved / 1F1B)"], rows)
    body += (f"\n\nS={STAGES} stages, {STAGES * BLOCKS} residual blocks of width {WIDTH}: 1F1B "
             f"runs {BLOCKS} blocks per stage, interleaved 1F1B 2 chunks of "
             f"{BLOCKS // 2} block per stage (chunk c on stage c % S); {ROWS} rows per micro "
             "batch and replica, 2 pipeline replicas on 8 devices. Bubble: 1 - work / time from "
             "the tick table (a lockstep tick lasts as long as its busiest stage's slots, a "
             "stage's forward = backward = 1, a chunk's 1/v). Kept slots: stash slots per "
             "device (1F1B: micro batches of a stage; interleaved: micro batch chunks, half "
             "the size). Temp bytes from memory_analysis() of the compiled step; executed "
             "FLOPs: busy slots x per-branch cost_analysis over the unpipelined "
             "loss-and-gradient; step time: median over pairs, timed alternately.")
    print(body)
    if args.record:
      record("Pipeline interleaved 1F1B vs 1F1B (bench/pipeline.py schedule --interleaved)", body)
    return
  if args.compile_split:
    from pipelines import compile as pc
    body = table(["step", "lower s", "XLA compile s", "lower ratio", "compile ratio",
                  "lower + compile ratio", "fusion kernels", "distinct kernels",
                  "distinct only in switch branches", "HLO kchars"], pc.split_rows())
    body += (f"\n\n48 residual blocks of width {pc.WIDTH} under nn.scan, S={pc.S} stages "
             f"(auto.auto_parallel), M={pc.M} micro batches of {pc.ROWS} rows, 2 replicas on 8 "
             "devices, next to the hand-written GPipe of --compile. lower: tracing the step and "
             "lowering it to StableHLO; XLA compile: Lowered.compile(); medians of 5, the two "
             "timed alternately. Kernels from the compiled HLO: fusion instructions; distinct: "
             "their fused computations up to names and metadata (XLA:CPU generates code per "
             "distinct kernel); only in switch branches: distinct kernels found only inside the "
             "conditionals (the pipeline's bubble-skipping switch over stage functions and idle "
             "ticks) and the loops within them.")
    print(body)
    if args.record:
      record("Pipeline compile time split (bench/pipeline.py compile --split)", body)
    return
  if args.compile:
    from pipelines import compile as pc
    body = table(["blocks", "model as written", "epljax init + step s", "epljax step s",
                  "hand-written s", "ratio", "step-only ratio",
                  "epljax HLO kchars", "hand-written HLO kchars", "HLO ratio",
                  "epljax temp MiB/dev"], pc.measure())
    body += (f"\n\nResidual MLP blocks of width {pc.WIDTH}, S={pc.S} stages, M={pc.M} micro "
             f"batches of {pc.ROWS} rows, 2 replicas on 8 devices. epljax: Trainer.init (trace, "
             "plan, and compiling the parameters' init) + lower + compile of the step; step-only: "
             "lower + compile of the step alone (parameters reach their stage in one all_to_all "
             "per dtype; roll_layers: a stage's repeated blocks run as one lax.scan; nn.scan: "
             "the blocks under nn.scan, auto.auto_parallel with 4 stages splits the scan into one "
             "scan per stage and each stage reads its layers where they are stored); "
             "hand-written: blocks stacked on the stage axis, a scan over a stage's blocks, a "
             "GPipe tick loop with ppermute in shard_map, jax.grad through it.")
    print(body)
    if args.record:
      record("Pipeline compile cost vs depth (bench/pipeline.py compile --depth)", body)
    return
  if args.memory:
    from pipelines import compile as pc
    body = table(["M", "schedule", "ticks", "kept per stage s (S - s for 1F1B)", "stash slots",
                  "temp MiB/dev"], pc.memory_rows())
    body += (f"\n\n{pc.S} stages x 2 residual blocks of width {pc.WIDTH}, {pc.ROWS} rows per micro "
             "batch and replica, 2 replicas on 8 devices; temp bytes from memory_analysis() of the "
             "compiled step (an SPMD program: every device allocates the S-slot stash).")
    print(body)
    if args.record:
      record("Pipeline 1F1B memory vs S - s (bench/pipeline.py schedule --memory)", body)
    return
  memory, timing = [], []
  for micro in args.micro:
    m, t = measure(micro, args.pairs)
    memory += m
    timing += t
    print(f"M={micro} done", flush=True)
  mem_table = table(["M", "schedule", "kept slots", "temp MiB/dev",
                     "unpipelined temp MiB/dev", "executed FLOPs / unpipelined"], memory)
  time_table = table(["M", "schedule", "pipeline ms", "unpipelined ms",
                      "ratio (quartiles)", "pairs"], timing)
  notes = (f"S={STAGES} stages x {BLOCKS} residual blocks of width {WIDTH}, {ROWS} rows per "
           "micro batch and replica, 2 pipeline replicas on 8 devices; unpipelined: the same "
           "model without stage cuts, data parallel on the 8 devices with the same micro "
           "batches. Executed FLOPs: busy slots x per-branch cost_analysis, over the "
           "unpipelined loss-and-gradient cost_analysis on the same rows. Step-time ratio: "
           "median over pairs of pipelined / unpipelined step time, timed alternately.")
  body = f"{mem_table}\n\n{time_table}\n\n{notes}"
  print(body)
  if args.record:
    record("Pipeline stages: memory, FLOPs, step time (bench/pipeline.py schedule)", body)
