"""`Example`, the one record every data source produces: an id, a question, its gold answer and metadata."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Example:
    id: str  # "<task>/<family>/<index>" (built in), "<file name>/<row>" or "<hub source>/<split>/<row>"
    question: str
    answer: str  # the gold final answer (for files and the hub: extracted from the answer field)
    meta: dict = field(default_factory=dict)  # "source", and "level", "family", "row" where known
