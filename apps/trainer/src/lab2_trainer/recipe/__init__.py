"""The training recipe: defaults from the model's shape (``defaults``: learning rate, warm-up,
initialisation, each preset's own run) and the learning-rate schedule (``schedule``). No torch.

May import: nothing of the trainer.
"""
