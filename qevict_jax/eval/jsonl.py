"""Reading the official JSONL files of the evaluation data sets (one JSON object per line)."""

from __future__ import annotations

import json
from pathlib import Path


def read_objects(path: Path, limit: int | None, missing: str) -> list[dict]:
    """The first ``limit`` objects (all when None) of the JSONL file ``path``, blank lines skipped.

    missing: the message of the ``FileNotFoundError`` raised when ``path`` is not a file.
    """
    if not path.is_file():
        raise FileNotFoundError(missing)
    objects: list[dict] = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if limit is not None and len(objects) >= limit:
                break
            if line.strip():
                objects.append(json.loads(line))
    return objects
