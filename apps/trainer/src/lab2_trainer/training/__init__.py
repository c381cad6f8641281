"""The step and the loop: :func:`step.train_step` (micro-batches, backward, clipping, the
optimizer) and :class:`loop.Trainer`, which runs steps, evaluates, logs and saves.

May import: every subpackage but cli and planner.
"""
