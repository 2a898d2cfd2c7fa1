"""The built-in agent demo task: two-digit multiplication with a calculator tool.

A prompt asks for the product of two two-digit numbers; the answer is the product:

    prompt:  "Compute 47*86."
    answer:  "4042"

A tiny model cannot multiply in its head, so it only scores well by calling the tool. The
reference episode that uses it (Hermes/Qwen tool-call format, what
``relayrl.envs.tools.parse_tool_calls`` reads):

    user:       Compute 47*86.
    assistant:  <tool_call>{"name": "calculator", "arguments": {"expression": "47*86"}}</tool_call>
    tool:       4042
    assistant:  \\boxed{4042}

and a direct answer is a single assistant turn ``\\boxed{N}`` with the model's own guess. The
warm start mixes both at random (independently of the prompt), so the policy *knows* the call
format but does not use it reliably; RL then has to teach it when to call. The answer is
verifiable with the ``math`` reward.

Prompts are split once: a fixed set of ``HELDOUT`` factor pairs is reserved for evaluation
(``split="eval"``) and never appears in training rows or in the warm-start corpus.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import random

LOW, HIGH = 11, 99  # both factors
HELDOUT = 1000  # factor pairs reserved for evaluation (of 89 * 89 = 7921)
_SPLIT_SEED = 20240611  # fixes the train/eval partition; independent of every row seed


# ---------------------------------------------------------------------------------- the tool

MAX_EXPRESSION_CHARS = 1000
MAX_DIGITS = 4000  # integer results are kept below Python's int-to-str limit (4300 digits)
_LOG2_10 = math.log2(10)

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _too_big(bits: float) -> bool:
    return bits > MAX_DIGITS * _LOG2_10


def _binary(op: ast.operator, a, b):
    if isinstance(a, int) and isinstance(b, int):  # bound integer growth before computing
        if isinstance(op, ast.Pow) and b > 0 and abs(a) > 1 and (
            b.bit_length() > 64 or _too_big(b * math.log2(abs(a)))
        ):
            raise ValueError(f"result too large (more than {MAX_DIGITS} digits)")
        if isinstance(op, ast.Mult) and _too_big(a.bit_length() + b.bit_length() - 1):
            raise ValueError(f"result too large (more than {MAX_DIGITS} digits)")
    try:
        result = _BINARY[type(op)](a, b)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except OverflowError:
        raise ValueError("result too large") from None
    if isinstance(result, complex):  # (-8) ** 0.5
        raise ValueError("result is not a real number")
    if isinstance(result, float) and not math.isfinite(result):
        raise ValueError("result too large")
    return result


def _eval(node: ast.AST):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise ValueError(f"unsupported value {node.value!r}: only numbers")
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _binary(node.op, _eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    what = {ast.Name: "names", ast.Call: "function calls", ast.Attribute: "attributes"}.get(type(node))
    raise ValueError(f"unsupported {what or 'syntax ' + type(node).__name__}: only numbers, "
                     "+ - * / // % ** and parentheses")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: An arithmetic expression on numbers with + - * / // % ** and parentheses, e.g. "47*86".

    Returns:
        The result as a string (an integer result without a decimal point).
    """
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression too long (more than {MAX_EXPRESSION_CHARS} characters)")
    if not expression.strip():
        raise ValueError("empty expression")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        reason = e.msg if isinstance(e, SyntaxError) else str(e) or type(e).__name__
        shown = expression if len(expression) <= 60 else expression[:57] + "..."
        raise ValueError(f"invalid expression {shown!r}: {reason}") from None
    try:
        result = _eval(tree)
    except RecursionError:
        raise ValueError("expression too deeply nested") from None
    if isinstance(result, float) and result.is_integer():
        result = int(result)
    if isinstance(result, int) and _too_big(result.bit_length()):
        raise ValueError(f"result too large (more than {MAX_DIGITS} digits)")
    return str(result)


# ------------------------------------------------------------------------------ the episodes


def _pairs(split: str) -> list[tuple[int, int]]:
    every = [(a, b) for a in range(LOW, HIGH + 1) for b in range(LOW, HIGH + 1)]
    held = set(random.Random(_SPLIT_SEED).sample(every, HELDOUT))
    if split == "eval":
        return [p for p in every if p in held]
    if split == "train":
        return [p for p in every if p not in held]
    raise ValueError(f"split must be 'train' or 'eval', got {split!r}")


def prompt_text(a: int, b: int) -> str:
    return f"Compute {a}*{b}."


def tool_call_text(expression: str) -> str:
    """The assistant turn that calls the calculator (Hermes/Qwen format, no newlines)."""
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def answer_text(value: str) -> str:
    return f"\\boxed{{{value}}}"


def episode(a: int, b: int, use_tool: bool) -> list[dict]:
    """The reference conversation for ``a*b``: with the tool (call, result, answer) or a direct
    answer. Both end with the true product boxed."""
    product = str(a * b)
    messages = [{"role": "user", "content": prompt_text(a, b)}]
    if use_tool:
        expression = f"{a}*{b}"
        messages += [
            {"role": "assistant", "content": tool_call_text(expression)},
            {"role": "tool", "name": "calculator", "content": calculator(expression)},
        ]
    messages.append({"role": "assistant", "content": answer_text(product)})
    return messages


def _draw(n: int, rng: random.Random, split: str) -> list[tuple[int, int]]:
    """``n`` factor pairs of ``split``: without repeats until the split is used up."""
    pool = _pairs(split)
    out: list[tuple[int, int]] = []
    while len(out) < n:
        chunk = pool[:]
        rng.shuffle(chunk)
        out += chunk[: n - len(out)]
    return out


def make_rows(n: int, seed: int, id_prefix: str, split: str = "train") -> list[dict]:
    """Rows in the project's prompt-dataset shape: id, prompt, answer, metadata.

    ``split="eval"`` draws from the held-out factor pairs, which no ``"train"`` row uses."""
    rng = random.Random(seed)
    return [
        {"id": f"{id_prefix}-{i}", "prompt": prompt_text(a, b), "answer": str(a * b), "metadata": {}}
        for i, (a, b) in enumerate(_draw(n, rng, split))
    ]


def corpus(n: int, seed: int, tool_rate: float = 0.35) -> list[list[dict]]:
    """``n`` reference conversations on training pairs for tokenizer training and the warm start;
    each uses the tool with probability ``tool_rate``, independently of its prompt."""
    rng = random.Random(seed)
    return [episode(a, b, rng.random() < tool_rate) for a, b in _draw(n, rng, "train")]
