"""From the traced program to shardings.

``program.py`` flattens a jaxpr across call boundaries; ``capture.py`` tags every equation and
parameter with its task graph; ``specs.py`` turns task graphs into ``PartitionSpec``s.
"""
