"""Checkpoints: the single-file format (``single_file``), sharded step folders with their
manifests (``folders``), what each rank holds and how it goes through
``torch.distributed.checkpoint`` (``parts``, with its planners in ``planners``), every rank's
random generator states (``rng``), the background writer (``writer``), whether a checkpoint
fits a run (``compat``) and the export to one file (``export``).

May import: config, models, parallel, runtime.
"""
