"""The model: the decoder-only Transformer (``transformer``), its KV cache for decoding
(``kv_cache``), its blocks' matrix products in float8 (``float8``, through torchao), and
arithmetic on its shape without torch (``shapes``: parameters, FLOPs per token, bytes of the
training state), which the planner, the checks and the report count with.

May import: config, recipe.
"""
