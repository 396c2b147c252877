"""Devices -> ``jax.sharding.Mesh``: EPL's placement rules (``builder.py``).

The mesh always has the axes ``data`` (model replicas), ``stage`` (pipeline stages) and
``model`` (devices of one task graph inside one replica); unused axes have size 1.
"""

from epljax.mesh.builder import AXES, DATA, MODEL, STAGE, Layout, abstract_mesh, build_mesh

__all__ = ["AXES", "DATA", "MODEL", "STAGE", "Layout", "abstract_mesh", "build_mesh"]
