"""``trainer.plan`` and ``python -m epljax.plan``.

``view.py``: the ``Plan`` a Trainer prints; ``verdict.py`` its first section (fits or not,
mesh, predicted step, what crosses hosts, the changes that would fit); ``rows.py`` its
variables table (a stack of layers a row); ``changes.py`` the config changes that would make
it fit, estimated as the plan search estimates; ``render.py`` text and HTML.
``cli.py``: ``python -m epljax.plan SCRIPT --topology h100:8x8 [ARGS]``, a training script
planned for a cluster it does not run on.
"""

from epljax.plan.changes import Change, Rebuild
from epljax.plan.render import html_plan, render_text
from epljax.plan.view import (EVERY_STAGE, Leaf, Plan, StepCollective, leaf_bytes_per_device,
                              search_rows, tree_bytes_per_device)

__all__ = ["EVERY_STAGE", "Change", "Leaf", "Plan", "Rebuild", "StepCollective", "html_plan",
           "leaf_bytes_per_device", "render_text", "search_rows", "tree_bytes_per_device"]
