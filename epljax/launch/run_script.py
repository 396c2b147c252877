"""How the launcher runs a ``.py`` SCRIPT: ``python run_script.py SCRIPT ARGS...``.

The script runs as ``__main__`` with ``sys.argv == [SCRIPT, *ARGS]`` and its own directory
first on ``sys.path``, as ``python SCRIPT ARGS`` would. One difference: in a worker whose
``epl.init()`` connected the workers, ``sys.exit(non-zero)`` ends the process at once, without
JAX's shutdown barrier (where it would wait minutes for workers that are blocked in a
collective waiting for this one); ``epljax.launch.worker.fail_fast`` does the same for an
uncaught exception.

This file is run by path and imports nothing from epljax itself, so a script that never uses
JAX starts as fast as with plain ``python``.
"""

import os
import runpy
import sys


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
  try:
    runpy.run_path(script, run_name="__main__")
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


def _from_script(tb, script: str):
  """The traceback from the script's first frame on (without this runner and runpy)."""
  start = tb
  while start is not None and start.tb_frame.f_code.co_filename != script:
    start = start.tb_next
  return start or tb


if __name__ == "__main__":
  main()
