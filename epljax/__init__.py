"""epljax: EPL's parallelism annotations for JAX and Flax.

    import epljax as epl
    epl.init()
    epl.set_default_strategy(epl.replicate(1))
    trainer = epl.Trainer(init_fn, loss_fn, optax.adamw(1e-3))

See README.md for the whole picture; each name below documents itself.
"""

from importlib import metadata as _metadata

from epljax import hlo, io, nn
from epljax.checkpoint import Checkpointer
from epljax.config import Config
from epljax.env import Cluster, Env, init
from epljax.errors import (CheckpointError, ConfigError, EPLError, NonFiniteError, PlanError,
                           ScopeError, StateError)
from epljax.memory.remat import GradientCheckError, add_to_collection
from epljax.mesh.topology import topology
from epljax.metrics import MetricsWriter
from epljax.plan import Plan
from epljax.progress import Progress, progress
from epljax.sharding.annotations import annotate
from epljax.sharding.constraints import mesh_axis_rules
from epljax.step import TrainState
from epljax.strategy import TaskGraph, replicate, set_default_strategy, split
from epljax.train import Trainer

# The version is written once, in pyproject.toml; a checkout on sys.path that was never
# installed has no metadata to read.
try:
  __version__ = _metadata.version("epljax")
except _metadata.PackageNotFoundError:
  __version__ = "0+unknown"

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "Cluster",
    "Config",
    "ConfigError",
    "EPLError",
    "Env",
    "GradientCheckError",
    "MetricsWriter",
    "NonFiniteError",
    "Plan",
    "PlanError",
    "Progress",
    "ScopeError",
    "StateError",
    "TaskGraph",
    "TrainState",
    "Trainer",
    "add_to_collection",
    "annotate",
    "hlo",
    "init",
    "io",
    "mesh_axis_rules",
    "nn",
    "progress",
    "replicate",
    "set_default_strategy",
    "split",
    "topology",
]
