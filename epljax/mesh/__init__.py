"""Devices -> ``jax.sharding.Mesh``: EPL's placement rules (``builder.py``).

The mesh always has the axes ``data`` (model replicas), ``stage`` (pipeline stages) and
``model`` (devices of one task graph inside one replica); unused axes have size 1. Hybrid
sharding (``zero.shard_size``) adds ``replica`` in front: the data replicas across ZeRO's groups.
"""

from epljax.mesh.builder import (AXES, DATA, HYBRID_AXES, MODEL, REPLICA, STAGE, Layout,
                                 abstract_mesh, build_mesh, data_axes, group_size)

__all__ = ["AXES", "DATA", "HYBRID_AXES", "MODEL", "REPLICA", "STAGE", "Layout", "abstract_mesh",
           "build_mesh", "data_axes", "group_size"]
