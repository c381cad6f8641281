"""How a model is laid over the ranks: :func:`parallelize.parallelize` applies a run's
tensor parallelism (:mod:`tensor`, on the ``dp x tp`` grid of :mod:`mesh`), compilation
and sharding kind (DDP, zero1's stages, FSDP2) to a bare model, in one function; each kind
makes the run's optimizer (:mod:`optimizers`: AdamW, or Muon with AdamW).

May import: config, models, recipe.
"""
