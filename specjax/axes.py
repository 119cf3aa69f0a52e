"""Logical axis names carried by parameters, activations and caches.

`sharding.py` maps these names to mesh axes with one rules table; nothing else names mesh axes.
"""

BATCH = "batch"
LENGTH = "length"
EMBED = "embed"
HEADS = "heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
MLP = "mlp"
VOCAB = "vocab"
CACHE_BATCH = "cache_batch"
CACHE_LENGTH = "cache_length"
CACHE_KV_HEADS = "cache_kv_heads"
CACHE_HEAD_DIM = "cache_head_dim"
