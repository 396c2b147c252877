"""Devices -> ``jax.sharding.Mesh``: EPL's placement rules (``builder.py``).

The mesh always has the axes ``data`` (model replicas), ``stage`` (pipeline stages) and
``model`` (devices of one task graph inside one replica); unused axes have size 1. Hybrid
sharding (``zero.shard_size``) adds ``replica`` in front: the data replicas across ZeRO's groups;
context parallelism (``context.parallel_degree``) adds ``context`` before ``model``.
"""

from epljax.mesh.builder import (AXES, CONTEXT, DATA, HYBRID_AXES, MODEL, REPLICA, STAGE,
                                 Layout, abstract_mesh, build_mesh, data_axes, group_size)

__all__ = ["AXES", "CONTEXT", "DATA", "HYBRID_AXES", "MODEL", "REPLICA", "STAGE", "Layout",
           "abstract_mesh", "build_mesh", "data_axes", "group_size"]
