"""Shared by the benchmarks: paired timing, machine description, RESULTS.md records."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence

import jax


def paired_ratio(first: Callable[[], object], second: Callable[[], object], *, pairs: int,
                 warmup: int = 3) -> dict[str, float]:
  """Times ``first`` and ``second`` alternately; returns medians and the median paired ratio.

  Alternating in one run cancels most of the drift of a shared, noisy machine.
  """
  for _ in range(warmup):
    jax.block_until_ready(first())
    jax.block_until_ready(second())
  a, b = [], []
  for i in range(pairs):
    for fn, out in ((first, a), (second, b)) if i % 2 == 0 else ((second, b), (first, a)):
      start = time.perf_counter()
      jax.block_until_ready(fn())
      out.append(time.perf_counter() - start)
  ratios = [x / y for x, y in zip(a, b)]
  return {"first_s": statistics.median(a), "second_s": statistics.median(b),
          "ratio": statistics.median(ratios),
          "ratio_q1": statistics.quantiles(ratios, n=4)[0],
          "ratio_q3": statistics.quantiles(ratios, n=4)[2]}


def machine() -> str:
  devices = jax.devices()
  kind = devices[0].device_kind
  return (f"{platform.node() or 'host'}: {os.cpu_count()} CPU cores, {len(devices)} x {kind} "
          f"({devices[0].platform}), jax {jax.__version__}")


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
  cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
  widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
  line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
  return "\n".join([line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                   + [line(r) for r in cells[1:]])


def record(title: str, command: str, body: str) -> None:
  """Appends a dated section to bench/RESULTS.md."""
  path = os.path.join(os.path.dirname(__file__), "RESULTS.md")
  stamp = datetime.date.today().isoformat()
  with open(path, "a") as f:
    f.write(f"\n## {title} ({stamp})\n\nMachine: {machine()}  \nCommand: `{command}`\n\n"
            f"{body}\n")
