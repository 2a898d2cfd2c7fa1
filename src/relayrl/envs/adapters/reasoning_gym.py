"""reasoning-gym's procedural tasks as data, scored by their own scorers.

    data.path: "reasoning_gym:leg_counting?size=2000&seed=1"      (any other key=value: the task's config)
    data.eval_path: "reasoning_gym:leg_counting?size=200&seed=2"
    reward.fn: reasoning_gym

Each row is one generated entry: its question the prompt, its answer the reference; the row's
metadata names the task, its size, seed, config and index, so the verifier (in its worker process)
regenerates the entry and scores it with the task's own ``score_answer`` (``relayrl.rewards.reasoning_gym``). The answer is read from
``<answer>...</answer>`` (reasoning-gym's own prompt format: ``model.system_prompt`` can ask for it),
else the last ``\\boxed{}``, else the whole response.
"""

from __future__ import annotations

import json

from relayrl.envs.adapters.spec import MAX_SIZE, count_arg, parse_spec
from relayrl.extras import require

FIELD = "data.path=reasoning_gym:..."


def rows(spec: str) -> list[dict]:
    rg = require("reasoning_gym", "reasoning-gym", FIELD)
    name, args = parse_spec(spec, "data.path")
    size = count_arg(args, "size", 1000, spec, "data.path", 1, MAX_SIZE)
    seed = count_arg(args, "seed", 0, spec, "data.path", 0, 2**63 - 1)
    try:
        ds = rg.create_dataset(name, size=size, seed=seed, **args)
        entries = list(ds)  # (a config the task takes but cannot generate with fails here, not at create_dataset)
        meta = {"name": name, "size": size, "seed": seed, "config": json.dumps(args, sort_keys=True)}
    except Exception as e:  # noqa: BLE001 - an unknown task or a bad config, named
        raise ValueError(f"data.path={spec!r:.200}: reasoning_gym cannot make {name!r:.80}: {type(e).__name__}: "
                         f"{str(e)[:300]}") from None
    return [{"id": f"{name}-{seed}-{i}", "prompt": e["question"], "answer": str(e["answer"]),
             "metadata": {"reasoning_gym": {**meta, "index": i}}} for i, e in enumerate(entries)]
