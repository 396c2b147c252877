"""One table of accelerators and the links between them, each figure with its source.

``SPECS`` holds what a vendor states for a chip (dense bfloat16 and fp8/int8 peaks) and for
the system it usually comes in (the per-device link to devices of the same host, the
per-device link to other hosts, the link to host memory), the memory a device offers, and for
the GPUs ``epl.topology`` compiles for, XLA:GPU's description of one (``XlaGpu``). Bandwidths
are bytes per second in one direction: a datasheet's "900 GB/s bidirectional" NVLink is
450 GB/s here, a "400 Gb/s" NIC per GPU 50 GB/s. ``chip_of`` turns a row into the ``Chip`` the
cost model reads (``epljax.cost``), with the ``auto.*`` overrides; ``peak_flops`` is what the
progress bar's MFU divides by.

Memory is what a device offers, not the datasheet's: where it is known, the total CUDA reports
for the device (``cudaDeviceProp.totalGlobalMem``, as XLA's GPU descriptions record it), which
is what a compile-only device of ``epl.topology`` is described with too: an H100 whose
datasheet says "80 GB" (five 16 GiB HBM stacks) reports 79.1 GiB, the rest kept by the driver.
A plan's "fits" compares against this figure, or, on a running device, against XLA's
``bytes_limit`` (``local_memory_bytes``: the allocator's share of it), which replaces it.

Two figures are not vendor figures and say so: ``LATENCY_S`` (a collective's fixed cost) and
``EFFICIENCY`` (the share of peak a step reaches), fitted as their comments record.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np

from epljax.errors import PlanError

GB, GiB = 1e9, 1 << 30


@dataclasses.dataclass(frozen=True)
class Link:
  """Bytes per second one device sends over a link (one direction), and where it is stated."""
  bytes_per_s: float
  source: str


@dataclasses.dataclass(frozen=True)
class XlaGpu:
  """XLA:GPU's description of a GPU (its cost model and autotuner read it), what a
  compile-only device of ``epl.topology`` is: the figures of NVIDIA's datasheets and CUDA's
  device queries. (Its memory is the ``Spec``'s ``memory_bytes``.)"""
  device_kind: str                   # jax's ``device_kind`` of such a device
  compute_capability: tuple[int, int]
  sms: int                           # streaming multiprocessors
  clock_ghz: float
  memory_bandwidth: float            # bytes per second
  l2_bytes: int
  shared_per_sm: int                 # shared memory per SM, bytes


@dataclasses.dataclass(frozen=True)
class Spec:
  """A chip as its vendor states it, in the system it usually comes in, and the memory one
  device offers (``memory_source`` says where that figure comes from)."""
  name: str
  kinds: tuple[str, ...]     # lower-case substrings of jax's ``device_kind`` that mean it
  bf16_flops: float          # dense (no sparsity)
  low_flops: float | None    # dense fp8 (int8 on TPUs without fp8), None: none
  memory_bytes: int
  source: str
  in_host: Link | None = None      # to the devices of the same host (NVLink, ICI, PCIe)
  across_hosts: Link | None = None  # to devices of other hosts (InfiniBand/RoCE, DCN)
  to_host: Link | None = None      # to its host's memory (PCIe)
  memory_source: str = "the datasheet's memory (no device figure known)"
  xla: XlaGpu | None = None        # for ``epl.topology``'s compile-only devices


# CUDA's total memory of a device (``cudaDeviceProp.totalGlobalMem``) as XLA's GPU descriptions
# record it; a running device's XLA ``bytes_limit`` replaces these.
_H100_MEMORY = 84929347584   # 79.1 GiB of the "80 GB"
_H100_SOURCE = ("CUDA's total of an NVIDIA H100 80GB HBM3, 79.10 GiB, as the XLA:GPU "
                "descriptions used for compile-only H100s state it (openxla's "
                "gpu_specs/h100_sxm.txtpb, from another driver: 79.14 GiB)")
_HOPPER = dict(compute_capability=(9, 0), sms=132, clock_ghz=1.98, l2_bytes=52428800,
               shared_per_sm=233472)


_PCIE5 = Link(64 * GB, "PCIe 5.0 x16: 64 GB/s per direction")
_PCIE4 = Link(32 * GB, "PCIe 4.0 x16: 32 GB/s per direction")
_NDR = Link(50 * GB, "one 400 Gb/s ConnectX-7 InfiniBand NDR NIC per GPU (DGX/HGX H100, "
            "H200 and B200 reference designs)")
_NVLINK4 = Link(450 * GB, "NVLink 4 through NVSwitch: 900 GB/s bidirectional per GPU")

SPECS: tuple[Spec, ...] = (
    Spec("H200", ("h200",), 989e12, 1979e12, 140 * GiB,
         "NVIDIA H200 Tensor Core GPU datasheet (SXM): 989 TFLOPS BF16, 1,979 FP8 dense, "
         "141 GB HBM3e", _NVLINK4, _NDR, _PCIE5,
         memory_source="assumed: 140 GiB, under the datasheet's 141 GB (XLA records no H200)",
         xla=XlaGpu("NVIDIA H200", memory_bandwidth=4800e9, **_HOPPER)),
    Spec("H100 PCIe", ("h100 pcie",), 756e12, 1513e12, 84942979072,
         "NVIDIA H100 datasheet (PCIe): 756 TFLOPS BF16, 1,513 FP8 dense, 80 GB",
         Link(300 * GB, "NVLink bridge: 600 GB/s bidirectional per pair"), _NDR, _PCIE5,
         memory_source="CUDA's total of an NVIDIA H100 PCIe, 79.1 GiB, as XLA's GPU "
         "description of it states (openxla gpu_specs/h100_pcie.txtpb)"),
    Spec("H100", ("h100",), 989e12, 1979e12, _H100_MEMORY,
         "NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOPS BF16, 1,979 FP8 dense, "
         "80 GB HBM3", _NVLINK4, _NDR, _PCIE5, memory_source=_H100_SOURCE,
         xla=XlaGpu("NVIDIA H100 80GB HBM3", memory_bandwidth=3352.32e9, **_HOPPER)),
    Spec("H800", ("h800",), 989e12, 1979e12, _H100_MEMORY,
         "NVIDIA H800 (SXM): the H100's compute and memory, NVLink cut to 400 GB/s "
         "bidirectional",
         Link(200 * GB, "NVLink: 400 GB/s bidirectional per GPU"),
         Link(50 * GB, "DeepSeek-V3 technical report (2024), its H800 nodes: InfiniBand "
              "50 GB/s per GPU"), _PCIE5, memory_source="the H100's: " + _H100_SOURCE,
         xla=XlaGpu("NVIDIA H800", memory_bandwidth=3352.32e9, **_HOPPER)),
    Spec("B200", ("b200",), 2250e12, 4500e12, 191514673152,
         "NVIDIA DGX B200 datasheet: 72 PFLOPS FP8 training (sparse) over 8 GPUs, 1,440 GB; "
         "halved for dense, FP8 -> BF16",
         Link(900 * GB, "NVLink 5: 1.8 TB/s bidirectional per GPU"), _NDR, _PCIE5,
         memory_source="CUDA's total of an NVIDIA B200, 178.4 GiB, as XLA's GPU description "
         "of it states (openxla gpu_specs/b200.txtpb); the datasheet: 180 GB",
         xla=XlaGpu("NVIDIA B200", (10, 0), 148, 1.965, 8000e9, 132120576, 233472)),
    Spec("A100", ("a100", "a800"), 312e12, None, 85100068864,
         "NVIDIA A100 Tensor Core GPU datasheet (SXM 80GB): 312 TFLOPS BF16 dense, no FP8",
         Link(300 * GB, "NVLink 3 through NVSwitch: 600 GB/s bidirectional per GPU"),
         Link(25 * GB, "one 200 Gb/s ConnectX-6 HDR NIC per GPU (DGX A100)"), _PCIE4,
         memory_source="CUDA's total of an NVIDIA A100-SXM4-80GB, 79.3 GiB, as XLA's GPU "
         "description of it states (openxla gpu_specs/a100_sxm_80.txtpb)",
         xla=XlaGpu("NVIDIA A100-SXM4-80GB", (8, 0), 108, 1.41, 2039e9, 41943040, 167936)),
    Spec("L40S", ("l40s",), 362e12, 733e12, 48 * GiB,
         "NVIDIA L40S datasheet: 362 TFLOPS BF16, 733 FP8 dense, 48 GB GDDR6",
         Link(32 * GB, "no NVLink: PCIe 4.0 x16 between GPUs, 32 GB/s per direction"),
         Link(25 * GB, "assumed: one 200 Gb/s NIC per GPU (no reference design states one)"),
         _PCIE4),
    Spec("L4", ("l4",), 121e12, 242e12, 24 * GiB,
         "NVIDIA L4 datasheet: 121 TFLOPS BF16, 242 FP8 dense, 24 GB"),
    Spec("A10", ("a10",), 125e12, None, 24 * GiB, "NVIDIA A10 datasheet: 125 TFLOPS BF16 dense"),
    Spec("V100", ("v100",), 125e12, None, 32 * GiB,
         "NVIDIA V100 datasheet (SXM2): 125 TFLOPS float16 tensor (no bfloat16)"),
    Spec("TPU v6e", ("v6",), 918e12, 1836e12, 32 * GB,
         "Cloud TPU v6e docs: 918 TFLOPs BF16, 1,836 TOPs int8, 32 GB HBM",
         Link(400 * GB, "Cloud TPU v6e docs: ICI 800 GBps bidirectional per chip"),
         Link(25e9 / 8, "assumed as v5e's: 2 x 100 Gbps NICs per host of 8 chips"), _PCIE5),
    Spec("TPU v5e", ("v5 lite", "v5e"), 197e12, 393e12, 16 * GB,
         "Cloud TPU v5e docs: 197 TFLOPs BF16, 393 TOPs int8, 16 GB HBM2",
         Link(200 * GB, "Cloud TPU v5e docs: ICI 400 GBps bidirectional per chip"),
         Link(25e9 / 8, "Cloud TPU v5e docs: 2 x 100 Gbps NICs per host of 8 chips"), _PCIE4),
    Spec("TPU v5p", ("v5p", "v5"), 459e12, 459e12, 95 * GiB,
         "Cloud TPU v5p docs: 459 TFLOPs BF16 and FP8, 95 GiB HBM2e",
         Link(600 * GB, "Cloud TPU v5p docs: ICI 1,200 GBps bidirectional per chip"),
         Link(50e9 / 8, "Cloud TPU v5p docs: DCN 50 Gbps per chip"), _PCIE4),
    Spec("TPU v4", ("v4",), 275e12, None, 32 * GiB,
         "Cloud TPU v4 docs: 275 TFLOPs BF16, 32 GiB HBM2"),
)

# A collective's fixed cost, whatever its size: NCCL's ring all-reduce of a few bytes on 8
# H100s over NVLink takes 10-20 us (nccl-tests); 10 us ranks small collectives above free.
LATENCY_S = 10e-6
# The share of peak a well-fed step reaches (MFU). 0.5 is the middle of published large-model
# runs: MaxText's Llama-2-7B on 1-8 H100 hosts at 492-407 TFLOP/s per GPU of 989 (0.50-0.41),
# Megatron-LM's GPT runs at 0.41-0.52 (Narayanan et al. 2021, Korthikanti et al. 2022).
EFFICIENCY = 0.5
# The share of the data axis's collectives (ZeRO's gathers and reduce-scatters, the gradient
# all-reduce) that XLA:GPU's latency-hiding scheduler runs beside the layers' compute, as the
# plan search estimates it before compiling (bounded by the compute there is to hide behind).
# Fitted to the compiled schedules' replay (``epljax.overlap``) of ZeRO v3 steps on compile-only
# H100s that fit in memory (bench/calibrate.py --record; bench/RESULTS.md, "Calibrated against
# published runs"): torchtitan's Llama-3.1-8B FSDP hides 63 of 94 ms (0.671), Llama-2-7B with
# each layer rematerialized 62 of 84 ms (0.735); their mean, 0.703.
OVERLAP = 0.703


@dataclasses.dataclass(frozen=True)
class Chip:
  """What the cost model reads of one device: peak dense FLOP/s, memory, and bytes/s of its
  links to devices of the same host, to other hosts, and to its host's memory."""
  name: str
  peak_flops: float
  memory_bytes: int
  intra_host_bandwidth: float
  inter_host_bandwidth: float
  host_bandwidth: float
  latency_s: float = LATENCY_S
  efficiency: float = EFFICIENCY
  overlap: float = OVERLAP     # (XLA:CPU runs collectives synchronously: 0)


# Simulated devices share one host's cores and memory: figures for tests, which rank plans and
# predict nothing.
CPU = Chip("cpu", 1e11, 16 * GiB, 10 * GB, 1 * GB, 10 * GB, overlap=0.0)


def spec_of(device_kind: str) -> Spec | None:
  """The ``SPECS`` row of a ``device_kind`` ("NVIDIA H100 80GB HBM3"): the first row one of
  whose ``kinds`` it contains (so "H100 PCIe" before "H100", "v5 lite" before "v5"), or
  None."""
  kind = device_kind.lower()
  return next((s for s in SPECS if any(k in kind for k in s.kinds)), None)


def spec_named(name: str) -> Spec:
  """The ``SPECS`` row named ``name`` ("H100")."""
  return next(s for s in SPECS if s.name == name)


def peak_flops(device_kind: str) -> float | None:
  """Dense bfloat16 FLOP/s of a device kind, or None when the table does not know it."""
  spec = spec_of(device_kind)
  return spec.bf16_flops if spec else None


def chip_of(devices, auto_config) -> Chip:
  """The cost model's ``Chip`` for a job's devices (one kind), with the ``auto.*`` overrides.

  Every process reads the same row (``device_kind`` is known for every device). The device
  memory is the table's, or XLA's ``bytes_limit`` of this process's first device where it has
  one (a running GPU): ``agreed_memory`` makes the processes agree on it. An accelerator the
  table does not know needs ``auto.peak_flops`` and the bandwidth keys."""
  devices = list(devices) if isinstance(devices, (list, tuple)) else [devices]
  first = devices[0]
  kind = str(getattr(first, "device_kind", ""))
  if first.platform == "cpu":   # (one simulated device's share of this host's memory)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    chip = dataclasses.replace(CPU, memory_bytes=min(CPU.memory_bytes, total))
  else:
    spec = spec_of(kind)
    if spec is None or spec.in_host is None:
      if not (auto_config.peak_flops and auto_config.intra_host_bandwidth
              and auto_config.inter_host_bandwidth):
        known = ", ".join(s.name for s in SPECS if s.in_host)
        raise PlanError(
            f"epljax has no cost figures for device kind {kind.lower()!r} (known: {known}). Set "
            "auto.peak_flops, auto.intra_host_bandwidth and auto.inter_host_bandwidth (and "
            "auto.memory_limit) for it.")
      spec = spec or dataclasses.replace(spec_named("H100"), name=kind)  # (its memory, PCIe)
    chip = Chip(spec.name, spec.bf16_flops, spec.memory_bytes,
                spec.in_host.bytes_per_s if spec.in_host else 0.0,
                spec.across_hosts.bytes_per_s if spec.across_hosts else 0.0,
                spec.to_host.bytes_per_s if spec.to_host else _PCIE5.bytes_per_s)
  local = local_memory_bytes(devices)
  if local:
    chip = dataclasses.replace(chip, memory_bytes=local)
  overrides = {k: float(getattr(auto_config, k)) for k in
               ("peak_flops", "efficiency", "intra_host_bandwidth", "inter_host_bandwidth")
               if getattr(auto_config, k)}
  bad = [f"auto.{k}={v!r}" for k, v in overrides.items() if not v > 0]
  if bad:
    raise PlanError(f"{', '.join(bad)}: the cost model needs positive figures (0 takes the "
                    "chip table's).")
  return dataclasses.replace(chip, **overrides)


def local_memory_bytes(devices) -> int | None:
  """XLA's ``bytes_limit`` of the first of ``devices`` this process addresses, or None (a
  compile-only device, a backend without memory statistics)."""
  me = jax.process_index()
  mine = [d for d in devices if getattr(d, "process_index", me) == me]
  if not mine:
    return None
  try:
    stats = mine[0].memory_stats()
  except (AttributeError, jax.errors.JaxRuntimeError):
    return None
  return int(stats["bytes_limit"]) if stats and stats.get("bytes_limit") else None


CHIPS: dict[str, Chip] = {
    s.name: Chip(s.name, s.bf16_flops, s.memory_bytes, s.in_host.bytes_per_s,
                 s.across_hosts.bytes_per_s, s.to_host.bytes_per_s)
    for s in SPECS if s.in_host and s.across_hosts and s.to_host}
CHIPS["cpu"] = CPU


def agreed(chip: Chip) -> Chip:
  """``chip`` with the memory every process agrees on: the smallest of the processes' (one
  process's ``bytes_limit`` can differ from another's, and a plan chosen from it would differ
  too: every process must compile the same program). One small all-gather when several."""
  if jax.process_count() == 1:
    return chip
  from jax.experimental import multihost_utils   # (only multi-process jobs need it)

  # (in two 32-bit halves: without jax_enable_x64 a 64-bit integer would be cut to 32 bits)
  halves = np.array([chip.memory_bytes >> 30, chip.memory_bytes & ((1 << 30) - 1)], np.int32)
  gathered = np.asarray(multihost_utils.process_allgather(halves)).reshape(-1, 2)
  memory = min((int(hi) << 30) + int(lo) for hi, lo in gathered)
  return dataclasses.replace(chip, memory_bytes=memory)
