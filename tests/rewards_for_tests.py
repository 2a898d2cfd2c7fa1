"""Reward functions used by the end-to-end tests (imported by name, as users do: module:function)."""


def digit_fraction(completion: str, answer, metadata) -> float:
    """Dense, easy reward: the fraction of characters that are digits."""
    s = completion.replace(" ", "")
    return sum(ch.isdigit() for ch in s) / max(len(s), 1) if s else 0.0


def flaky(completion: str, answer, metadata) -> float:
    """Raises on some inputs: the run must survive and count the failures."""
    if len(completion) % 3 == 0:
        raise ValueError("flaky verifier")
    return 0.5
