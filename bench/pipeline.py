"""The pipeline benches, one script: ``python bench/pipeline.py SUBCOMMAND [options] [--record]``.

    schedule   GPipe and 1F1B against the model data-parallel: temp memory, executed FLOPs,
               step time (--interleaved, --interleaved-scan: interleaved 1F1B; --memory: the
               1F1B stash against S - s)
    compile    compile cost: --depth (against a hand-written GPipe), --split (lower against
               XLA compile), --roll [--scan] (roll_layers off and on), --baseline LAYERS [--gpu]
               (a Python-loop GPT: hand-written GPipe, plain jax.jit, epljax)
    memory     bytes per device against a hand-written GPipe, both param_layouts [--gpu]
    peak       what is live at a step's peak, epljax's and the hand-written GPipe's [--gpu]
    roll       rolled stages' temp against the same layers written out [--gpu]
    stash      tensor-parallel stages: residuals stashed in slots against inputs kept [--zoo]

``--gpu`` compiles for 8 compile-only H100s (jax's CUDA plugin, ``JAX_PLATFORMS=cpu``; see
``gpu_aot.py``); otherwise XLA:CPU with 8 simulated devices. ``python bench/pipeline.py
SUBCOMMAND --help`` lists a subcommand's options. The code is in ``bench/pipelines/``.
"""

from __future__ import annotations

import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SUBCOMMANDS = ("schedule", "compile", "memory", "peak", "roll", "stash")


def module_of(subcommand: str, rest: list[str]) -> str:
  """The module of ``bench/pipelines`` that runs ``subcommand``: ``compile --depth`` and
  ``compile --split`` measure ``schedule.py``'s model, so they run there."""
  if subcommand == "compile" and {"--depth", "--split"} & set(rest):
    return "schedule"
  return subcommand


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if not argv or argv[0] not in SUBCOMMANDS:
    print(__doc__, file=sys.stderr)
    return 0 if argv[:1] in (["-h"], ["--help"]) else 2
  subcommand, rest = argv[0], argv[1:]
  # Imported before anything else starts jax: ``peak`` sets XLA's dump flags at import.
  module = importlib.import_module(f"pipelines.{module_of(subcommand, rest)}")
  import common

  common.SUBCOMMAND[:] = [subcommand]    # a record's command names it
  module.main(rest)
  return 0


if __name__ == "__main__":
  sys.exit(main())
