"""The built-in demo task: chained addition with a long tail of response lengths.

A prompt asks for the sum of k one-digit numbers; the reference response writes the running
sum one addition at a time and ends with ``\\boxed{total}``:

    prompt:   "Add 3 4 5 1"
    response: "3+4=7 7+5=12 12+1=13 \\boxed{13}"

k is drawn from a truncated geometric distribution, so most responses are short (k = 2..4,
about 10-30 tokens) and a few are long (k up to 12, about 100 tokens). That long tail is what
a synchronous RL step waits on, and what the asynchronous core is built to hide.
The answer is verifiable with the ``math`` reward.
"""

from __future__ import annotations

import random

MIN_TERMS, MAX_TERMS = 2, 12
TAIL_P = 0.35  # P(stop adding terms) per extra term: mean k ~ 3.8, max 12


def sample_terms(rng: random.Random) -> list[int]:
    k = MIN_TERMS
    while k < MAX_TERMS and rng.random() > TAIL_P:
        k += 1
    return [rng.randint(1, 9) for _ in range(k)]


TAGS = "abcdefghijkl"


def prompt_text(terms: list[int]) -> str:
    return "Sum mod 10: " + " ".join(f"{TAGS[i]}={t}" for i, t in enumerate(terms))


def solution_text(terms: list[int], slip_rng: random.Random | None = None, slip: float = 0.0) -> str:
    """The worked solution. With ``slip`` > 0 each addition is written wrong with that probability
    (a random other digit, and the chain continues from it): warm-start data for a policy that
    knows the method but makes arithmetic slips, which RL then has to remove."""
    steps, total = [], 0
    for i, t in enumerate(terms):
        result = (total + t) % 10
        if slip and slip_rng.random() < slip:
            result = (result + slip_rng.randint(1, 9)) % 10
        steps.append(f"{TAGS[i]}: {total}+{t}={result}")
        total = result
    return " ".join(steps) + f" \\boxed{{{total}}}"


def make_rows(n: int, seed: int, id_prefix: str) -> list[dict]:
    """Rows in the project's prompt-dataset shape: id, prompt, answer, metadata."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        terms = sample_terms(rng)
        rows.append(
            {
                "id": f"{id_prefix}-{i}",
                "prompt": prompt_text(terms),
                "answer": str(sum(terms) % 10),
                "metadata": {"terms": len(terms)},
            }
        )
    return rows


def make_sft_rows(n: int, seed: int, id_prefix: str) -> list[dict]:
    """Demonstrations in ``relayrl sft``'s shape: the rows of ``make_rows`` with the worked solution as the
    response (no slips: the demo model was warm-started with them, so fine-tuning on these raises its accuracy)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        terms = sample_terms(rng)
        rows.append({"id": f"{id_prefix}-{i}", "prompt": prompt_text(terms), "response": solution_text(terms),
                     "answer": str(sum(terms) % 10), "metadata": {"terms": len(terms)}})
    return rows


def corpus(n: int, seed: int, slip: float = 0.0) -> list[tuple[str, str]]:
    """(prompt, solution) pairs for tokenizer training and the supervised warm start."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        terms = sample_terms(rng)
        pairs.append((prompt_text(terms), solution_text(terms, rng, slip)))
    return pairs
