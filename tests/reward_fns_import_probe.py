"""A reward module that records its import in an environment-independent way: tests check it is never imported in
the trainer (test) process, only in the reward worker."""
import os

IMPORTED_IN = os.getpid()


def probe(completions, **kwargs):
    return [float(IMPORTED_IN)] * len(completions)
