"""Prompt datasets (JSONL, JSON, Parquet, ``datasets`` folders, the built-in demo) and the sampler.

Rows are mapped to ``Prompt`` records through the configured field names. Bad input of any
kind (encoding, syntax, a corrupt file, a field of the wrong type) fails with a ``DataError``
naming the file, the row (1-based in every format; the line for JSONL) and the field. The
sampler (``prompt_sampler.py``) walks seeded per-epoch permutations, and its state is part of the
checkpoint, so a resumed run neither repeats nor skips a prompt.
"""

from __future__ import annotations

import codecs
import decimal
import json
import math
import re
from pathlib import Path
from typing import Any, Iterator

from relayrl.models import images as images_of
from relayrl.failures import one_line
from relayrl.records import Prompt
from relayrl.workspaces import tasks as workspace_tasks
from relayrl.data.prompt_sampler import PromptSampler, SamplerState  # noqa: F401 (the sampler of these prompts)


class DataError(ValueError):
    pass


ROLES = ("system", "user", "assistant")  # the roles chat templates render in a prompt
_WIDE_BOMS = (codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE, codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)


def _one_line(e: BaseException) -> str:
    return one_line(str(e)) or type(e).__name__


def _decode(raw: bytes, p: Path, first_line: int = 1) -> str:
    """UTF-8 text of ``raw`` (lines ``first_line``...), naming the line, column and byte that is not
    UTF-8. A UTF-8 byte-order mark is dropped (spreadsheet exports write one)."""
    if first_line == 1 and raw.startswith(_WIDE_BOMS):
        raise DataError(f"{p}: the file is UTF-16 or UTF-32 (it starts with a byte-order mark); save it as UTF-8")
    skip = len(codecs.BOM_UTF8) if first_line == 1 and raw.startswith(codecs.BOM_UTF8) else 0
    try:
        return raw[skip:].decode("utf-8")
    except UnicodeDecodeError as e:
        at = e.start + skip
        line = first_line + raw.count(b"\n", 0, at)
        column = at - (raw.rfind(b"\n", 0, at) + 1) + 1
        raise DataError(f"{p}: line {line}: not valid UTF-8: byte 0x{raw[at]:02x} at column {column} "
                        "(save the file as UTF-8)") from None


def _jsonl_rows(p: Path) -> Iterator[tuple[int, Any]]:
    with p.open("rb") as f:
        for n, raw in enumerate(f, start=1):
            line = _decode(raw, p, first_line=n)
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{p}: line {n}: invalid JSON: {e.msg} (column {e.colno})") from None
            except RecursionError:
                raise DataError(f"{p}: line {n}: invalid JSON: nested too deeply") from None
            except ValueError as e:  # an integer past Python's 4,300 digits
                raise DataError(f"{p}: {_number_problem(e, line, n)}") from None


def _json_rows(p: Path) -> Iterator[tuple[int, Any]]:
    try:
        rows = json.loads(_decode(p.read_bytes(), p))
    except json.JSONDecodeError as e:
        hint = " (one object per line? name the file .jsonl)" if e.msg == "Extra data" else ""
        raise DataError(f"{p}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}{hint}") from None
    except RecursionError:
        raise DataError(f"{p}: invalid JSON: nested too deeply") from None
    except ValueError as e:  # an integer past Python's 4,300 digits (json says neither line nor column)
        raise DataError(f"{p}: {_number_problem(e, p.read_bytes().decode('utf-8', 'replace'))}") from None
    if not isinstance(rows, list):
        raise DataError(f"{p}: a .json dataset must be a list of rows, got {describe(rows)} (JSON Lines: name it .jsonl)")
    yield from enumerate(rows, start=1)


_LONG_NUMBER = re.compile(r'(?:"((?:[^"\\]|\\.)*)"\s*:\s*)?-?\d{4301,}')


def _number_problem(e: ValueError, text: str, first_line: int = 1) -> str:
    """Where the number too long for Python's int is (json.loads says neither line nor field)."""
    m = _LONG_NUMBER.search(text)
    if m is None:
        return f"invalid JSON: {_one_line(e)[:200]}"
    line = first_line + text.count("\n", 0, m.start())
    field = f" (field '{m.group(1)[:80]}')" if m.group(1) is not None else ""
    return (f"line {line}{field}: a number of {len(m.group(0).split(':')[-1].strip())} digits: more than Python's "
            "int reads (4,300); quote it as a string")


def _parquet_rows(p: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(p).to_pylist()
    except (pa.ArrowException, OSError, ValueError) as e:  # truncated, corrupt, or not Parquet at all
        raise DataError(f"{p}: not a readable Parquet file: {_one_line(e)}") from None
    yield from enumerate(rows, start=1)


def _datasets_rows(p: Path) -> Iterator[tuple[int, Any]]:
    import datasets

    datasets.disable_progress_bars()  # relayrl draws its own; theirs would go to stderr
    try:
        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            if not ds:
                raise DataError(f"{p}: the DatasetDict has no splits")
            ds = ds["train" if "train" in ds else next(iter(ds))]
        # arrow files are memory-mapped and read as rows are taken: a truncated one fails here
        yield from enumerate(ds, start=1)
    except DataError:
        raise
    except Exception as e:  # datasets raises anything from FileNotFoundError to ArrowInvalid and KeyError
        raise DataError(f"{p}: not a readable datasets folder (saved with save_to_disk): {_one_line(e)}") from None


READERS = {".jsonl": _jsonl_rows, ".json": _json_rows, ".parquet": _parquet_rows}


def _builtin_rows(path: str) -> list[dict]:
    from relayrl.demo import task

    which = path.split(":", 1)[1]
    if which == "demo":
        return task.make_rows(20000, seed=1, id_prefix="train")
    if which == "demo-eval":
        return task.make_rows(1000, seed=2, id_prefix="eval")
    if which == "demo-sft":
        return task.make_sft_rows(4000, seed=3, id_prefix="sft")
    if which in ("agent-demo", "agent-demo-eval"):
        from relayrl.demo import agent_task

        if which == "agent-demo":
            return agent_task.make_rows(4000, seed=1, id_prefix="agent-train")
        return agent_task.make_rows(200, seed=2, id_prefix="agent-eval", split="eval")
    if which in ("swe-demo", "swe-demo-eval"):  # generated repositories (relayrl.demo.swe_task), made on first use
        from relayrl.demo import swe_task

        return swe_task.make_rows(100, seed=1, split="train") if which == "swe-demo" else \
            swe_task.make_rows(32, seed=2, split="eval")
    if which in ("vlm-demo", "vlm-demo-eval"):  # digits in images (relayrl.demo.vlm_demo), kept as data URLs
        from relayrl.demo import vlm_demo

        return vlm_demo.make_rows(2000, seed=1, id_prefix="train") if which == "vlm-demo" else \
            vlm_demo.make_rows(200, seed=2, id_prefix="eval")
    if which in ("gui", "gui-eval"):  # two screens, a button to click on each (relayrl.envs.gui, examples/gui_agent.yaml)
        from relayrl.envs import gui

        return gui.make_rows(2000, seed=1, id_prefix="train") if which == "gui" else \
            gui.make_rows(200, seed=2, id_prefix="eval")
    if which in ("nim", "nim-eval", "nim-sft", "proposer-solver", "proposer-solver-eval", "proposer-sft"):  # (examples/self_play.yaml, ...)
        from relayrl.envs import games

        return games.rows(which)
    raise DataError(f"unknown built-in dataset {path!r}; valid: builtin:demo, builtin:demo-eval, builtin:demo-sft, "
                    "builtin:agent-demo, builtin:agent-demo-eval, builtin:swe-demo, builtin:swe-demo-eval, builtin:nim, builtin:nim-eval, builtin:nim-sft, "
                    "builtin:proposer-solver, builtin:proposer-solver-eval, builtin:proposer-sft, builtin:vlm-demo, "
                    "builtin:vlm-demo-eval, builtin:gui, builtin:gui-eval")


def iter_rows(path: str) -> Iterator[tuple[int, Any]]:
    """(row number, row) pairs, numbered from 1 in every format (JSONL: the line)."""
    if path.startswith("builtin:"):
        yield from enumerate(_builtin_rows(path), start=1)
        return
    from relayrl.envs import adapters  # data.path=reasoning_gym:... and textarena:... (generated rows)

    try:
        generated = adapters.rows(path)
    except ValueError as e:
        raise DataError(str(e)) from None
    if generated is not None:
        yield from enumerate(generated, start=1)
        return
    p = Path(path)
    if not p.exists():
        raise DataError(f"dataset not found: {p}")
    if not (p.is_dir() or p.is_file()):  # (a link to /dev/zero is a device: it would fill memory; a FIFO blocks)
        raise DataError(f"{p}: cannot read: not a regular file or a folder (a FIFO, socket or device)")
    reader = _datasets_rows if p.is_dir() else READERS.get(p.suffix)
    if reader is None:
        raise DataError(f"{p}: unsupported dataset format {p.suffix!r}; use .jsonl, .json, .parquet or a folder")
    try:
        yield from reader(p)
    except OSError as e:  # unreadable: permissions, a special file
        raise DataError(f"{p}: cannot read: {e.strerror or _one_line(e)}") from None


def describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r:.60}"


def valid_text(value: str, at: str) -> str:
    """``value``, if it can be tokenized: a JSON escape like \\ud800 gives a lone surrogate, which is
    not Unicode and fails only when the prompt is encoded, mid-run."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = value[e.start]
        raise DataError(f"{at}: invalid Unicode: lone surrogate {bad!r} at character {e.start + 1}") from None
    return value


def chat_messages(value: Any, at: str, raw: bool, images: list | None = None, base: Path | None = None,
                  refs: list | None = None) -> list[dict[str, str]]:
    """The prompt as chat messages (a string is one user message). ``images`` (the row's image field, taken in
    order by image parts without an image of their own) and ``refs`` (filled with the messages' images, in
    order) given: a message's content may be a list of text and image parts (``data.images``); else a string."""
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{at} is empty")
        return [{"role": "user", "content": valid_text(value, at)}]
    if raw:
        raise DataError(f"{at}: data.prompt_format=raw takes a plain string prompt, got {describe(value)} "
                        "(chat messages need data.prompt_format=chat)")
    if not isinstance(value, list) or not value:
        raise DataError(f"{at} must be a non-empty string or a list of {{role, content}} messages, got {describe(value)}")
    out = []
    for i, m in enumerate(value, start=1):
        where = f"{at} message {i}"
        if not isinstance(m, dict):
            raise DataError(f"{where} must be an object with role and content, got {describe(m)}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise DataError(f"{where}: role {role!r:.40} is not one of {', '.join(ROLES)}")
        if isinstance(content, list) and refs is not None:
            try:
                content, found = images_of.split_parts(content, images, base, f"{where} content")
            except images_of.ImageError as e:
                raise DataError(str(e)) from None
            refs += found
        if not isinstance(content, str):
            raise DataError(f"{where}: content must be a string, got {describe(content)}")
        out.append({"role": role, "content": valid_text(content, where)})
    if not any(m["content"].strip() for m in out):
        raise DataError(f"{at} is empty (every message's content is blank)")
    return out


def _answer(value: Any, at: str) -> str | None:
    """A string, or a number as its text (``2`` → "2"); anything else is a mistake in the mapping."""
    if value is None:
        return None
    if isinstance(value, str):
        return valid_text(value, at)
    if isinstance(value, (int, float, decimal.Decimal)) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            raise DataError(f"{at} is {value} (a missing number?)")
        return str(value)
    raise DataError(f"{at} must be a string or a number, got {describe(value)}")


def row_id(row: dict, n: int, id_field: str | None, at: str) -> str:
    if id_field is None or id_field not in row:
        return f"row{n}"
    value = row[id_field]
    if isinstance(value, str) and value.strip():
        return valid_text(value, at)
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise DataError(f"{at} must be a non-empty string or an integer, got {describe(value)}")


def _task_prompt(row: dict, path: str, where: str, system_prompt: str | None, seen: set[str]) -> Prompt:
    """A workspace task's prompt (``relayrl.workspaces.tasks``): its problem statement, its instance id."""
    try:
        task = workspace_tasks.from_row(row, path, where)
    except ValueError as e:
        raise DataError(str(e)) from None
    if task.instance_id in seen:
        raise DataError(f"{where}: field 'instance_id': duplicate id {task.instance_id!r:.80}")
    seen.add(task.instance_id)
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return Prompt(id=task.instance_id, messages=messages + [{"role": "user", "content": task.problem_statement}],
                  metadata={workspace_tasks.KEY: task.to_dict()})


def _with_images(row: dict, path: str, where: str, prompt_field: str, prompt_format: str, image_field: str | None
                 ) -> tuple[list[dict[str, str]], list[str]]:
    """A row's messages (text, an ``IMAGE`` marker where each image goes) and its images' references."""
    at = f"{where}: field '{prompt_field}'"
    if image_field is None or prompt_format == "raw":
        return chat_messages(row[prompt_field], at, prompt_format == "raw"), []
    field = row.get(image_field)
    listed = [] if field is None else list(field) if isinstance(field, (list, tuple)) else [field]
    base = None if path.startswith("builtin:") else Path(path).parent
    refs: list[str] = []
    messages = chat_messages(row[prompt_field], at, False, listed, base, refs)
    try:
        for i, value in enumerate(listed, start=1):  # (those no image part took)
            refs.append(images_of.to_ref(value, base, f"{where}: field '{image_field}' image {i}"))
        if refs:  # (a text row's literal IMAGE is its text)
            messages = images_of.place(messages, refs, at)
    except images_of.ImageError as e:
        raise DataError(str(e)) from None
    return messages, refs


def load_prompts(
    path: str,
    prompt_field: str = "prompt",
    answer_field: str | None = "answer",
    id_field: str | None = "id",
    metadata_fields: list[str] = (),
    system_prompt: str | None = None,
    limit: int | None = None,
    prompt_format: str = "chat",
    image_field: str | None = "images",
) -> list[Prompt]:
    """Rows of ``path`` as prompts. ``prompt_format='raw'``: the prompt must be a plain string
    (it is tokenized without a chat template, so there is nowhere to put a system prompt). A row's images
    (``image_field`` and image parts: ``data.images``) are checked here and kept as ``Prompt.images``."""
    if prompt_format not in ("chat", "raw"):
        raise ValueError(f"prompt_format must be 'chat' or 'raw', got {prompt_format!r}")
    if prompt_format == "raw" and system_prompt:
        raise DataError("model.system_prompt needs data.prompt_format=chat (a raw prompt has no messages)")
    out: list[Prompt] = []
    seen: set[str] = set()
    label = "line" if path.endswith(".jsonl") else "row"
    for n, row in iter_rows(path):
        where = f"{path}: {label} {n}"
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected an object with fields, got {describe(row)}")
        if prompt_field not in row and workspace_tasks.is_task(row):  # SWE-bench's format: nothing to set
            out.append(_task_prompt(row, path, where, system_prompt, seen))
            if limit is not None and len(out) >= limit:
                break
            continue
        if prompt_field not in row:
            raise DataError(f"{where}: missing field '{prompt_field}' (data.prompt_field); has: "
                            f"{', '.join(map(str, row))[:200]}")
        messages, refs = _with_images(row, path, where, prompt_field, prompt_format, image_field)
        if system_prompt:
            messages = [{"role": "system", "content": system_prompt}] + messages
        answer = None
        if answer_field is not None:
            if answer_field not in row:
                raise DataError(f"{where}: missing field '{answer_field}' (data.answer_field)")
            answer = _answer(row[answer_field], f"{where}: field '{answer_field}'")
        pid = row_id(row, n, id_field, f"{where}: field '{id_field}'")
        if pid in seen:
            raise DataError(f"{where}: field '{id_field}': duplicate id {pid!r:.80}")
        seen.add(pid)
        meta = dict(row.get("metadata") or {}) if isinstance(row.get("metadata"), dict) else {}
        for f in metadata_fields:
            if f not in row:
                raise DataError(f"{where}: missing metadata field '{f}' (data.metadata_fields)")
            meta[f] = row[f]
        out.append(Prompt(id=pid, messages=messages, answer=answer, metadata=meta, images=tuple(refs)))
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise DataError(f"{path}: no rows")
    return out
