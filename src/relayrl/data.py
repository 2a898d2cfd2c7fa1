"""Prompt datasets (JSONL, JSON, Parquet, ``datasets`` folders, the built-in demo) and the sampler.

Rows are mapped to ``Prompt`` records through the configured field names. A malformed row
fails with the file and row number. The sampler walks seeded per-epoch permutations and
its cursor is part of the checkpoint, so a resumed run neither repeats nor skips a prompt.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from relayrl.records import Prompt


class DataError(ValueError):
    pass


def _iter_rows(path: str) -> Iterator[tuple[int, Any]]:
    """(row_number, row) pairs; row numbers are 1-based lines for JSONL, 0-based indices otherwise."""
    if path.startswith("builtin:"):
        from relayrl.demo import task

        which = path.split(":", 1)[1]
        if which == "demo":
            rows = task.make_rows(20000, seed=1, id_prefix="train")
        elif which == "demo-eval":
            rows = task.make_rows(1000, seed=2, id_prefix="eval")
        else:
            raise DataError(f"unknown built-in dataset {path!r}; valid: builtin:demo, builtin:demo-eval")
        yield from enumerate(rows)
        return
    p = Path(path)
    if not p.exists():
        raise DataError(f"dataset not found: {p}")
    if p.is_dir():
        import datasets

        try:
            ds = datasets.load_from_disk(str(p))
        except Exception as e:
            raise DataError(f"{p}: not a datasets folder saved with save_to_disk: {e}") from None
        if isinstance(ds, datasets.DatasetDict):
            split = "train" if "train" in ds else next(iter(ds))
            ds = ds[split]
        yield from enumerate(ds)
    elif p.suffix == ".jsonl":
        with p.open() as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    yield n, json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{p}: line {n}: invalid JSON: {e.msg}") from None
    elif p.suffix == ".json":
        rows = json.loads(p.read_text())
        if not isinstance(rows, list):
            raise DataError(f"{p}: a .json dataset must be a list of rows")
        yield from enumerate(rows)
    elif p.suffix == ".parquet":
        import pyarrow.parquet as pq

        yield from enumerate(pq.read_table(p).to_pylist())
    else:
        raise DataError(f"{p}: unsupported dataset format {p.suffix!r}; use .jsonl, .json, .parquet or a folder")


def _to_messages(value: Any, where: str) -> list[dict[str, str]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    ):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise DataError(f"{where}: prompt must be a string or a list of {{role, content}} messages, got {value!r:.80}")


def load_prompts(
    path: str,
    prompt_field: str = "prompt",
    answer_field: str | None = "answer",
    id_field: str | None = "id",
    metadata_fields: list[str] = (),
    system_prompt: str | None = None,
    limit: int | None = None,
) -> list[Prompt]:
    out: list[Prompt] = []
    seen: set[str] = set()
    label = "line" if path.endswith(".jsonl") else "row"
    for n, row in _iter_rows(path):
        where = f"{path}: {label} {n}"
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected an object with fields, got {type(row).__name__}")
        if prompt_field not in row:
            raise DataError(f"{where}: missing field '{prompt_field}' (data.prompt_field); has: {', '.join(row)}")
        messages = _to_messages(row[prompt_field], where)
        if system_prompt:
            messages = [{"role": "system", "content": system_prompt}] + messages
        answer = None
        if answer_field is not None:
            if answer_field not in row:
                raise DataError(f"{where}: missing field '{answer_field}' (data.answer_field)")
            answer = None if row[answer_field] is None else str(row[answer_field])
        pid = str(row[id_field]) if id_field is not None and id_field in row else f"row{n}"
        if pid in seen:
            raise DataError(f"{where}: duplicate id {pid!r}")
        seen.add(pid)
        meta = dict(row.get("metadata") or {}) if isinstance(row.get("metadata"), dict) else {}
        for f in metadata_fields:
            if f not in row:
                raise DataError(f"{where}: missing metadata field '{f}' (data.metadata_fields)")
            meta[f] = row[f]
        out.append(Prompt(id=pid, messages=messages, answer=answer, metadata=meta))
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise DataError(f"{path}: no rows")
    return out


@dataclass
class SamplerState:
    epoch: int = 0
    position: int = 0
    consumed: int = 0


class PromptSampler:
    """Seeded per-epoch shuffles; ``state`` is checkpointed so resume continues exactly."""

    def __init__(self, prompts: list[Prompt], seed: int, shuffle: bool = True, state: SamplerState | None = None):
        self.prompts, self.seed, self.shuffle = prompts, seed, shuffle
        self.state = state or SamplerState()
        self._order = self._permutation(self.state.epoch)

    def _permutation(self, epoch: int) -> list[int]:
        idx = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed * 100003 + epoch).shuffle(idx)
        return idx

    def take(self, n: int) -> list[Prompt]:
        out = []
        for _ in range(n):
            if self.state.position >= len(self._order):
                self.state.epoch += 1
                self.state.position = 0
                self._order = self._permutation(self.state.epoch)
            out.append(self.prompts[self._order[self.state.position]])
            self.state.position += 1
            self.state.consumed += 1
        return out
