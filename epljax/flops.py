"""FLOPs of a compiled program: XLA's ``cost_analysis()``, with what it leaves out counted from
the HLO (``hlo``'s reading of computations, loops and their trip counts).

XLA's analysis counts a ``while`` body once and a conditional as its costliest branch; the
matmuls and convolutions of loop bodies are added here for the iterations it left out, and where
there is no analysis at all (XLA:GPU compiling for devices it does not have) every matmul's
FLOPs come from the text.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from epljax import hlo


def compiled_flops(compiled, hlo_text: str | None = None) -> float:
  """``cost_analysis()`` FLOPs, with the matmuls of loop bodies counted once per iteration.

  XLA's cost analysis counts a ``while`` body once (gradient accumulation over 2 micro batches
  showed half the FLOPs of 1); the matmuls and convolutions of each body are added again for
  the iterations it left out (``known_trip_count``, ``hlo.executed_collectives``' reading).
  Every branch of a conditional inside a loop counts on every iteration, so a pipeline's tick
  loop is overcounted: its FLOPs come from its schedule (``epljax.pipeline.cost``).
  ``hlo_text``: ``compiled.as_text()``, where the caller has it already."""
  if hlo_text is None:
    hlo_text = compiled.as_text()
  analysed = analysed_flops(compiled)
  if not analysed:   # (no cost analysis: XLA:GPU compiling for devices it does not have)
    return matmul_flops(hlo_text)
  return analysed + loop_matmul_flops(hlo_text)


def analysed_flops(compiled) -> float:
  """``cost_analysis()`` FLOPs as XLA counts them: a loop body once, a switch as its costliest
  branch."""
  cost = compiled.cost_analysis()
  if isinstance(cost, Sequence):   # older jax: one dict per program
    cost = cost[0] if cost else {}
  return float((cost or {}).get("flops", 0.0))


_DOT = re.compile(r"lhs_contracting_dims=\{(?P<dims>[\d,]*)\}")
# XLA:GPU's library matmuls: a custom call whose backend config states the contraction.
_GEMM = re.compile(r'custom_call_target="__cublas\$(?:lt\$matmul|gemm)[^"]*"')
_GEMM_DOT = re.compile(r'"lhs_contracting_dimensions":\[(?P<dims>[^\]]*)\]')


def _body_matmul_flops(text: str) -> float:
  """FLOPs of one computation's matmuls: ``dot`` instructions and XLA:GPU's cuBLAS calls
  (2 x output elements x contracted elements)."""
  types = {m["name"]: m["type"] for m in hlo._INSTRUCTION.finditer(text)}
  return sum(instruction_matmul_flops(line, types) for line in text.splitlines())


_CONV_LABELS = re.compile(r"dim_labels=\w+_(?P<rhs>\w+)->")


def instruction_matmul_flops(line: str, types: dict[str, str]) -> float:
  """FLOPs of one instruction line if it is a matmul (``dot``, a cuBLAS call) or a
  ``convolution``, else 0; ``types``: the computation's instruction names -> types (an
  operand's shape)."""
  m = hlo._INSTRUCTION.match(line)
  if not m:
    return 0.0
  rest = line[m.end():]
  if m["op"] == "convolution":
    return _convolution_flops(m, rest, types)
  if m["op"] == "dot":
    dims = _DOT.search(rest)
  elif m["op"] == "custom-call" and _GEMM.search(rest):
    dims = _GEMM_DOT.search(rest)
  else:
    return 0.0
  first = m["operands"].split(",")[0].strip()
  lhs = hlo._ARRAY.search(first) or hlo._ARRAY.search(types.get(first.lstrip("%"), ""))
  out = hlo._ARRAY.search(m["type"])
  if not (out and lhs and dims):
    return 0.0
  shape = [int(d) for d in lhs["dims"].split(",") if d]
  contracted = math.prod(shape[int(d.strip('" '))] for d in dims["dims"].split(",")
                         if d.strip('" '))
  return 2.0 * math.prod(int(d) for d in out["dims"].split(",") if d) * contracted


def _convolution_flops(m: re.Match, rest: str, types: dict[str, str]) -> float:
  """2 x output elements x what each one contracts: the kernel's elements over its output
  features (its window times its input features per group)."""
  operands = [o.strip() for o in m["operands"].split(",")]
  labels = _CONV_LABELS.search(rest)
  rhs = (hlo._ARRAY.search(operands[1]) or hlo._ARRAY.search(types.get(operands[1].lstrip("%"), ""))
         if len(operands) > 1 else None)
  out = hlo._ARRAY.search(m["type"])
  if not (out and rhs and labels and "o" in labels["rhs"]):
    return 0.0
  kernel = [int(d) for d in rhs["dims"].split(",") if d]
  contracted = math.prod(kernel) // kernel[labels["rhs"].index("o")]
  return 2.0 * math.prod(int(d) for d in out["dims"].split(",") if d) * contracted


def _matmul_runs(hlo_text: str) -> list[tuple[float, int, int]]:
  """Per computation with matmuls: (their FLOPs, runs per step with loop trips, runs counting
  each loop body once)."""
  bodies, entry, callers = hlo._computations(hlo_text)

  def runs(name: str, trips: bool, seen: dict) -> int:
    if name == entry:
      return 1
    if name not in seen:
      seen[name] = 0
      seen[name] = sum(runs(c, trips, seen) * (t if trips else 1)
                       for c, t, _ in callers.get(name, ()))
    return seen[name]

  with_trips, once, out = {}, {}, []
  for name, lines in bodies.items():
    flops = _body_matmul_flops("\n".join(lines))
    if flops:
      out.append((flops, runs(name, True, with_trips), runs(name, False, once)))
  return out


def loop_matmul_flops(hlo_text: str) -> float:
  """FLOPs of the matmuls in loop bodies, times the iterations beyond the first."""
  return sum(f * (trips - once) for f, trips, once in _matmul_runs(hlo_text))


def matmul_flops(hlo_text: str) -> float:
  """FLOPs of every matmul one run of the program executes (loop bodies times their trips):
  what a step computes where ``cost_analysis()`` has nothing (a compile-only GPU)."""
  return sum(f * trips for f, trips, _ in _matmul_runs(hlo_text))
