"""A schedule as text (for the plan) or as a picture (for the README): ticks x stages.

    python -m epljax.pipeline.render docs/pipeline_schedule.png 4 8 2   # S=4, M=8, v=2

draws GPipe, 1F1B and interleaved 1F1B (``v`` chunks per stage) one above the other. Each
tick of a stage has a forward slot (blue, ``3`` = micro batch 3) and a backward slot (orange);
with virtual stages the shade tells the stage's chunk (dark: its first). The x axis is time
with a stage's whole forward and backward taking 1 each (a chunk's ``1/v``), and a lockstep
tick as long as its busiest stage, so white is pipeline bubble and the panels compare.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np

from epljax.errors import EPLError
from epljax.pipeline.schedules import IDLE, Schedule, make_schedule

_FORWARD = ("#2f5f8f", "#6a9fd0", "#a9c9ea", "#d3e4f5")   # chunk 0, 1, ... (then repeat)
_BACKWARD = ("#d26a0c", "#f5a04e", "#f8c48f", "#fbe1c6")


def schedule_text(schedule: Schedule) -> list[str]:
  """One line per stage, one column per tick: ``F2``, ``B0``, ``F3B1`` or ``.``; with virtual
  stages ``F2.1`` is micro batch 2 on the stage's chunk 1 (model chunk ``s + S``)."""
  chunked = schedule.num_virtual_stages > 1

  def cell(kind, m, j):
    return "" if m == IDLE else f"{kind}{m}" + (f".{j}" if chunked else "")

  cells = []
  for s in range(schedule.num_stages):
    row = []
    for t in range(schedule.num_ticks):
      row.append(cell("F", schedule.forward[t, s], schedule.forward_chunk[t, s])
                 + cell("B", schedule.backward[t, s], schedule.backward_chunk[t, s]) or ".")
    cells.append(row)
  width = max(len(c) for row in cells for c in row)
  return [f"stage {s}  " + " ".join(c.ljust(width) for c in row).rstrip()
          for s, row in enumerate(cells)]


def render_schedule(schedules: Schedule | Sequence[Schedule], path: str) -> str:
  """Draws one panel per schedule (time across, stages down) into ``path`` (a PNG)."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle
  except ImportError as e:
    raise EPLError("Drawing a schedule needs matplotlib: pip install -e '.[plot]' in epljax's "
                   "repository (or pip install matplotlib).") from e
  if isinstance(schedules, Schedule):
    schedules = [schedules]
  span = max(float(s.tick_costs().sum()) for s in schedules)
  fig, axes = plt.subplots(len(schedules), 1, squeeze=False,
                           figsize=(0.5 * span + 1.5, 1.2 + 0.6 * sum(
                               s.num_stages for s in schedules)))
  for ax, sched in zip(axes[:, 0], schedules):
    _draw(ax, sched, Rectangle)
    ax.set_xlim(0, span)
    ax.set_ylim(sched.num_stages, -0.1)
    ax.set_yticks([s + 0.45 for s in range(sched.num_stages)],
                  [f"stage {s}" for s in range(sched.num_stages)])
    ax.set_xticks(range(0, int(np.ceil(span)) + 1, 2))
    ax.set_xlabel("time (a stage's forward = backward = 1; a chunk's 1/v)")
    v = sched.num_virtual_stages
    chunks = "" if v == 1 else f", v={v} chunks per stage"
    what = "micro batches" if v == 1 else "chunks"
    ax.set_title(f"{sched.strategy} ({sched.name}), S={sched.num_stages}, "
                 f"M={sched.num_micro_batch}{chunks}: {sched.num_ticks} ticks, bubble "
                 f"{sched.measured_bubble():.0%}, keeps {sched.num_slots} {what}",
                 fontsize=9, loc="left")
    for side in ("top", "right"):
      ax.spines[side].set_visible(False)
  fig.tight_layout()
  fig.savefig(path, dpi=72)
  plt.close(fig)
  return path


def _draw(ax, sched: Schedule, rectangle) -> None:
  v = sched.num_virtual_stages
  starts = np.concatenate([[0.0], np.cumsum(sched.tick_costs())])
  for t in range(sched.num_ticks):
    for s in range(sched.num_stages):
      x = starts[t]
      for table, chunk, colours in ((sched.forward, sched.forward_chunk, _FORWARD),
                                    (sched.backward, sched.backward_chunk, _BACKWARD)):
        m = table[t, s]
        if m == IDLE:
          continue
        j = int(chunk[t, s])
        ax.add_patch(rectangle((x, s), 1 / v, 0.9, facecolor=colours[j % len(colours)],
                               edgecolor="white", linewidth=0.5))
        ax.text(x + 0.5 / v, s + 0.45, str(m), ha="center", va="center", fontsize=7,
                color="white" if j % len(colours) < 2 else "black")
        x += 1 / v
  for s in range(sched.num_stages):   # the bubble, outlined
    ax.add_patch(rectangle((0, s), starts[-1], 0.9, facecolor="none", edgecolor="#bbbbbb",
                           linewidth=0.5))


def main(argv: Sequence[str] | None = None) -> None:
  argv = list(sys.argv[1:] if argv is None else argv)
  path = argv[0] if argv else "pipeline_schedule.png"
  stages, micro, virtual = (int(a) for a in (argv[1:4] + ["4", "8", "2"][len(argv[1:4]):]))
  print(render_schedule([make_schedule("PreferForward", stages, micro),
                         make_schedule("PreferBackward", stages, micro),
                         make_schedule("PreferBackward", stages, micro, virtual)], path))


if __name__ == "__main__":
  main()
