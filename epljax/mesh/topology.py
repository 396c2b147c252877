"""``epl.topology``: compile-only devices of a cluster you do not have.

XLA compiles for devices it does not have (``jax.experimental.topologies``): with the CUDA
plugin installed, ``topology("h100", hosts=8, per_host=8)`` gives 64 H100s in 8 hosts (each
device's ``process_index`` is its host) that ``epl.init(config, devices=...)`` plans for and
``trainer.compile(batch)`` compiles for. Nothing can run on them: the plan reads
``memory_analysis()``, ``cost_analysis()`` and the collectives of the compiled program.

>>> devices = epl.topology("h100", hosts=8, per_host=8)     # doctest: +SKIP
>>> epl.init({"zero.level": "v3"}, devices=devices)
>>> print(trainer.compile(batch))                            # the plan for 64 H100s
"""

from __future__ import annotations

import os

import jax

from epljax import chips
from epljax.errors import ConfigError, EPLError

# XLA:GPU's view of each chip (its cost model and autotuner read it) is the chip table's
# (``chips.XlaGpu``, and the memory a device offers, ``chips.Spec.memory_bytes``); these limits
# are the same for each of its GPUs (CUDA's device queries).
_GPU_LIMITS = """
  threads_per_block_limit: 1024
  threads_per_warp: 32
  threads_per_core_limit: 2048
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  shared_memory_per_block: 49152
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535"""
_GPUS = {kind: chips.spec_named(name) for kind, name in
         (("a100", "A100"), ("h100", "H100"), ("h800", "H800"), ("h200", "H200"),
          ("b200", "B200"))}
_TPUS = ("v4", "v5e", "v5p", "v6e")
KINDS = (*_GPUS, *_TPUS)

_NO_PLUGIN = """\
epl.topology({kind!r}) compiles for {what} without having them, which needs the {plugin} of
jax {version} ({error}). Install it{where} with

    {install}

{alone}No {what} are needed: the compile runs on this machine's CPU."""


def topology(kind: str, hosts: int = 1, per_host: int = 8) -> list[jax.Device]:
  """``hosts`` x ``per_host`` compile-only devices of ``kind`` (``KINDS``: h100, h200, h800,
  a100, b200; TPU kinds where libtpu is installed), host ``h``'s devices with
  ``process_index == h``. Pass them to ``epl.init(config, devices=...)``."""
  name = str(kind).lower()
  if name not in KINDS:
    raise ConfigError(f"epl.topology({kind!r}): unknown kind; use one of {', '.join(KINDS)}.")
  for what, n in (("hosts", hosts), ("per_host", per_host)):
    if not isinstance(n, int) or n < 1:
      raise ConfigError(f"epl.topology({kind!r}, {what}={n!r}): a positive int is needed.")
  from jax._src import xla_bridge
  from jax.experimental import topologies

  if not xla_bridge.backends_are_initialized():
    # No GPU here to start a CUDA backend on: the compile-only devices need none.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    jax.config.update("jax_platforms", os.environ.get("JAX_PLATFORMS") or "cpu")
  try:
    if name in _GPUS:
      desc = topologies.get_topology_desc(name, "cuda", target_config=_target(name),
                                          topology=f"1x{hosts}x{per_host}")
    else:
      desc = topologies.get_topology_desc(platform="tpu", topology_name=f"{name}:{hosts}x"
                                          f"{per_host}")
  except (NotImplementedError, RuntimeError, ValueError, ImportError) as e:
    gpu = name in _GPUS
    raise EPLError(_NO_PLUGIN.format(
        kind=kind, what="GPUs" if gpu else "TPUs", version=jax.__version__,
        plugin="CUDA plugin" if gpu else "TPU runtime (libtpu)",
        # no package index has epljax: its extra installs from the repository
        where=" (in epljax's repository)" if gpu else "",
        install=('pip install -e ".[cuda12]"' if gpu
                 else f'pip install "jax[tpu]=={jax.__version__}"'),
        alone=(f'(or jax\'s plugin alone: pip install "jax[cuda12]=={jax.__version__}")\n'
               if gpu else ""),
        error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")) from e
  return list(desc.devices)


def parse(text: str) -> list[jax.Device]:
  """``"h100:8x8"`` (kind:hosts x per host) or ``"h100:8"`` (one host) -> ``topology``."""
  kind, _, shape = text.partition(":")
  parts = shape.lower().split("x") if shape else ["1", "8"]
  if len(parts) == 1:
    parts = ["1", *parts]
  try:
    hosts, per_host = (int(p) for p in parts)
  except ValueError:
    raise ConfigError(f"--topology {text!r}: write KIND:HOSTSxGPUS_PER_HOST, for example "
                      "h100:8x8 (8 hosts of 8 H100s) or h200:8 (one host).") from None
  return topology(kind, hosts=hosts, per_host=per_host)


def _target(kind: str) -> str:
  """XLA:GPU's target config of one ``kind`` of GPU, from the chip table."""
  spec = _GPUS[kind]
  gpu = spec.xla
  major, minor = gpu.compute_capability
  return f"""
gpu_device_info {{
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  core_count: {gpu.sms}
  fpus_per_core: 128
  clock_rate_ghz: {gpu.clock_ghz}
  memory_bandwidth: {int(gpu.memory_bandwidth)}
  device_memory_size: {spec.memory_bytes}
  l2_cache_size: {gpu.l2_bytes}
  shared_memory_per_block_optin: {gpu.shared_per_sm - 1024}
  shared_memory_per_core: {gpu.shared_per_sm}{_GPU_LIMITS}
}}
platform_name: "CUDA"
runtime_version {{ major: 12 minor: 8 }}
dnn_version_info {{ major: 9 minor: 7 }}
device_description_str: "{gpu.device_kind}"
"""
