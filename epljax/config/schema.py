"""Every configuration key of EPL, one frozen dataclass per section.

The sections, keys, types and defaults are EPL's (its "Configuration" page); the docs below say
what each key does in epljax. ``allowed`` lists the accepted values of a string key, ``minimum``
the smallest accepted number. Values beyond EPL are marked as such in their doc.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def key(default: Any, doc: str, *, allowed: tuple[Any, ...] | None = None,
        minimum: int | None = None) -> Any:
  """A config field: its default, a one-line doc, and the values it accepts."""
  return dataclasses.field(
      default=default, metadata={"doc": doc, "allowed": allowed, "minimum": minimum})


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  num_micro_batch: int = key(
      1, "Micro batches per model replica per step: pipeline micro batches, or gradient "
      "accumulation when the model has one task graph.", minimum=1)
  num_stages: int | None = key(
      None, "With auto.auto_parallel, cut the model into this many pipeline stages.", minimum=1)
  strategy: str = key(
      "PreferBackward", "Pipeline schedule: PreferBackward (1F1B) or PreferForward (GPipe).",
      allowed=("PreferBackward", "PreferForward"))
  num_virtual_stages: int = key(
      1, "Beyond EPL: model chunks per pipeline stage (interleaved schedule, Megatron's "
      "virtual stages). With v > 1 the S*v task graphs (scopes, or auto.auto_parallel's cuts) "
      "are chunks and stage s runs chunks s, s+S, ...: the bubble shrinks to "
      "(S-1)/(v*M+S-1). num_micro_batch must be a multiple of S.", minimum=1)
  roll_layers: bool = key(
      True, "Beyond EPL: run each stage's repeated layers (found by structure) as one "
      "lax.scan over their stacked weights, so its compiled program does not grow with depth. "
      "The stacks are made outside the stage's vjp and kept by no micro batch; a stage whose "
      "layers would need them kept stays unrolled and the plan says why. False: every stage "
      "as written (bench/pipeline.py compile --depth).")
  param_layout: str = key(
      "user", "Beyond EPL: where the train state keeps the stages' parameters and optimizer "
      "state. 'user': the user's tree, each leaf split over stage (any optax optimizer; the "
      "step copies each stage's leaves into its loop's buffers). 'stage': each stage's leaves "
      "whole on its own devices, as its loop reads them (a hand-written GPipe's bytes); the "
      "optimizer runs on those per-stage slots, so it must update each leaf elementwise "
      "(AdamW, SGD, momentum, Lion), which is checked at init from its state.",
      allowed=("user", "stage"))


@dataclasses.dataclass(frozen=True)
class GradientCheckpointConfig:
  type: str = key(
      "", "Rematerialization: '' (off), 'collection' (keep tensors tagged with "
      "epl.add_to_collection) or 'auto' (blocks found in the traced model's structure: "
      "named layers, loops, scanned layers).",
      allowed=("", "collection", "auto"))
  end_taskgraph: int = key(
      -1, "Apply gradient checkpointing to task graphs 0..end_taskgraph (-1: all).", minimum=-1)
  check_gradients: bool = key(
      False, "On the first step, compare gradients with and without checkpointing; raise if "
      "they differ.")
  offload_activations: bool = key(
      False, "Beyond EPL: copy the activations kept for the backward pass (block boundaries, "
      "carries of scanned layers) to host memory and back when needed "
      "(jax.checkpoint with save_and_offload_only_these_names).")


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
  level: str = key(
      "", "ZeRO: 'v1' shards optimizer state over the data axis; beyond EPL, 'v2' keeps "
      "gradients sharded too and 'v3' shards parameters (FSDP).",
      allowed=("", "v1", "v2", "v3"))
  shard_size: int | str = key(
      "all", "Beyond EPL: the data replicas ZeRO shards over (hybrid sharding, HSDP): 'all' "
      "(one group of every replica), 'host' (the replicas of one host: gathers stay inside "
      "it, one all-reduce of the gradient shards crosses hosts) or an int dividing the "
      "replicas. The mesh then has a 'replica' axis across the groups; see docs/memory.md.")


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
  level: str = key(
      "", "Host offload: 'v0' keeps weights in host memory; beyond EPL, 'v1' keeps the "
      "optimizer state there too.", allowed=("", "v0", "v1"))


@dataclasses.dataclass(frozen=True)
class AmpConfig:
  level: str = key(
      "", "Memory-efficient mixed precision: 'O1' keeps float32 master weights and casts "
      "them to low precision at use.", allowed=("", "O1"))
  debug_log: bool = key(False, "Log loss-scale changes and skipped steps.")
  loss_scale: int | float | str = key(
      "dynamic", "'dynamic' (start 2**15, halve on overflow, double after 2000 good steps) "
      "or a fixed positive number.")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  num_apply_group: int = key(
      1, "Apply the optimizer update in this many size-balanced groups, one after another, "
      "to cut its peak temporary memory.", minimum=1)


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
  device_place_prefer_intra_node: bool = key(
      True, "Place the devices of one model replica on one host.")
  run_visible_devices: str = key(
      "", "Comma-separated device ids this process may use (usually set by the scheduler).")
  colocate_split_and_replicate: bool = key(
      False, "Put split and replicate task graphs on the same devices instead of "
      "different ones.")


@dataclasses.dataclass(frozen=True)
class CommunicationConfig:
  num_communicators: int = key(
      2, "Maps to XLA's collective combining: how many gradient all-reduces may run "
      "concurrently.", minimum=1)
  sparse_as_dense: bool = key(
      False, "Reduce sparse (gathered) gradients as dense tensors. JAX gradients are "
      "always dense, so this is accepted and has no further effect.")
  max_splits: int = key(
      5, "Maps to XLA's collective combining: the most groups gradients are fused into.",
      minimum=1)
  fp16: bool = key(False, "Reduce gradients in half precision.")
  fp16_scale: int = key(
      128, "Gradients are multiplied by this before a half-precision reduction and divided "
      "after it.", minimum=1)
  clip_after_allreduce: bool = key(
      False, "Gradient clipping sees the reduced gradients instead of the local ones.")
  gradients_reduce_method: str = key(
      "mean", "How gradients are combined over replicas: 'mean' or 'sum'.",
      allowed=("mean", "sum"))


@dataclasses.dataclass(frozen=True)
class IOConfig:
  slicing: bool = key(False, "Give each worker its share of the input files.")
  unbalanced_io_slicing: bool = key(
      False, "Allow some workers one file more than others when the files do not divide.")
  drop_last_files: bool = key(
      False, "Drop the files that do not divide evenly over the workers.")


@dataclasses.dataclass(frozen=True)
class AutoConfig:
  auto_parallel: bool = key(
      False, "With pipeline.num_stages: cut the model into that many stages (EPL). Beyond "
      "EPL, without it: search the plan (data x model mesh, micro batches, ZeRO, gradient "
      "checkpointing, offload) by a cost model read from the compiled programs.")
  memory_limit: int = key(
      0, "Beyond EPL: bytes per device a searched plan may use (arguments + outputs - aliased "
      "+ temp of the compiled step); 0: the device's own memory.", minimum=0)
  max_compiles: int = key(
      5, "Beyond EPL: candidate steps the plan search may compile to check its estimates "
      "(each a full compile of that step); fewer trusts the estimates more.", minimum=1)
  peak_flops: int | float = key(
      0.0, "Beyond EPL: the device's peak FLOP/s for the plan search's cost model; 0: the "
      "chip table's (epljax.chips.SPECS).")
  efficiency: int | float = key(
      0.0, "Beyond EPL: the share of peak FLOP/s a step reaches, for the cost model; 0: the "
      "chip table's (0.5).")
  intra_host_bandwidth: int | float = key(
      0.0, "Beyond EPL: bytes/s of one device's links to devices of its host (NVLink, ICI), "
      "for the cost model; 0: the chip table's.")
  inter_host_bandwidth: int | float = key(
      0.0, "Beyond EPL: bytes/s of one device's links to other hosts, for the cost model; 0: "
      "the chip table's.")


@dataclasses.dataclass(frozen=True)
class ContextConfig:
  parallel_degree: int = key(
      1, "Beyond EPL: split every sequence over this many devices (context parallelism), a "
      "mesh axis 'context' beside 'model'. Dimension 1 of each batch leaf with 2+ dimensions "
      "is the sequence; epl.nn.dot_product_attention runs over the axis, everything else "
      "follows GSPMD.", minimum=1)


SECTIONS: dict[str, type] = {
    "pipeline": PipelineConfig,
    "gradient_checkpoint": GradientCheckpointConfig,
    "zero": ZeroConfig,
    "offload": OffloadConfig,
    "amp": AmpConfig,
    "optimizer": OptimizerConfig,
    "cluster": ClusterConfig,
    "communication": CommunicationConfig,
    "io": IOConfig,
    "auto": AutoConfig,
    "context": ContextConfig,
}
