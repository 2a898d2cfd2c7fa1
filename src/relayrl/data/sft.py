"""Supervised examples for ``relayrl sft``: rows of demonstrations, tokenized with the loss on what the
assistant says and nowhere else.

A row is either a prompt and a response (``data.prompt_field``, ``data.response_field``: the prompt a
string or chat messages, the response a string), or a conversation (``data.prompt_field``, or a
``messages`` field where the row has no prompt field): chat messages whose assistant turns are
supervised, their tool calls included, while system, user and tool messages are context. A third
source is episodes' records: a relayrl run's rollout records (``data.path=runs/NAME`` or its ``rollouts``
folder), or the samples ``relayrl eval`` writes (``eval_samples.jsonl``): the episodes' own token ids,
prompt and response, with their loss mask, never re-rendered text, filtered by ``data.min_reward``
(rejection-sampling fine-tuning: sample from a policy, keep what the verifier passes, fine-tune).

The supervised tokens of an assistant turn are found by rendering the chat template twice: the
messages before it with the generation prompt, and the same with the turn; the difference is what the
model would generate there, its end-of-turn token included, the generation prompt's header (which
the model never writes) not. Where the template renders earlier turns unchanged once later ones
follow, a conversation is one sequence with several supervised spans; where it does not (templates
that drop earlier reasoning), each assistant turn is its own example, supervised on that turn alone.
A row with nothing to supervise (no assistant turn, an empty response) is a ``DataError`` naming the
file and the row.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relayrl.data.datasets import DataError, iter_rows, describe, chat_messages, row_id, valid_text
from relayrl.envs.chat import render_ids

SFT_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Example:
    """One supervised sequence: ``prompt_ids`` (context: never trained), then ``response_ids`` with ``mask``
    (1: supervised; 0: context between the assistant's turns: tool results, user turns, headers)."""

    id: str
    prompt_ids: list[int]
    response_ids: list[int]
    mask: list[int]

    @property
    def tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def supervised(self) -> int:
        return sum(self.mask)


def _conversation(value: Any, at: str) -> list[dict]:
    """Chat messages for SFT: system/user/assistant/tool, an assistant's ``tool_calls`` kept (content may be
    empty there), a tool message's ``tool_call_id``/``name`` kept."""
    if not isinstance(value, list) or not value:
        raise DataError(f"{at} must be a non-empty list of {{role, content}} messages, got {describe(value)}")
    out = []
    for i, m in enumerate(value, start=1):
        where = f"{at} message {i}"
        if not isinstance(m, dict):
            raise DataError(f"{where} must be an object with role and content, got {describe(m)}")
        role, content = m.get("role"), m.get("content")
        if role not in SFT_ROLES:
            raise DataError(f"{where}: role {role!r:.40} is not one of {', '.join(SFT_ROLES)}")
        calls = m.get("tool_calls")
        if calls is not None and (role != "assistant" or not isinstance(calls, list)):
            raise DataError(f"{where}: tool_calls must be a list, on an assistant message")
        if content is None and calls:
            content = ""
        if not isinstance(content, str):
            raise DataError(f"{where}: content must be a string, got {describe(content)}")
        msg = {"role": role, "content": valid_text(content, where)}
        for key in ("tool_calls", "tool_call_id", "name"):
            if m.get(key) is not None:
                msg[key] = m[key]
        out.append(msg)
    return out


def _spans(tokenizer, messages: list[dict], tools, where: str) -> list[tuple[list[int], int, int]]:
    """For each assistant turn i: (the rendering of messages[:i+1], where its supervised tokens start, end)."""
    out = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        try:
            before = render_ids(tokenizer, messages[:i], add_generation_prompt=True, tools=tools) if i else []
            upto = render_ids(tokenizer, messages[: i + 1], add_generation_prompt=False, tools=tools)
        except Exception as e:  # noqa: BLE001 (jinja's errors: a template that cannot render these messages)
            raise DataError(f"{where}: the chat template cannot render the conversation: {type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}") from None
        if upto[: len(before)] != before:
            raise DataError(f"{where}: the chat template renders the conversation before assistant turn {len(out) + 1} "
                            "differently once the turn follows: its tokens cannot be told from the prompt's")
        out.append((upto, len(before), len(upto)))
    return out


def encode_conversation(tokenizer, messages: list[dict], rid: str, where: str, tools=None) -> list[Example]:
    """The examples of one conversation (one sequence; or one per assistant turn where the template rewrites
    earlier turns), supervised on the assistant's tokens."""
    spans = _spans(tokenizer, messages, tools, where)
    if not spans:
        raise DataError(f"{where}: no assistant turn: nothing to train on")
    if any(b == a for _, a, b in spans):
        raise DataError(f"{where}: an assistant turn renders to no tokens")
    full = spans[-1][0]
    if all(full[: len(upto)] == upto for upto, _, _ in spans):  # one sequence, several supervised spans
        first = spans[0][1]
        mask = [0] * (len(full) - first)
        for _, a, b in spans:
            mask[a - first : b - first] = [1] * (b - a)
        return [Example(rid, full[:first], full[first:], mask)]
    return [Example(f"{rid}#{k}", upto[:a], upto[a:b], [1] * (b - a)) for k, (upto, a, b) in enumerate(spans)]


def encode_raw(tokenizer, prompt: str, response: str, rid: str) -> Example:
    """A base model's example (data.prompt_format=raw): the prompt's tokens, then the response's and the
    end-of-sequence token, supervised."""
    p = list(tokenizer(prompt)["input_ids"])
    r = list(tokenizer(response, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
    return Example(rid, p, r, [1] * len(r))


def _row_examples(row: dict, n: int, where: str, tokenizer, fields: dict) -> list[Example]:
    pf, rf, idf = fields["prompt_field"], fields["response_field"], fields["id_field"]
    rid = row_id(row, n, idf, f"{where}: field '{idf}'")
    raw = fields["prompt_format"] == "raw"
    key = pf if pf in row else "messages" if "messages" in row else None
    if key is None:
        raise DataError(f"{where}: missing field '{pf}' (data.prompt_field; or a 'messages' conversation); has: "
                        f"{', '.join(map(str, row))[:200]}")
    if row.get("images") is not None:
        raise DataError(f"{where}: field 'images': relayrl sft does not take images yet (relayrl train does: "
                        "docs/guides/vision.md)")
    tools = row.get("tools")
    if rf in row:  # a prompt and a response
        response = row[rf]
        if not isinstance(response, str) or not response.strip():
            raise DataError(f"{where}: field '{rf}' (data.response_field) must be a non-empty string, got "
                            f"{describe(response)}")
        response = valid_text(response, f"{where}: field '{rf}'")
        if raw:
            prompt = row[key]
            if not isinstance(prompt, str) or not prompt.strip():
                raise DataError(f"{where}: field '{key}': data.prompt_format=raw takes a non-empty string prompt, got "
                                f"{describe(prompt)}")
            return [encode_raw(tokenizer, valid_text(prompt, where), response, rid)]
        messages = chat_messages(row[key], f"{where}: field '{key}'", False) + [{"role": "assistant", "content": response}]
    else:
        if raw:
            raise DataError(f"{where}: missing field '{rf}' (data.response_field): data.prompt_format=raw takes a "
                            "prompt and a response")
        if isinstance(row[key], str):
            raise DataError(f"{where}: field '{key}' is a string but the row has no field '{rf}' "
                            "(data.response_field): give a response, or a conversation with assistant turns")
        messages = _conversation(row[key], f"{where}: field '{key}'")
        opening = next((m["role"] for m in messages if m["role"] != "system"), None)
        if opening == "assistant":
            raise DataError(f"{where}: field '{key}': the conversation opens with an assistant turn; a supervised "
                            "turn answers a prompt, so a user turn comes first (a greeting the model gave unasked can "
                            "go in the system message)")
    if fields.get("system_prompt") and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": fields["system_prompt"]}] + messages
    return encode_conversation(tokenizer, messages, rid, where, tools)


# -- rollout records (rejection-sampling fine-tuning) ----------------------------------------------

def rollouts_folder(path: str) -> Path | None:
    """The rollout records' folder ``path`` names (a run folder, or its rollouts folder), or None."""
    p = Path(path)
    for cand in (p / "rollouts", p):
        if cand.is_dir() and any(cand.glob("step_*.jsonl.gz")):
            return cand
    return None


def _records(path: str, folder: Path | None):
    """(where, record) of a run's rollout records (``folder``) or of a JSONL file of them (eval_samples.jsonl)."""
    from relayrl.tracking.rollouts import read_step, recorded_steps

    if folder is not None:
        for step, p in recorded_steps(folder.parent).items():
            for i, r in enumerate(read_step(p), start=1):
                yield f"{p}: line {i}", f"@{step}", r
        return
    for n, r in iter_rows(path):
        yield f"{path}: line {n}", "", r


def _record_examples(records, tokenizer, min_reward: float | None, prompt_format: str) -> tuple[list, dict]:
    """Examples from episodes' records (a run's rollout records, ``relayrl eval``'s eval_samples.jsonl): those
    not failed, with a reward of at least ``min_reward``, their own token ids; duplicates (same prompt, same
    response tokens) once."""
    from relayrl.models.prompts import encode_prompt

    out, seen = [], set()
    counts = {"records": 0, "failed": 0, "below_min_reward": 0, "duplicates": 0}
    for where, tag, r in records:
        counts["records"] += 1
        if not isinstance(r, dict):
            raise DataError(f"{where}: expected an episode's record, got {describe(r)}")
        if r.get("status") == "failed" or r.get("failure"):
            counts["failed"] += 1
            continue
        reward = r.get("reward")
        if not isinstance(reward, (int, float)) or isinstance(reward, bool) or not math.isfinite(reward):
            counts["failed"] += 1
            continue
        if min_reward is not None and reward < min_reward:
            counts["below_min_reward"] += 1
            continue
        prompt_ids = r.get("prompt_ids")
        if prompt_ids is None:  # (records written before they held the prompt's tokens)
            prompt_ids = encode_prompt(tokenizer, r["prompt"], prompt_format)
        response = r.get("response_ids")
        if not response or not isinstance(response, list):
            raise DataError(f"{where}: the record has no response_ids")
        key = (tuple(prompt_ids), tuple(response))
        if key in seen:
            counts["duplicates"] += 1
            continue
        seen.add(key)
        mask = r.get("mask") or [1] * len(response)
        rid = str(r.get("id") or f"{r.get('prompt_id')}/{r.get('kind', '')}{r.get('sample', '')}") + tag
        out.append(Example(f"{rid}#{len(out)}", list(prompt_ids), list(response), list(mask)))
    return out, counts


def _token_records(path: str) -> bool:
    """A JSONL file of episodes' records (``relayrl eval``'s eval_samples.jsonl): rows with response_ids."""
    if not path.endswith(".jsonl") or not Path(path).is_file():
        return False
    with open(path, "rb") as f:
        first = next((ln for ln in f if ln.strip()), b"")
    try:
        row = json.loads(first)
    except ValueError:
        return False
    return isinstance(row, dict) and "response_ids" in row


def load_examples(path: str, tokenizer, prompt_field: str = "prompt", response_field: str = "response",
                  id_field: str | None = "id", prompt_format: str = "chat", system_prompt: str | None = None,
                  min_reward: float | None = None, log=None) -> list[Example]:
    """The supervised examples of ``path`` (a data file or folder, or a run's rollout records)."""
    folder = rollouts_folder(path)
    if folder is not None or _token_records(path):
        out, counts = _record_examples(_records(path, folder), tokenizer, min_reward, prompt_format)
        if log:
            log(f"data.path={path}: {len(out)} episodes of {counts['records']} recorded as examples (left out: "
                f"{counts['failed']} failed, {counts['below_min_reward']} below data.min_reward={min_reward}, "
                f"{counts['duplicates']} repeated)")
        if not out:
            raise DataError(f"{path}: no rollout record to train on ({json.dumps(counts)}; data.min_reward={min_reward})")
        return out
    if min_reward is not None:
        raise DataError(f"data.min_reward={min_reward} filters episodes' records, but data.path={path} is not a "
                        "run folder, its rollouts folder or a file of records (eval_samples.jsonl)")
    fields = dict(prompt_field=prompt_field, response_field=response_field, id_field=id_field,
                  prompt_format=prompt_format, system_prompt=system_prompt)
    out, seen = [], set()
    label = "line" if path.endswith(".jsonl") else "row"
    for n, row in iter_rows(path):
        where = f"{path}: {label} {n}"
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected an object with fields, got {describe(row)}")
        for ex in _row_examples(row, n, where, tokenizer, fields):
            if ex.id in seen:
                raise DataError(f"{where}: field '{id_field}': duplicate id {ex.id!r:.80}")
            seen.add(ex.id)
            out.append(ex)
    if not out:
        raise DataError(f"{path}: no rows")
    return out
