"""Reading the final answer out of a response or a reference solution: pure string functions."""

from __future__ import annotations

import re

_BOXED = re.compile(r"\\boxed\s*\{")
_ANSWER_LINE = re.compile(r"(?:answer\s*(?:is)?\s*[:=]?|####)\s*([^\n]+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, honouring nested braces."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    i, depth = starts[-1], 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_answer(text: str) -> str | None:
    """Final answer: last \\boxed{}, else an 'Answer: ...' / '#### ...' line, else the last number."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    lines = _ANSWER_LINE.findall(text)
    if lines:
        return lines[-1].strip().rstrip(".")
    nums = _NUMBER.findall(text)
    return nums[-1] if nums else None


def reference_answer(answer: str) -> str:
    """The final answer of a reference solution: the text after its last '####' (GSM8K's
    "reasoning ... #### 72" gives "72"), else ``answer`` as it is."""
    _, mark, final = answer.rpartition("####")
    return final.strip() if mark and final.strip() else answer
