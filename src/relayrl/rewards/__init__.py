"""Verifiable rewards: the registry of verifiers (``reward.fn``) and the isolated runner."""

from relayrl.rewards.verifiers import (  # noqa: F401 (the public names)
    NoVerifier, RewardRunner, RewardStats, exact_reward, extract_answer, last_boxed, math_reward, reference_answer,
)
