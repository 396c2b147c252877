"""``python -m epljax.config``: print every configuration key."""

from epljax.config import describe

print(describe())
