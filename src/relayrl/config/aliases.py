"""TRL's names for the settings whose meaning is the same here (``GRPOConfig``'s), accepted on the command line
and at the top of a YAML file with a hint naming relayrl's field: a TRL user's ``learning_rate=1e-6`` works
and says it is ``trainer.lr``. Only names whose meaning is the same: TRL's ``per_device_train_batch_size``
counts completions per device, its ``output_dir`` is the run's own folder, so they are not here (the unknown
key's error lists the valid ones).
"""

from __future__ import annotations

import sys

TRL = {
    "learning_rate": "trainer.lr",
    "num_generations": "rollout.group_size",
    "beta": "algo.kl_coef",
    "max_completion_length": "rollout.max_new_tokens",
    "max_steps": "run.steps",
    "seed": "run.seed",
    "temperature": "rollout.temperature",
    "top_p": "rollout.top_p",
    "epsilon": "algo.clip_low",
    "epsilon_high": "algo.clip_high",
    "warmup_steps": "trainer.warmup_steps",
    "weight_decay": "trainer.weight_decay",
    "max_grad_norm": "trainer.grad_clip",
    "lr_scheduler_type": "trainer.schedule",
    "save_steps": "run.save_every",
    "report_to": "run.report_to",
}


def hint(name: str, value, source: str) -> None:
    print(f"relayrl: {name} is TRL's name for {TRL[name]}: taken as {TRL[name]}={value} ({source}; "
          f"relayrl train --help lists every field by its own name)", file=sys.stderr)


def override(item: str) -> str:
    """``learning_rate=1e-6`` → ``trainer.lr=1e-6`` (said); any other override as it is."""
    key, eq, value = item.partition("=")
    if eq and key.strip() in TRL:
        hint(key.strip(), value, "command line")
        return f"{TRL[key.strip()]}={value}"
    return item


def tree(file_tree: dict, source: str) -> dict:
    """A YAML file's top-level TRL names moved to their sections (said)."""
    out = {k: v for k, v in file_tree.items() if not (k in TRL and not isinstance(v, dict))}
    for key, value in file_tree.items():
        if key in TRL and not isinstance(value, dict):
            hint(key, value, source)
            section, field = TRL[key].split(".")
            body = out.get(section)
            out[section] = {**(body if isinstance(body, dict) else {}), field: value}
    return out
