"""A schedule as text (for the plan) or as a picture (for the README): ticks x stages.

    python -m epljax.pipeline.render docs/pipeline_schedule.png 4 10   # GPipe and 1F1B, S=4, M=10

Each tick of a stage has a forward slot (blue, ``F3`` = forward of micro batch 3) and a
backward slot (orange, ``B3``); white is pipeline bubble.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from epljax.errors import EPLError
from epljax.pipeline.schedules import IDLE, NAMES, Schedule, make_schedule


def schedule_text(schedule: Schedule) -> list[str]:
  """One line per stage, one column per tick: ``F2``, ``B0``, ``F3B1`` or ``.``."""
  cells = []
  for s in range(schedule.num_stages):
    row = []
    for t in range(schedule.num_ticks):
      f, b = schedule.forward[t, s], schedule.backward[t, s]
      row.append((f"F{f}" if f != IDLE else "") + (f"B{b}" if b != IDLE else "") or ".")
    cells.append(row)
  width = max(len(c) for row in cells for c in row)
  return [f"stage {s}  " + " ".join(c.ljust(width) for c in row).rstrip()
          for s, row in enumerate(cells)]


def render_schedule(schedules: Schedule | Sequence[Schedule], path: str) -> str:
  """Draws one panel per schedule (ticks across, stages down) into ``path`` (a PNG)."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle
  except ImportError as e:
    raise EPLError("Drawing a schedule needs matplotlib: pip install 'epljax[plot]'.") from e
  if isinstance(schedules, Schedule):
    schedules = [schedules]
  ticks = max(s.num_ticks for s in schedules)
  fig, axes = plt.subplots(len(schedules), 1, squeeze=False,
                           figsize=(0.42 * ticks + 1.5, 1.2 + 0.55 * sum(
                               s.num_stages for s in schedules)))
  colours = {"F": "#4c78a8", "B": "#f58518"}
  for ax, sched in zip(axes[:, 0], schedules):
    for s in range(sched.num_stages):
      for t in range(sched.num_ticks):
        for half, (kind, table) in enumerate((("F", sched.forward), ("B", sched.backward))):
          m = table[t, s]
          x, y = t + 0.5 * half, s
          ax.add_patch(Rectangle((x, y), 0.5, 0.9, facecolor=colours[kind] if m != IDLE else
                                 "white", edgecolor="#bbbbbb", linewidth=0.5))
          if m != IDLE:
            ax.text(x + 0.25, y + 0.45, str(m), ha="center", va="center", color="white",
                    fontsize=7)
    ax.set_xlim(0, ticks)
    ax.set_ylim(sched.num_stages, -0.1)
    ax.set_yticks([s + 0.45 for s in range(sched.num_stages)],
                  [f"stage {s}" for s in range(sched.num_stages)])
    ax.set_xticks(range(0, ticks + 1, 2))
    ax.set_xlabel("tick (forward | backward slot)")
    ax.set_title(f"{sched.strategy} ({NAMES[sched.strategy]}), S={sched.num_stages}, "
                 f"M={sched.num_micro_batch}: {sched.num_ticks} ticks, bubble "
                 f"{sched.bubble_fraction:.0%}, keeps {sched.num_slots} micro batches",
                 fontsize=9, loc="left")
    for side in ("top", "right"):
      ax.spines[side].set_visible(False)
  fig.tight_layout()
  fig.savefig(path, dpi=72)
  plt.close(fig)
  return path


def main(argv: Sequence[str] | None = None) -> None:
  argv = list(sys.argv[1:] if argv is None else argv)
  path = argv[0] if argv else "pipeline_schedule.png"
  stages, micro = (int(argv[1]), int(argv[2])) if len(argv) >= 3 else (4, 10)
  print(render_schedule([make_schedule("PreferForward", stages, micro),
                         make_schedule("PreferBackward", stages, micro)], path))


if __name__ == "__main__":
  main()
