"""What is live at the peak of a pipeline step: epljax's and the hand-written GPipe's, side by side.

    python bench/pipeline.py peak          # XLA:CPU, 8 simulated devices
    python bench/pipeline.py peak --gpu    # 8 compile-only H100s (v312 venv, JAX_PLATFORMS=cpu)
    python bench/pipeline.py peak --case 8 512 8   # layers, width, M (default 4 1024 4)

``bench/pipeline.py memory`` gives each program's peak bytes; this says what they are. Both
steps (``pipelines/memory.py``'s GPT, 4 stages x 2 replicas, AdamW, GPipe) are compiled with
XLA's dumps on, and the compiler's own live-range report of each step module (the buffers live
at its peak, ``*-live-range.txt``) is read: per buffer its bytes and what made it (the HLO
instruction's ``op_name``: the jax function or argument it comes from; a loop's carry is
``loop carry``; the step's arguments ``arguments``), summed per maker, largest first. Values
XLA placed at one offset of one allocation are one buffer, counted once (XLA:GPU's report
lists a loop's carry and the conditional output written in place of it as two values: until
2026-11-28 this bench counted both). The report counts what XLA's heap simulator places at
its peak instant; the last row of each
program is what ``memory_analysis()``'s peak (arguments + outputs - aliased + temp) holds beyond
it (on XLA:GPU mostly the loop's carried buffers, which its report leaves out).
"""

from __future__ import annotations

import glob
import os
import re
import sys
import tempfile

# The dump directory is read when XLA first parses its flags: set it before jax starts.
_DUMP = tempfile.mkdtemp(prefix="pipeline_peak_")
_BASE = os.environ.get("XLA_FLAGS") or "--xla_force_host_platform_device_count=8"
os.environ["XLA_FLAGS"] = f"{_BASE} --xla_dump_to={_DUMP} --xla_dump_hlo_pass_re=NONE"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipelines import memory as pm  # noqa: E402

_PEAK = re.compile(r"^\s+Live ranges at \d+ \(peak\):")
_VALUE = re.compile(r"^\s+([\w.\-]+)(\{[\d,]*\})?: (\d+) bytes")
_DEF = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = .*?\b([a-z][\w\-]*)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_ALLOCATION = re.compile(r"^allocation (\d+):")
_PLACED = re.compile(r"^ value: <\d+ ([\w.\-]+(?:\{[\d,]*\})?)(?: \(phi\))? @\d+> "
                     r"\(size=\d+,offset=(\d+)\)")


def peak_buffers(module: str) -> list[tuple[int, str, str]]:
  """``(bytes, value, what made it)`` of every buffer live at the peak of the dumped step
  module whose name contains ``module`` (its ``*-live-range.txt`` and optimized HLO): what made
  it is ``arguments`` for the step's arguments, ``loop carry`` for a loop's, else the defining
  instruction's ``op_name`` (or its opcode)."""
  ranges = glob.glob(os.path.join(_DUMP, f"*{module}*live-range.txt"))
  if len(ranges) != 1:
    raise SystemExit(f"expected one live-range dump of {module} in {_DUMP}, found {ranges}")
  made: dict[str, str] = {}
  entry = False
  with open(ranges[0].replace("-live-range.txt", ".txt")) as f:
    for line in f:
      if line.strip().endswith("{") and "%" in line:   # a computation starts
        entry = line.startswith("ENTRY")
      if m := _DEF.match(line):
        name, opcode = m.groups()
        op = _OP_NAME.search(line)
        if opcode == "parameter":
          made[name] = "arguments" if entry else "loop carry"
        else:
          made[name] = short(op.group(1).replace("\\'", "'")) if op else opcode
  placed = _placements(ranges[0].replace("-live-range.txt", "-buffer-assignment.txt"))
  buffers, inside = {}, False   # one per placement: the largest value live there
  with open(ranges[0]) as f:
    for line in f:
      if _PEAK.match(line):
        inside = True
      elif inside:
        if not (m := _VALUE.match(line)):
          break
        name, index, size = m.groups()
        value = f"{name}{index if index not in (None, '{}') else ''}"
        where = placed.get(value, value)
        buffers[where] = max(buffers.get(where, (0,)), (int(size), value, made.get(name, "?")))
  return sorted(buffers.values(), reverse=True)


def _placements(path: str) -> dict[str, tuple[int, int]]:
  """Value -> (allocation, offset), from XLA's buffer-assignment dump."""
  out, allocation = {}, -1
  with open(path) as f:
    for line in f:
      if m := _ALLOCATION.match(line):
        allocation = int(m.group(1))
      elif m := _PLACED.match(line):
        out[m.group(1)] = (allocation, int(m.group(2)))
  return out


def short(op_name: str, keep: int = 4) -> str:
  """An ``op_name`` without its ``jit(...)/shard_map/while/body/closed_call`` prefix."""
  parts = [p for p in op_name.split("/") if p not in ("shard_map", "while", "body", "closed_call")
           and not p.startswith("jit(")]
  return "/".join(parts[-keep:]) or op_name


def rows(case: tuple[int, int, int], devices, top: int) -> list[list]:
  """Per program: the total at its peak, then what made its buffers (summed per maker),
  largest first; ``top`` makers listed, the rest summed."""
  layers, width, micro = case
  hand = pm.hand_bytes(layers, width, micro, devices)
  ours = pm.epljax_bytes(layers, width, micro, "PreferForward", devices)
  per = pm.stage_param_bytes(layers, width)
  mib = lambda b: f"{b / 2**20:.1f}"   # noqa: E731
  out = []
  for who, module, compiled in (("hand GPipe", "jit_step", hand),
                                ("epljax", "jit_epl_step", ours)):
    buffers = peak_buffers(module)
    total = sum(b for b, _, _ in buffers)
    out.append([who, f"all (memory_analysis() peak {mib(compiled.peak)} MiB)", len(buffers),
                mib(total), f"{total / per:.2f}"])
    by: dict[str, list[int]] = {}
    for size, _, what in buffers:
      by.setdefault(what, []).append(size)
    makers = sorted(by.items(), key=lambda kv: -sum(kv[1]))
    for what, sizes in makers[:top]:
      out.append([who, what, len(sizes), mib(sum(sizes)), f"{sum(sizes) / per:.2f}"])
    rest = [b for _, sizes in makers[top:] for b in sizes]
    if rest:
      out.append([who, f"{len(makers) - top} other makers", len(rest), mib(sum(rest)),
                  f"{sum(rest) / per:.2f}"])
    missing = compiled.peak - total
    out.append([who, "memory_analysis() peak - the report's total", "", mib(missing),
                f"{missing / per:.2f}"])
  return out


HEADER = ["program", "made by (op_name)", "buffers", "MiB/device", "x stage param B"]


def main(argv=None) -> None:
  from common import record, table

  def add(parser):
    parser.add_argument("--case", type=int, nargs=3, default=(4, 1024, 4),
                        metavar=("LAYERS", "WIDTH", "MICRO"))
    parser.add_argument("--top", type=int, default=8, help="makers listed per program")

  args, devices, where = pm.cli(__doc__, argv, add)
  layers, width, micro = args.case
  text = table(HEADER, rows(tuple(args.case), devices, args.top))
  print(text)
  if args.record:
    record(f"Live at a pipeline step's peak, {layers} layers x width {width}, M={micro}", text,
           used=devices[:2 * pm.S])
