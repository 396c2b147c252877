"""Real model sizes on compile-only H100s: epljax's step against hand-written ``jax.jit``.

    JAX_PLATFORMS=cpu python bench/scale.py          # every model x topology x layout
    JAX_PLATFORMS=cpu python bench/scale.py --models llama3_8b --devices 8 --layouts fsdp
    JAX_PLATFORMS=cpu python bench/scale.py --cells llama2_70b:64:fsdp llama3_8b:8:tp
    JAX_PLATFORMS=cpu python bench/scale.py ... --record   # append to bench/RESULTS.md

(the jax with its CUDA plugin, ``gpu_aot.py``). Llama-3-8B, Llama-2-70B and GPT-2-XL of
``tests/models`` (``nn.scan`` layers, bfloat16 compute over float32 weights, each layer
rematerialized, AdamW) are planned by epljax for 8 (1 host), 16 (2 hosts) and 64 (8 hosts)
H100s in the layouts people use, and the same step is written by hand for the same layout:

- ``fsdp``: ``zero.level: v3`` against hand FSDP (every parameter split over all devices along
  its largest dimension; the Llamas' layers gather their kernels in bfloat16 inside the scan,
  ``hand_llama.fsdp``, GPT-2 leaves the gathers to GSPMD, ``hand_layouts.fsdp``).
- ``hsdp``: ``zero.level: v3`` with ``zero.shard_size: host`` (ZeRO inside each host of 8,
  data parallel across hosts; MaxText's ``ici_fsdp`` x ``dcn_data``): epljax's figures only.
- ``tp``: the model ``epl.split(8)`` (a host's 8 GPUs; data parallel across hosts) against
  ``hand_layouts.megatron`` with the model's Megatron specs.
- ``tp_pp``: that split cut into pipeline stages (``pipeline_config``: one host, 2 stages of 4
  GPUs; several, stages of 8, 4 stages from 64 GPUs) against ``hand_llama.gpipe`` (Llama only;
  GPT-2's hand columns stay empty).

Only ``ShapeDtypeStruct`` batches are given: nothing of the real size is ever created; epljax is
driven through ``trainer._build`` (plan) and ``plan.compiled`` (compile). Each row: bytes per
device (``memory_analysis()``: arguments + outputs - aliased + temp) and collective bytes per
step per device (``epljax.hlo``; a pipeline's on a device of its busiest stage,
``Plan.collectives``) of both, their ratios, plan and compile seconds, and whether
XLA warned "Involuntary full rematerialization" while compiling epljax's step.
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS") or "--xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(__file__))
# This checkout's epljax, not an installed one (a worktree beside an editable install).
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import epljax as epl  # noqa: E402
import hand_layouts  # noqa: E402
from hand_layouts import Figures  # noqa: E402

REMAT_WARNING = "Involuntary full rematerialization"
TP = 8   # tensor parallel degree of the ``tp`` layout: one host of 8 GPUs


@dataclasses.dataclass(frozen=True)
class Problem:
  """A model of the zoo at one size: its functions, the rules a user gives epljax, the hand
  Megatron specs, and the tokens of a row."""
  name: str
  init_fn: Callable
  loss_fn: Callable
  length: int
  vocab: int
  params: int
  megatron: dict
  split_pattern: str                      # module-path regex a user splits for ``tp``
  logical_rules: tuple | None = None
  llama_size: Any = None                  # a Llama's size: hand_llama writes its GPipe

  def batch(self, rows: int) -> dict:
    ids = jax.ShapeDtypeStruct((rows, self.length), jnp.int32)
    return {"x": ids, "y": ids}

  def rules(self):
    return (nn.logical_axis_rules(self.logical_rules) if self.logical_rules
            else contextlib.nullcontext())


def llama_problem(size_name: str, length: int, **changes) -> Problem:
  """The Llama preset ``size_name`` (with ``changes`` to its ``Size``: ``dtype=...``)."""
  from models import llama

  size = dataclasses.replace(llama.SIZES[size_name], **changes)
  init_fn, loss_fn = llama.fns(size)
  return Problem(f"llama {size_name}", init_fn, loss_fn, length, size.vocab, size.params,
                 llama.MEGATRON, "Llama", llama.LOGICAL_RULES, size)


def gpt2_problem(size_name: str, length: int | None = None) -> Problem:
  from models import gpt2

  size = gpt2.SIZES[size_name]
  init_fn, loss_fn = gpt2.fns(size)
  return Problem(f"gpt2 {size_name}", init_fn, loss_fn, length or size.length, size.vocab,
                 size.params, gpt2.MEGATRON, gpt2.ANNOTATE)


PROBLEMS: dict[str, Callable[[], Problem]] = {
    "gpt2_xl": lambda: gpt2_problem("xl"),
    "llama3_8b": lambda: llama_problem("8b", 2048),
    "llama2_70b": lambda: llama_problem("70b", 2048),
}


def optimizer():
  return optax.adamw(1e-4, weight_decay=0.1)


def epl_config(layout: str) -> dict:
  return {"fsdp": {"zero.level": "v3"}, "hsdp": {"zero.level": "v3", "zero.shard_size": "host"},
          "tp": {}}[layout]


@contextlib.contextmanager
def stderr_to(path: str):
  """File descriptor 2 into ``path`` (XLA's C++ warnings bypass ``sys.stderr``)."""
  sys.stderr.flush()
  saved = os.dup(2)
  with open(path, "w") as f:
    os.dup2(f.fileno(), 2)
  try:
    yield
  finally:
    sys.stderr.flush()
    os.dup2(saved, 2)
    os.close(saved)


def compile_epl(problem: Problem, layout: str, rows: int, tp: int = TP,
                devices: list | None = None, config: dict | None = None
                ) -> tuple[Figures, float, Any]:
  """epljax's step for ``layout``: its figures, the plan seconds and the plan. Over
  ``devices`` (compile-only ones, ``epl.topology``) or ``jax.devices()``; ``config`` adds keys
  (pipeline stages). ``trainer._build`` and ``plan.compiled`` are ``trainer.compile``'s two
  halves, timed apart."""
  with problem.rules():
    epl.init({**epl_config(layout), **(config or {})}, devices=devices)
    if layout == "tp":
      epl.annotate({problem.split_pattern: epl.split(tp)})
    trainer = epl.Trainer(problem.init_fn, problem.loss_fn, optimizer())
    start = time.perf_counter()
    built = trainer._build(jax.random.key(0), problem.batch(rows))
    plan_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = built.plan.compiled
    compile_s = time.perf_counter() - start
  return Figures.of(compiled, compile_s, built.plan.collectives), plan_s, built.plan


def compile_hand(problem: Problem, layout: str, rows: int, devices: list,
                 tp: int = TP, config: dict | None = None) -> Figures | None:
  """The hand-written step of ``layout`` (None: no hand GPipe of this model)."""
  with problem.rules():
    variables = hand_layouts.abstract_params(problem.init_fn, problem.batch(rows))
  batch = problem.batch(rows)
  if layout == "tp_pp":
    if problem.llama_size is None:
      return None
    import hand_llama

    return hand_llama.gpipe(problem.llama_size, optimizer(), variables, batch, devices, tp,
                               config["pipeline.num_stages"],
                               config["pipeline.num_micro_batch"], problem.megatron)
  if layout == "hsdp":   # no hand HSDP yet: epljax's figures against the fsdp row's hand
    return None
  if layout == "fsdp" and problem.llama_size is not None:
    import hand_llama

    return hand_llama.fsdp(problem.llama_size, optimizer(), variables, batch, devices)
  if layout == "fsdp":
    return hand_layouts.fsdp(problem.loss_fn, optimizer(), variables, batch, devices)
  return hand_layouts.megatron(problem.loss_fn, optimizer(), variables, batch, devices, tp,
                               problem.megatron)


def gib(n: int) -> str:
  return f"{n / 2**30:.2f}"


SCHEDULES = {"1F1B": "PreferBackward", "GPipe": "PreferForward"}   # --schedule -> strategy


def pipeline_config(devices: int, tp: int = TP, schedule: str = "1F1B",
                    param_layout: str = "user") -> dict:
  """``tp_pp`` over ``devices`` H100s: 2 stages, 4 from 64 devices; 2 micro batches a stage;
  epljax's ``schedule`` (the hand program is GPipe whatever it is) and
  ``pipeline.param_layout``."""
  stages = min(4, max(2, devices // 16))
  return {"auto.auto_parallel": True, "pipeline.num_stages": stages,
          "pipeline.num_micro_batch": 2 * stages, "pipeline.strategy": SCHEDULES[schedule],
          "pipeline.param_layout": param_layout}


def row(name: str, layout: str, topology: str, rows: int, devices: list,
        tp: int = TP, schedule: str = "1F1B", param_layout: str = "user") -> list[str]:
  problem = PROBLEMS[name]()
  pipeline = layout == "tp_pp"
  if pipeline:   # a stage of 4 GPUs on one host, of 8 across hosts
    tp = min(tp, len(devices) // 2)
  config = pipeline_config(len(devices), tp, schedule, param_layout) if pipeline else None
  with tempfile.NamedTemporaryFile("r", suffix=".log") as log:
    with stderr_to(log.name):
      ours, plan_s, plan = compile_epl(problem, "tp" if pipeline else layout, rows, tp,
                                       devices, config)
    warned = log.read().count(REMAT_WARNING)
  hand = compile_hand(problem, layout, rows, devices, tp, config)
  mesh = " x ".join(f"{a}={n}" for a, n in plan.mesh.shape.items() if n > 1)
  DETAILS.append(f"- {problem.name} {layout} on {topology}: epljax {ours.kinds_text()}"
                 + (f"; hand {hand.kinds_text()}" if hand else ""))
  ratio = lambda a, b: f"{a / b:.3f}" if b else ("1.000" if a == b else "inf")  # noqa: E731
  theirs = ((gib(hand.bytes_per_device), ratio(ours.bytes_per_device, hand.bytes_per_device))
            if hand else ("", ""))
  moved = ((gib(hand.collective_bytes), ratio(ours.collective_bytes, hand.collective_bytes))
           if hand else ("", ""))
  if pipeline and schedule != "1F1B":
    layout = f"{layout} {schedule}"
  if pipeline and param_layout != "user":
    layout = f"{layout} ({param_layout})"
  return [problem.name, f"{problem.params / 1e9:.2f}B", layout, topology, mesh, rows,
          gib(ours.bytes_per_device), *theirs, gib(ours.collective_bytes), *moved,
          f"{plan_s:.0f}", f"{ours.compile_s:.0f}", f"{hand.compile_s:.0f}" if hand else "",
          warned]


HEADERS = ["model", "params", "layout", "H100s", "epljax mesh", "rows", "GiB/device epljax",
           "hand", "ratio", "collective GiB epljax", "hand", "ratio", "plan s",
           "compile s epljax", "hand", "remat warnings"]
DETAILS: list[str] = []   # collectives by kind of each row, printed under the table
TOPOLOGIES = {8: 1, 16: 2, 64: 8}   # devices -> hosts of 8 H100s


def main(argv=None):
  from common import record, table
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", default=list(PROBLEMS), choices=list(PROBLEMS))
  parser.add_argument("--devices", nargs="+", type=int, default=list(TOPOLOGIES),
                      choices=list(TOPOLOGIES))
  parser.add_argument("--layouts", nargs="+", default=["fsdp", "tp", "tp_pp"],
                      choices=["fsdp", "hsdp", "tp", "tp_pp"])
  parser.add_argument("--cells", nargs="+", default=[], metavar="MODEL:DEVICES:LAYOUT",
                      help="these cells, in this order, instead of the product of the above")
  parser.add_argument("--rows_per_device", type=int, default=1,
                      help="global batch rows = this x devices")
  parser.add_argument("--schedule", default="1F1B", choices=list(SCHEDULES),
                      help="epljax's pipeline schedule in tp_pp cells (the hand one is GPipe)")
  parser.add_argument("--param_layout", default="user", choices=["user", "stage"],
                      help="epljax's pipeline.param_layout in tp_pp cells")
  parser.add_argument("--record", action="store_true")
  args = parser.parse_args(argv)
  cells = [(m, int(n), layout) for m, n, layout in (c.split(":") for c in args.cells)] or [
      (m, n, layout) for n in args.devices for m in args.models for layout in args.layouts]
  rows, gpus = [], {}
  for name, n, layout in cells:
    if n not in gpus:
      gpus[n] = epl.topology("h100", hosts=TOPOLOGIES[n], per_host=8)
    where, before = f"{n} ({n // 8} host{'s' * (n > 8)})", len(DETAILS)
    try:
      rows.append(row(name, layout, where, n * args.rows_per_device, gpus[n],
                      schedule=args.schedule, param_layout=args.param_layout))
    except Exception as e:  # noqa: BLE001 (the table says which layout fails and why)
      why = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
      rows.append([name, "", layout, where, why] + [""] * (len(HEADERS) - 5))
    print(table(HEADERS, rows[-1:]), *DETAILS[before:], sep="\n", flush=True)
  body = table(HEADERS, rows) + "\n\nCollective GiB per step per device by kind:\n\n" + "\n".join(
      DETAILS)
  print(f"\n{body}")
  if args.record:
    record("Real sizes on compile-only H100s (bench/scale.py)", body + (
        "\n\nAdamW, bfloat16 compute over float32 weights, every layer rematerialized; Llama "
        "rows of 2048 tokens, GPT-2-XL 1024. GiB/device: memory_analysis() arguments + outputs"
        " - aliased + temp; collective GiB: executed per step per device (epljax.hlo; tp_pp: "
        "a device of epljax's busiest stage, each tick's branch as its schedule says, "
        "Plan.collectives); hand: "
        "bench/hand_layouts.py. Plan s: trainer._build (trace and plan); compile s: XLA:GPU "
        "compile of the step on a shared 2-core VM."), argv, "compile-only H100s")


if __name__ == "__main__":
  main()
