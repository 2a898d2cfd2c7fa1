"""reasoning-gym's procedural tasks as data, scored by their own scorers.

    data.path: "reasoning_gym:leg_counting?size=2000&seed=1"      (any other key=value: the task's config)
    data.eval_path: "reasoning_gym:leg_counting?size=200&seed=2"
    reward.fn: reasoning_gym

Each row is one generated entry: its question the prompt, its answer the reference; the row's
metadata names the task, its size, seed, config and index, so the verifier (in its worker process)
regenerates the entry and scores it with the task's own ``score_answer``. The answer is read from
``<answer>...</answer>`` (reasoning-gym's own prompt format: ``model.system_prompt`` can ask for it),
else the last ``\\boxed{}``, else the whole response.
"""

from __future__ import annotations

import functools
import json

from relayrl.envs.adapters import parse_spec, require

FIELD = "data.path=reasoning_gym:..."


def rows(spec: str) -> list[dict]:
    rg = require("reasoning_gym", "reasoning-gym", FIELD)
    name, args = parse_spec(spec, "data.path")
    size, seed = int(args.pop("size", 1000)), int(args.pop("seed", 0))
    try:
        ds = rg.create_dataset(name, size=size, seed=seed, **args)
    except Exception as e:  # noqa: BLE001 - an unknown task or a bad config, named
        raise ValueError(f"data.path={spec!r}: reasoning_gym cannot make {name!r}: {type(e).__name__}: {e}") from None
    meta = {"name": name, "size": size, "seed": seed, "config": json.dumps(args, sort_keys=True)}
    return [{"id": f"{name}-{seed}-{i}", "prompt": e["question"], "answer": str(e["answer"]),
             "metadata": {"reasoning_gym": {**meta, "index": i}}} for i, e in enumerate(ds)]


@functools.lru_cache(maxsize=64)
def _dataset(name: str, size: int, seed: int, config: str):
    import reasoning_gym

    return reasoning_gym.create_dataset(name, size=size, seed=seed, **json.loads(config))


def answer_of(completion: str) -> str:
    from reasoning_gym.utils import extract_answer

    from relayrl.rewards import last_boxed

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
