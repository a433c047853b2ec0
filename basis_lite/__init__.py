"""basis-lite: RLVR with LoRA and the BASIS baseline.

Importing the package bounds oneDNN's two shape-keyed caches (unless the environment already sets them), before
torch creates its first oneDNN primitive. Every new matrix shape of a bf16 linear layer on the CPU (each decode
batch size, each micro-batch's padded length, each log-prob chunk) adds an entry of about 0.6 MB to ideep's cache
(LRU_CACHE_CAPACITY) and oneDNN's primitive cache (ONEDNN_PRIMITIVE_CACHE_CAPACITY), 1024 entries each by default.
Training rarely meets the same shape twice, so over a default bf16 job the caches grew by ~380 MB and, allocated
in between the update's activations, fragmented the heap: the job's peak RSS crept up step by step (docs/cpu-performance.md).
128 entries hold every shape a decode step or a micro-batch reuses.
"""
import os as _os

for _name in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
    _os.environ.setdefault(_name, "128")
