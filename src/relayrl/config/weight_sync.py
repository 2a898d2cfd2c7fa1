"""The rollout section's weight-update fields: how a full-weight update reaches vLLM's workers and Ray's engine actors
(``relayrl.engine.weight_sync``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from relayrl.config.base import _Section


class WeightSyncFields(_Section):
    """Fields of ``RolloutCfg`` (it inherits them): ``rollout.weight_sync``, ``rollout.sync_bucket_mb``,
    ``rollout.sync_timeout_s``."""

    weight_sync: Literal["auto", "collective", "file"] = Field(
        "auto", description="vllm, full-weight updates: collective (the trainer broadcasts the policy to vLLM's workers "
        "in a gloo group of their own, bucket by bucket, each bucket loaded as it arrives), file (a safetensors file in "
        "/dev/shm the workers reload), or auto (the collective where it can be formed, else the file, the reason "
        "logged at start). Adapters (model.lora) always travel as adapters. run.backend=ray, to each engine actor: "
        "collective (the same broadcast, the actor loading what it received), file (Ray's object store), or auto (the "
        "collective where it forms: 3.15x faster than the store on one node, docs/guides/scale.md).")
    sync_bucket_mb: int = Field(
        2048, ge=1, description="rollout.weight_sync=collective: the most megabytes broadcast at once (the host holds one "
        "bucket's copy at a time); it must hold the largest tensor of the policy, checked at start (an embedding: "
        "260 MB for Qwen2.5-0.5B in bf16, 1,040 MB for Qwen2.5-7B, 2,004 MB for Llama-3-70B).")
    sync_timeout_s: float = Field(
        120.0, gt=0, description="rollout.weight_sync=collective: the deadline of forming the group and of each bucket; "
        "an engine that dies mid-update stops the run at once, one that stalls at this deadline (never a hang).")
