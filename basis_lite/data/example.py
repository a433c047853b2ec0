"""`Example`, the one record every data source produces: an id, a question, its gold answer and metadata."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Example:
    id: str  # "<task>/<family>/<index>" (built in), "<file name>/<row>" or "<hub source>/<split>/<row>"
    question: str  # the question text (for a conversational row: its last user message)
    answer: str  # the gold final answer (for files and the hub: extracted from the answer field)
    meta: dict = field(default_factory=dict)  # "source", "level", "family", "row" where known, and the row's other
    # columns under their own names (files and the hub)
    messages: list | None = None  # a conversational row's prompt as given: [{"role": ..., "content": ...}, ...]

    @property
    def prompt(self):
        """The prompt as the dataset gives it (what reward functions get as `prompts`): the conversation for a
        conversational row, else the question text."""
        return self.messages if self.messages is not None else self.question
