"""From the traced program to shardings.

``program.py`` flattens a jaxpr across call boundaries; ``capture.py`` tags every equation and
parameter with its task graph (``annotations.py``: ``epl.annotate`` rules and Flax metadata);
``split_rules.py`` decides each split parameter's dimension from the data flow, with
``dims.py`` saying how a split dimension travels through one equation; ``specs.py`` turns it
all into ``PartitionSpec``s.
"""
