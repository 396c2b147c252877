"""The pipeline benches' code, run through one script: ``python bench/pipeline.py SUBCOMMAND``.

Each module is one subcommand (``schedule``, ``compile``, ``memory``, ``peak``, ``roll``,
``stash``) with its own ``main(argv)``; ``hand_gpipe`` is the hand-written GPipe they (and
``tests/test_cost.py``) compare epljax with.
"""
