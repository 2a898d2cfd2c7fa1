"""``reward.fn=reasoning_gym``: reasoning-gym's own scorers, for rows of ``data.path=reasoning_gym:...``
(``relayrl.envs.adapters.reasoning_gym`` makes them). The answer is read from ``<answer>...</answer>``
(reasoning-gym's own prompt format), else the last ``\\boxed{}``, else the whole response.
"""

from __future__ import annotations

import functools
import json

from relayrl.envs.answers import last_boxed


@functools.lru_cache(maxsize=64)
def _dataset(name: str, size: int, seed: int, config: str):
    import reasoning_gym

    return reasoning_gym.create_dataset(name, size=size, seed=seed, **json.loads(config))


def answer_of(completion: str) -> str:
    from reasoning_gym.utils import extract_answer

    found = extract_answer(completion, tag_name="answer")
    if found is None:
        found = last_boxed(completion)
    return (found if found is not None else completion).strip()


def score(completion: str, answer: str | None, metadata: dict) -> float:
    """``reward.fn=reasoning_gym``: the task's own ``score_answer`` on the entry the row came from."""
    m = metadata.get("reasoning_gym")
    if not isinstance(m, dict):
        raise ValueError("reward.fn=reasoning_gym scores rows of data.path=reasoning_gym:... (their metadata names "
                         "the task); this row has none")
    ds = _dataset(m["name"], int(m["size"]), int(m["seed"]), m["config"])
    entry = ds[int(m["index"])]
    return float(ds.score_answer(answer_of(completion), entry))
