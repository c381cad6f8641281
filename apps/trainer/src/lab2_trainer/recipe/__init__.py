"""The training recipe: defaults from the model's shape (``defaults``: learning rate, warm-up,
initialisation, each preset's own run), the learning-rate schedule (``schedule``), Muon's
rules (``muon``) and the ranks' layout (``layout``: sharding kinds and DDP wrappers, their
defaults and pairings, what ``--tp`` can cut). No torch.

May import: nothing of the trainer.
"""
