"""Models the examples train, importable from an example run from anywhere (an example puts its
own folder, ``examples/``, first on ``sys.path``, as ``python examples/llama.py`` does).

- ``llama``: a Llama-style decoder, layers under ``nn.scan``, Flax logical axis names on every
  parameter, grouped-query attention, SwiGLU, rotary positions; sizes from the CPU's to
  Llama-2-70B.
- ``layers``: pieces written as plain functions (RMSNorm, rotary positions, the language-model
  loss).

The test zoo (``tests/models``) trains the same code: ``tests/models/llama.py`` imports it from
here and adds what the tests expect of it.
"""
