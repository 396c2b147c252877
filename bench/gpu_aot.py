"""Compile-only GPUs for the benchmarks: XLA:GPU compiles for H100s on a machine without one.

jax compiles ahead of time for devices it does not have (``jax.experimental.topologies``, the
"deviceless" compile): with the CUDA plugin installed, a topology of compile-only H100s stands
in for ``jax.devices()`` while epljax plans and compiles. Nothing can run on them: read
``memory_analysis()``, ``cost_analysis()`` and the HLO. Set up once:

    pip install "jax[cuda12]==$(python -c 'import jax; print(jax.__version__)')"
    export JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1   # no GPU to check or start
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import jax

# Read when the CUDA plugin loads, at jax's first backend: a machine without a GPU has no CUDA
# driver to check. Import this module before anything asks jax for devices.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


def h100s(topology: str = "1x1x8") -> list:
  """Compile-only H100s: ``topology`` is slices x hosts x GPUs per host ("1x2x4": 2 hosts of 4);
  ``epl.topology`` (its XLA:GPU description of the H100 SXM) for the benches' spelling."""
  import epljax as epl

  _, hosts, per_host = (int(n) for n in topology.split("x"))
  return epl.topology("h100", hosts=hosts, per_host=per_host)


@contextlib.contextmanager
def as_devices(devices: list) -> Iterator[None]:
  """``jax.devices()`` returns ``devices`` inside: call ``epl.init`` and build trainers here."""
  saved = jax.devices
  jax.devices = lambda *args, **kwargs: list(devices)
  try:
    yield
  finally:
    jax.devices = saved

