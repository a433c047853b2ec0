"""``PromptSampler``: endless, resumable batches of training examples in a seeded order.

Its ``state_dict()`` (epoch, position, seed, batch size, example count, a fingerprint of the example ids, one of
their questions and answers, and one of the conversations of conversational rows: everything that reaches a prompt)
is the data position that checkpoints store; ``load_state_dict`` reads it back on resume and raises
DataError when the examples are not the ones it was taken over.
"""
from __future__ import annotations

import hashlib
import json
import logging
import random
from typing import Callable, Iterator, Sequence

from ..errors import DataError
from .example import Example

log = logging.getLogger(__name__)


class PromptSampler:
    """Endless batches of examples: each epoch is a fresh permutation seeded with seed + epoch, and a batch that
    runs past the end of an epoch continues into the next one (every batch is full).

    ``state_dict()`` / ``load_state_dict()`` carry (epoch, position), so a resumed run continues with exactly the
    prompts the interrupted run would have drawn next.

    ``accept`` (optional, example -> probability in (0, 1]): each example the order reaches is kept with that
    probability and otherwise skipped until the next epoch (prompt selection by value, ``data.value_sampling``);
    the coin of the example at (epoch, position) is seeded by (seed, epoch, position), so the draw stays
    resumable as long as ``accept`` gives the same answers (its inputs travel in the checkpoint). ``skipped``
    counts the examples skipped so far (kept in the state)."""

    def __init__(self, examples: Sequence[Example], batch_size: int, seed: int = 0,
                 accept: Callable[[Example], float] | None = None):
        if not examples:
            raise ValueError("PromptSampler: no examples to sample from")
        if batch_size <= 0:
            raise ValueError(f"PromptSampler: batch_size must be > 0, got {batch_size}")
        self.examples = list(examples)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.epoch = 0
        self.position = 0
        self._order_epoch: int | None = None
        self._order: list[int] = []
        self.accept = accept
        self.skipped = 0

    def _order_for(self, epoch: int) -> list[int]:
        if self._order_epoch != epoch:
            order = list(range(len(self.examples)))
            random.Random(self.seed + epoch).shuffle(order)
            self._order, self._order_epoch = order, epoch
        return self._order

    def __iter__(self) -> Iterator[list[Example]]:
        return self

    def __next__(self) -> list[Example]:
        n = len(self.examples)
        batch: list[Example] = []
        while len(batch) < self.batch_size:
            order = self._order_for(self.epoch)
            if self.accept is None:
                take = min(self.batch_size - len(batch), n - self.position)
                batch.extend(self.examples[i] for i in order[self.position:self.position + take])
                self.position += take
            else:
                ex = self.examples[order[self.position]]
                if random.Random(f"{self.seed}/{self.epoch}/{self.position}").random() < self.accept(ex):
                    batch.append(ex)
                else:
                    self.skipped += 1
                self.position += 1
            if self.position >= n:
                self.epoch, self.position = self.epoch + 1, 0
        return batch

    def _fingerprint(self) -> str:
        h = hashlib.sha1()
        for ex in self.examples:
            h.update(ex.id.encode("utf-8", "surrogatepass") + b"\0")
        return h.hexdigest()[:16]

    def _content_fingerprint(self) -> str:
        h = hashlib.sha1()
        for ex in self.examples:
            for part in (ex.id, ex.question, ex.answer):
                h.update(str(part).encode("utf-8", "surrogatepass") + b"\0")
        return h.hexdigest()[:16]

    def _prompt_fingerprint(self) -> str:
        """The conversations of conversational rows (system and earlier messages reach the prompt too)."""
        h = hashlib.sha1()
        for ex in self.examples:
            text = "" if ex.messages is None else json.dumps(ex.messages, ensure_ascii=False, sort_keys=True)
            h.update(text.encode("utf-8", "surrogatepass") + b"\0")
        return h.hexdigest()[:16]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "batch_size": self.batch_size,
                "num_examples": len(self.examples), "fingerprint": self._fingerprint(),
                "content": self._content_fingerprint(), "prompts": self._prompt_fingerprint(),
                "skipped": self.skipped}

    def check_state(self, state: dict, dataset: str = "") -> None:
        """DataError unless `state` was taken over these examples (their count, and their ids, questions and
        answers where the checkpoint recorded them): data that changed between a kill and its resume."""
        what = f"the training data ({dataset})" if dataset else "the training data"
        n = state.get("num_examples", len(self.examples))
        if n != len(self.examples):
            raise DataError(f"{what} changed since the checkpoint: it was taken over {n} examples, the data now "
                            f"gives {len(self.examples)}. A resumed run needs the data it was trained on: put the "
                            f"original data back, or start a new run")
        if state.get("content") not in (None, self._content_fingerprint()) or state.get("fingerprint") not in (
                None, self._fingerprint()) or state.get("prompts") not in (None, self._prompt_fingerprint()):
            raise DataError(f"{what} changed since the checkpoint: the same number of examples ({n}) with other "
                            f"questions, answers or messages. A resumed run needs the data it was trained on: put "
                            f"the original data back, or start a new run")

    def load_state_dict(self, state: dict) -> None:
        self.check_state(state)
        if state.get("seed", self.seed) != self.seed:
            log.warning("PromptSampler: checkpoint seed %s differs from this run's %s; using the checkpoint's",
                        state.get("seed"), self.seed)
            self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.skipped = int(state.get("skipped", 0))
        self._order_epoch = None
