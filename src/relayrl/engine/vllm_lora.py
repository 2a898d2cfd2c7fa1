"""vLLM's side of LoRA (``model.lora``): the engine keeps its base weights and every weight update is an
adapter, loaded into vLLM as a version of its own.

``prepare`` checks the adapter's tensors (PEFT's saved names and shapes, ``lora_weights.LoraSpec``) and writes them in
PEFT's format (``adapter_config.json``, ``adapter_model.safetensors``) to a fresh folder in shared memory;
``publish`` registers it as ``LoRARequest("v<version>", id, folder)`` (vLLM reads and validates it then, so a bad
adapter fails the update, not a later request) and makes it the current version. vLLM 0.32 takes adapters from a
path only (``LoRARequest`` carries no tensors, the worker reads the folder); /dev/shm is memory, so a sync is one
copy of a few MB. Reading from our own file also keeps the scaling applied once: vLLM folds alpha / r into its
copy of lora_B in place (``LoRALayerWeights.optimize``), and an adapter it evicts is read again from the folder,
never from a tensor it already scaled.

A request samples under the version current when it reaches vLLM, for its whole life (``acquire``/``release``
around it): an update never changes the weights under a running response, whose tokens all carry that version.
A version that is no longer current and that no request uses is retired: removed from vLLM (``remove_lora``) and
its folder deleted, so what stays loaded is the current version and those still sampling — in async mode at most
the staleness bound + 1 (the groups in flight were admitted at most that many versions back), which is what the
engine's adapter slots (``max_loras``) are sized for. More in use at once is still right, only slower: vLLM then
schedules one slot's worth of versions at a time and reloads evicted ones from their folders, kept until retired.

Everything but ``prepare`` runs on the engine's event loop thread, so the bookkeeping needs no lock.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from relayrl.config.rules import vllm_lora_rank
from relayrl.engine.base import EngineError
from relayrl.lora_weights import LoraSpec, by_adapter

_NAME = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])\.weight$")


def engine_args(spec: LoraSpec, versions: int) -> dict:
    """vLLM's LoRA arguments: ``versions`` adapters sampled at once (``max_loras``: batch slots), of each role's
    (``spec.adapters``, model.lora.per_role), one more each held in its CPU cache (the new version, loaded while the
    oldest still finishes), the rank rounded up to one vLLM allows."""
    try:
        rank = vllm_lora_rank(spec.r)
    except ValueError as e:
        raise EngineError(f"rollout.engine=vllm: {e}") from None
    return {"enable_lora": True, "max_lora_rank": rank, "max_loras": versions * spec.adapters,
            "max_cpu_loras": (versions + 1) * spec.adapters}


def check_adapter(state_dict: dict[str, torch.Tensor], spec: LoraSpec) -> None:
    """Raise unless ``state_dict`` is an adapter of ``spec``'s shape under PEFT's saved names: a full state dict
    sent to an engine that keeps its base weights would otherwise fail deep inside vLLM, or not at all."""
    if not state_dict:
        raise EngineError("model.lora: the vLLM engine was sent no adapter tensors")
    modules: dict[str, set[str]] = {}
    for k, v in state_dict.items():
        m = _NAME.match(k)
        if m is None:
            raise EngineError(f"model.lora: the vLLM engine keeps its base weights and takes the adapter's tensors "
                              f"only, under PEFT's saved names ('base_model.model.<module>.lora_A.weight', "
                              f"'...lora_B.weight'); got {k!r}")
        module, ab = m.groups()  # (the module itself is vLLM's to check: it refuses one it has no LoRA layer for)
        dim = 0 if ab == "A" else 1
        if v.dim() != 2 or v.shape[dim] != spec.r:
            raise EngineError(f"model.lora: adapter tensor {k!r} has shape {tuple(v.shape)}, not rank "
                              f"model.lora.r={spec.r} (lora_A: [r, in], lora_B: [out, r])")
        modules.setdefault(module, set()).add(ab)
    if half := sorted(m for m, ab in modules.items() if ab != {"A", "B"}):
        raise EngineError(f"model.lora: adapter modules without both lora_A and lora_B: {half[:3]}")


@dataclass(eq=False)
class Version:
    """One adapter version loaded in vLLM (``role``: whose, with ``model.lora.per_role``), and how many requests
    sample under it now."""

    version: int
    request: object  # vllm's LoRARequest
    folder: Path
    role: str | None = None
    users: int = 0


class AdapterVersions:
    """The adapter versions of one vLLM engine (``llm``: its ``AsyncLLM``; ``root``: the engine's shared-memory
    folder; ``base_model``: written into each adapter's config; ``dtype``: the engine's (None: as sent), which vLLM
    casts adapters to as it reads them, so they are written in it: a float32 adapter, PEFT's default beside
    bfloat16 weights, is half the bytes to write and read, and the same numbers).

    One adapter per role (``model.lora.per_role``: an update's tensors named "<role>::...", ``lora_weights.by_adapter``):
    each role has its current version, the update's, and a request samples under its role's (``GenRequest.adapter``);
    vLLM batches requests of different adapters together, so the roles need no turns (the hf engine merges one
    role's adapter at a time)."""

    def __init__(self, llm, spec: LoraSpec, base_model: str, root: Path, dtype: torch.dtype | None):
        self._llm, self.spec, self._base, self._root, self._dtype = llm, spec, base_model, root, dtype
        self.current: dict[str | None, Version] = {}  # role (None: the one adapter) -> its current version
        self.live: dict[int, Version] = {}  # lora id -> version, current and in use
        self._next_id = 1  # vLLM's adapter ids: > 0, never reused (its caches are keyed by them)

    def prepare(self, state_dict: dict[str, torch.Tensor], version: int) -> list[Version]:
        """The update's adapter (one per role) checked and written to fresh folders (on the caller's thread: no
        generation waits)."""
        try:
            per = by_adapter(state_dict) if state_dict else {None: {}}  # (none: ``check_adapter`` says so)
        except ValueError as e:
            raise EngineError(f"model.lora: {e}") from None
        if self.current and (None in per) != (None in self.current):
            raise EngineError("model.lora: an update of one adapter, where the engine holds one per role" if None in per
                              else "model.lora: an update of one adapter per role, where the engine holds one adapter")
        for tensors in per.values():
            check_adapter(tensors, self.spec)
        return [self._write(tensors, version, role) for role, tensors in per.items()]

    def _write(self, state_dict: dict[str, torch.Tensor], version: int, role: str | None) -> Version:
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        lora_id, self._next_id = self._next_id, self._next_id + 1
        folder = self._root / f"adapter-{lora_id}"
        folder.mkdir()
        save_file({k: v.detach().to("cpu", dtype=self._dtype).contiguous() for k, v in state_dict.items()},
                  str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps(self.spec.adapter_config(self._base)))
        # the name is the version's, unless that version is loaded already (LoRARequests are equal by name)
        name = f"v{version}" if role is None else f"{role}@v{version}"
        if any(v.request.lora_name == name for v in list(self.live.values())):
            name = f"{name}.{lora_id}"
        return Version(version, LoRARequest(name, lora_id, str(folder)), folder, role)

    async def publish(self, versions: list[Version]) -> None:
        """``versions`` (an update's: one per role) loaded into vLLM and made current, all or none; each role's
        previous version retired if nothing samples under it."""
        added = []
        try:
            for v in versions:
                await self._llm.add_lora(v.request)
                added.append(v)
        except Exception as e:  # (vLLM's reason, named; no folder of the update is kept)
            for v in added:
                with contextlib.suppress(Exception):
                    await self._llm.remove_lora(v.request.lora_int_id)
            for v in versions:
                shutil.rmtree(v.folder, ignore_errors=True)
            lines = [x.strip() for x in str(e).splitlines() if x.strip()]
            role = f" (role {versions[len(added)].role})" if versions[len(added)].role else ""
            raise EngineError(f"vLLM could not load the adapter of version {versions[0].version}{role}: "
                              f"{lines[-1] if lines else type(e).__name__}") from e
        for v in versions:
            old, self.current[v.role] = self.current.get(v.role), v
            self.live[v.request.lora_int_id] = v
            if old is not None and old.users == 0:
                await self._retire(old)

    def acquire(self, role: str | None = None) -> Version | None:
        """The current version of ``role``'s adapter (per role; else the one adapter's), for a request that starts
        sampling now (None: no adapter yet, the base)."""
        if not self.current:
            return None
        if None in self.current:
            v = self.current[None]
        elif role is None:
            raise EngineError("a request names no role (GenRequest.adapter), and the engine holds one adapter per "
                              f"role ({', '.join(sorted(self.current))})")
        elif role not in self.current:
            raise EngineError(f"a request's role {role!r} has no adapter on the engine (roles: "
                              f"{', '.join(sorted(self.current))})")
        else:
            v = self.current[role]
        v.users += 1
        return v

    async def release(self, v: Version | None) -> None:
        """A request under ``v`` is over; ``v`` retires if it was its last and a newer version is current."""
        if v is None:
            return
        v.users -= 1
        if v.users == 0 and v is not self.current.get(v.role):
            await self._retire(v)

    async def _retire(self, v: Version) -> None:
        if self.live.pop(v.request.lora_int_id, None) is None:
            return
        await self._llm.remove_lora(v.request.lora_int_id)
        shutil.rmtree(v.folder, ignore_errors=True)

    def folders(self) -> int:
        """Adapter folders on disk now."""
        return sum(1 for p in os.scandir(self._root) if p.name.startswith("adapter-"))
