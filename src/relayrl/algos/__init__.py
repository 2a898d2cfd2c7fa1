"""Algorithm registries: variants are chosen by name from these dicts."""

from relayrl.algos.advantages import ADVANTAGES
from relayrl.algos.agents import STEP_ADVANTAGES
from relayrl.algos.estimators import ESTIMATORS, NEEDS_CRITIC
from relayrl.algos.losses import AGGREGATIONS, CLIP_DEFAULTS, POLICY_LOSSES, kl_penalty
from relayrl.algos.offpolicy import CORRECTIONS

__all__ = ["ADVANTAGES", "STEP_ADVANTAGES", "ESTIMATORS", "NEEDS_CRITIC", "AGGREGATIONS", "CLIP_DEFAULTS",
           "POLICY_LOSSES", "CORRECTIONS", "ALL_ADVANTAGES", "kl_penalty", "lookup"]

# every advantage estimator by name: token-level ones computed at training time, step-level ones
# (agents) from the episodes' turns when the batch is built
ALL_ADVANTAGES = {**ESTIMATORS, **STEP_ADVANTAGES}


def lookup(registry: dict, name: str, what: str):
    if name not in registry:
        raise KeyError(f"unknown {what} {name!r}; valid: {', '.join(sorted(registry))}")
    return registry[name]
