"""What the launcher keeps and shows of the workers' output.

- ``rotate(path)``: a new run in the same ``--log_dir`` keeps the earlier runs' logs:
  ``worker_0.log`` becomes ``worker_0.log.1``, ``.1`` becomes ``.2``, and so on up to ``KEEP``
  (the oldest beyond it is removed). A crashed run's traceback survives the resume.
- ``quiet(line)``: the console shows a worker's line without the libraries' routine messages
  (``NOISE``: Gloo's connection lines, JAX's runtime telling that it caught the launcher's
  SIGTERM, absl's note about its own log), which say nothing about the training and repeat per
  worker and per device group. ``--debug`` shows them; the log files always keep every line.
"""

from __future__ import annotations

import os
import re

KEEP = 9     # earlier runs kept per worker: worker_<i>.log.1 (the last) .. .9

# Each pattern matches one message, wherever it starts in a line (a progress bar redrawn
# without a newline may precede it); what else the line holds stays.
NOISE = (
    # gloo (CPU collectives across processes), per process group and peer; its threads
    # interleave, so a line can hold "[Gloo] Rank " alone and the next the rest of the message
    re.compile(r"(?:(?:\[Gloo\] )?Rank )?\d+ is connected to \d+ peer ranks\. Expected "
               r"number of connected peer ranks is : \d+"),
    re.compile(r"\[Gloo\] Rank (?!\d)"),
    # JAX's preemption notifier (glog), when the launcher stops a worker
    re.compile(r"[IW]\d{4} [\d:.]+ +\d+ preemption_notifier\.cc:\d+\] SIGTERM caught at \S+"),
    re.compile(r"WARNING: All log messages before absl::InitializeLog\(\) is called are "
               r"written to STDERR"),
)


def rotate(path: str, keep: int = KEEP) -> None:
  """Moves an earlier run's ``path`` to ``path.1``, ``path.1`` to ``path.2``, ... (module doc)."""
  if not os.path.exists(path):
    return
  oldest = f"{path}.{keep}"
  if os.path.exists(oldest):
    os.remove(oldest)
  for n in range(keep - 1, 0, -1):
    if os.path.exists(f"{path}.{n}"):
      os.replace(f"{path}.{n}", f"{path}.{n + 1}")
  os.replace(path, f"{path}.1")


def quiet(line: str) -> str | None:
  """``line`` without the library messages of ``NOISE``; None when nothing else was in it."""
  for pattern in NOISE:
    if pattern.search(line):
      line = pattern.sub("", line)
      if not line.strip():
        return None
  return line
