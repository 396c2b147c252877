"""Memory features: rematerialization, ZeRO, offload, mixed precision, grouped apply.

Each is an ``epljax.features.Feature`` built from its own config section; ``features(config)``
returns those the configuration asks for.
"""

from __future__ import annotations

from epljax.features import Feature


def features(config) -> list[Feature]:
  """The memory features ``config`` (an ``epl.Config``) asks for, in the order they apply."""
  return []
