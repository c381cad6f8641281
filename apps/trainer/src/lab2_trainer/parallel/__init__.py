"""How a model is laid over the ranks: :func:`parallelize.parallelize` applies a run's
compilation and sharding kind (DDP, zero1's stages, FSDP2) to a bare model, in one function.

May import: config, models.
"""
