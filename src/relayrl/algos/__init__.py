"""Algorithm registries: variants are chosen by name from these dicts."""

from relayrl.algos.advantages import ADVANTAGES
from relayrl.algos.agents import STEP_ADVANTAGES
from relayrl.algos.losses import AGGREGATIONS, POLICY_LOSSES, kl_penalty

__all__ = ["ADVANTAGES", "STEP_ADVANTAGES", "AGGREGATIONS", "POLICY_LOSSES", "kl_penalty", "lookup"]


def lookup(registry: dict, name: str, what: str):
    if name not in registry:
        raise KeyError(f"unknown {what} {name!r}; valid: {', '.join(sorted(registry))}")
    return registry[name]
