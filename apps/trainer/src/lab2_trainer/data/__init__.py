"""What the model reads: token streams and the default corpus (``corpus``), and the batches cut
from them and drawn ahead of the step (``batches``).

May import: config, runtime.
"""
