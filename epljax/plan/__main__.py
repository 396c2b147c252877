"""``python -m epljax.plan SCRIPT --topology h100:8x8 [ARGS...]`` (``epljax.plan.cli``)."""

import sys

from epljax.plan.cli import run

sys.exit(run())
