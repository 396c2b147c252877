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

# The H100 SXM (80 GB HBM3) as XLA:GPU's cost model and autotuner see it: 132 SMs at 1.98 GHz,
# 3.35 TB/s, 50 MiB L2, compute capability 9.0.
H100 = """
gpu_device_info {
  cuda_compute_capability { major: 9 minor: 0 }
  core_count: 132
  fpus_per_core: 128
  clock_rate_ghz: 1.98
  memory_bandwidth: 3352320000000
  device_memory_size: 84929347584
  l2_cache_size: 52428800
  threads_per_block_limit: 1024
  threads_per_warp: 32
  threads_per_core_limit: 2048
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
}
platform_name: "CUDA"
runtime_version { major: 12 minor: 8 }
dnn_version_info { major: 9 minor: 7 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""


def h100s(topology: str = "1x1x8") -> list:
  """Compile-only H100s: ``topology`` is slices x hosts x GPUs per host ("1x2x4": 2 hosts of 4)."""
  from jax._src import xla_bridge
  from jax.experimental import topologies

  if not xla_bridge.backends_are_initialized():
    jax.config.update("jax_platforms", "cpu")   # compile-only GPUs: no CUDA backend to start
  try:
    return list(topologies.get_topology_desc("h100", "cuda", target_config=H100,
                                             topology=topology).devices)
  except (NotImplementedError, RuntimeError) as e:
    raise SystemExit(f"No compile-only CUDA devices ({type(e).__name__}: {e}). Install the "
                     "CUDA plugin of this jax (pip install \"jax[cuda12]==" + jax.__version__
                     + "\") and run with JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1."
                     ) from e


@contextlib.contextmanager
def as_devices(devices: list) -> Iterator[None]:
  """``jax.devices()`` returns ``devices`` inside: call ``epl.init`` and build trainers here."""
  saved = jax.devices
  jax.devices = lambda *args, **kwargs: list(devices)
  try:
    yield
  finally:
    jax.devices = saved

