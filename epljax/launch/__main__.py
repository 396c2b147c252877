"""``python -m epljax.launch``: see ``epljax.launch.cli``."""

import sys

from epljax.launch.cli import main

sys.exit(main())
