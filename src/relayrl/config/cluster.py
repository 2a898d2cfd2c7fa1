"""The ray section: which cluster the engines run on, and on which of its nodes (``relayrl.engine.ray_engine``)."""

from __future__ import annotations

import math

from pydantic import Field, field_validator

from relayrl.config.base import _Section


class RayCfg(_Section):
    """Ray, with run.backend=ray."""

    address: str | None = Field(
        None, description="Cluster to join ('auto', or 'host:port'); null: start a local one in this process.")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of the local cluster (null: the machine's).")
    max_engine_restarts: int = Field(
        3, ge=0, description="How many times a dead engine actor is restarted before the run fails.")
    engine_resources: dict[str, float] = Field(
        default_factory=dict, description="Ray resources each engine actor asks for, which places the engines: nodes "
        "started with `ray start --resources='{\"rollout\": 4}'` and ray.engine_resources={rollout: 1} hold the engines, "
        "the trainer stays in this process. Checked at start against the cluster's live nodes (one line naming what "
        "they offer, never a wait); an engine whose node leaves is restarted on another that offers them, or the run "
        "stops naming the node's address. Empty: anywhere.")

    @field_validator("engine_resources")
    @classmethod
    def _amounts(cls, v: dict[str, float]) -> dict[str, float]:
        for name, amount in v.items():
            if not name or not math.isfinite(amount) or amount <= 0:
                raise ValueError(f"{name!r}: {amount} (a resource's name and an amount > 0)")
        return v
