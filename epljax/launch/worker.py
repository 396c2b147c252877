"""A running worker's side of the launcher: progress heartbeats, preemption, failing fast.

- ``heartbeat()``: ``Trainer.train_step`` reports each step; the launcher's ``--hang_timeout``
  reads it (the file named by ``EPL_HEARTBEAT_FILE``: the step count, rewritten at most every
  ``HEARTBEAT_EVERY_S``, one ``pwrite`` and nothing else).
- ``stop_requested(step)``: True, on every worker at the same step, once the job was asked to
  stop (SIGTERM from the launcher, i.e. a preemption): save a checkpoint and exit.
- ``fail_fast()``: once the workers are connected (``epl.init``), an uncaught exception ends
  the process at once with status 1 (130 for Ctrl-C) instead of waiting in JAX's shutdown
  barrier for workers that are themselves blocked in a collective waiting for this one. The
  launcher's script runner (``run_script``) does the same for ``sys.exit(non-zero)``.
"""

from __future__ import annotations

import os
import signal
import sys
import time

HEARTBEAT = "EPL_HEARTBEAT_FILE"
HEARTBEAT_EVERY_S = 0.1


class _Beat:
  fd: int | None = None
  path: str | None = None
  steps = 0
  due = 0.0


def heartbeat() -> None:
  """One training step was dispatched: tells the launcher (throttled; a no-op outside it)."""
  _Beat.steps += 1
  if _Beat.fd is None:
    return
  now = time.monotonic()
  if now >= _Beat.due:
    _Beat.due = now + HEARTBEAT_EVERY_S
    os.pwrite(_Beat.fd, b"%-20d\n" % _Beat.steps, 0)


def open_heartbeat(environ=os.environ) -> None:
  """Opens the launcher's heartbeat file (``epl.init`` calls this; again is harmless)."""
  path = environ.get(HEARTBEAT)
  if path and path != _Beat.path:
    _Beat.fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    _Beat.path = path


_stop_signal: list[int] = []


def stop_requested(step: int) -> bool:
  """Whether to save and stop now: True at the same ``step`` on every worker once the launcher
  forwarded SIGTERM (a preemption) or SIGINT. Call it at every step, on every worker, with the
  same step numbers.

  In a multi-process job this is JAX's preemption sync point (JAX catches SIGTERM once the
  workers are connected and agrees on the step); in a single process, SIGTERM sets a flag
  (``watch_stop_signals``, installed by ``epl.init`` under the launcher).
  """
  import jax
  from jax.experimental import multihost_utils
  if jax.process_count() > 1:
    return multihost_utils.reached_preemption_sync_point(step)
  return bool(_stop_signal)


def watch_stop_signals() -> None:
  """A single launched worker: SIGTERM sets ``stop_requested`` instead of killing at once (what
  JAX's preemption notifier does in a multi-process job)."""
  def on_term(signum, _frame):
    _stop_signal.append(signum)
  signal.signal(signal.SIGTERM, on_term)


_connected = False


def fail_fast() -> None:
  """After ``jax.distributed.initialize``: an uncaught exception exits at once (module doc)."""
  global _connected
  if _connected or sys.flags.interactive:
    return
  _connected = True
  previous = sys.excepthook

  def hook(kind, value, tb):
    previous(kind, value, tb)
    exit_now(130 if issubclass(kind, KeyboardInterrupt) else 1)

  sys.excepthook = hook


def connected() -> bool:
  return _connected


def exit_now(code: int) -> None:
  """Ends this process with ``code`` without JAX's shutdown barrier (output flushed first)."""
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError, AttributeError):
      pass
  os._exit(code)
