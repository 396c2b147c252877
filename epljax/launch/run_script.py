"""How the launcher runs a ``.py`` SCRIPT: ``python run_script.py SCRIPT ARGS...``.

The script runs as ``__main__`` with ``sys.argv == [SCRIPT, *ARGS]`` and its own directory
first on ``sys.path``, as ``python SCRIPT ARGS`` would. One difference: in a worker whose
``epl.init()`` connected the workers, ``sys.exit(non-zero)`` ends the process at once, without
JAX's shutdown barrier (where it would wait minutes for workers that are blocked in a
collective waiting for this one); ``epljax.launch.worker.fail_fast`` does the same for an
uncaught exception.

In a job of several workers, a script that starts JAX without ``epl.init()`` (or
``jax.distributed.initialize()``) gets a warning naming it and the fix (``ALONE``): each of its
workers would otherwise train alone on its own devices without a word. A thread watches for
JAX's backend to start (``_watch_alone``), and the end of the script is checked once more.

This file is run by path and imports nothing from epljax itself, so a script that never uses
JAX starts as fast as with plain ``python``.
"""

import os
import runpy
import sys
import threading
import time

NUM_WORKERS, WORKER_INDEX = "EPL_NUM_WORKERS", "EPL_WORKER_INDEX"   # as epljax.launch.runtime
WATCH_EVERY_S = 0.5

ALONE = """\
epljax.launch: warning: {script} started JAX without epl.init(), so nothing connects the
{n} workers: this one (worker {index}) and each other trains alone on its own devices. Call
epl.init() at the top of {script}, before anything touches JAX's devices:

    import epljax as epl
    epl.init()     # connects the workers (jax.distributed); or jax.distributed.initialize()"""


def _status(code) -> int:
  """The exit status Python gives ``SystemExit(code)`` (printing a message code as it does)."""
  if code is None:
    return 0
  if isinstance(code, int):
    return code & 0xFF
  print(code, file=sys.stderr)
  return 1


def main() -> None:
  if len(sys.argv) < 2:
    sys.exit("usage: python run_script.py SCRIPT [ARGS...]")
  script = sys.argv[1]
  sys.argv = sys.argv[1:]
  sys.path[0] = os.path.dirname(os.path.abspath(script))
  warned = _watch_alone(script)
  try:
    try:
      runpy.run_path(script, run_name="__main__")
    finally:
      _warn_if_alone(script, warned)     # a script too short for the thread to see it
  except SystemExit as e:
    worker = sys.modules.get("epljax.launch.worker")
    if worker is not None and worker.connected():
      status = _status(e.code)
      if status:
        worker.exit_now(status)
    raise
  except KeyboardInterrupt:
    raise
  except BaseException as e:  # noqa: BLE001 (printed as Python would, from the script's frame)
    tb = _from_script(e.__traceback__, script)
    sys.excepthook(type(e), e.with_traceback(tb), tb)
    sys.exit(1)


def _alone() -> bool | None:
  """Whether JAX started its backend without jax.distributed (None: JAX not started yet)."""
  jax, bridge = sys.modules.get("jax"), sys.modules.get("jax._src.xla_bridge")
  try:
    if jax is None or bridge is None or not bridge.backends_are_initialized():
      return None
    return not jax.distributed.is_initialized()
  except Exception:   # noqa: BLE001 (jax half imported, or another version: ask again later)
    return None


_WARNING = threading.Lock()     # the watching thread and the end of the script: one warning


def _warn_if_alone(script: str, warned: threading.Event) -> None:
  with _WARNING:
    if warned.is_set() or not _alone():
      return
    warned.set()
  print(ALONE.format(script=script, n=os.environ[NUM_WORKERS],
                     index=os.environ.get(WORKER_INDEX, "?")), file=sys.stderr, flush=True)


def _watch_alone(script: str) -> threading.Event:
  """In a job of several workers: a thread that warns (``ALONE``) once JAX's backend started
  without ``jax.distributed``, and ends when it started with it. Returns the warned flag."""
  warned = threading.Event()
  try:
    several = int(os.environ.get(NUM_WORKERS, "1")) > 1
  except ValueError:
    several = False
  if not several:
    warned.set()        # nothing to warn about
    return warned

  def watch():
    while not warned.is_set():
      alone = _alone()
      if alone is not None:
        if alone:
          _warn_if_alone(script, warned)
        return
      time.sleep(WATCH_EVERY_S)

  threading.Thread(target=watch, name="epljax-alone-check", daemon=True).start()
  return warned


def _from_script(tb, script: str):
  """The traceback from the script's first frame on (without this runner and runpy)."""
  start = tb
  while start is not None and start.tb_frame.f_code.co_filename != script:
    start = start.tb_next
  return start or tb


if __name__ == "__main__":
  main()
