"""A reward module that ends its process while being imported (tests: the trainer must survive it)."""
import os

os._exit(7)


def never(completions, **kwargs):  # pragma: no cover - the import never gets here
    return [0.0] * len(completions)
