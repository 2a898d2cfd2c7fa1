"""Bounded staleness (AReaL): how far rollout may run ahead of training.

Capacity rule. Let v be the policy version published to the engine (the number of optimiser
steps so far), B the number of samples one training step consumes, η the staleness bound. The
rollout side may start a new sample only while

    accepted + running < (η + v + 1) · B + extra      and      running < max_concurrent,

where ``accepted`` counts every sample ever accepted for training (cumulative, so after a
resume at version v it is v · B) and ``running`` the samples being generated now. With η = 0
at most B samples exist per version, started only after the previous step published its
weights: synchronous training. With η ≥ 1 generation runs up to η versions ahead. ``extra``
over-provisions (APRIL): that many more samples may be in flight, the ones a step does not take
being carried to the next.

The rule bounds how far generation runs ahead; a slow sample can still outlive η versions.
relayrl's rollout (``rollout.driver``) waits for such a sample rather than drop it;
``is_fresh``/``drop_stale`` serve a consumer that drops instead (AReaL's), counting what it drops.

Thread-safe: the rollout thread calls ``try_start``/``finish``, the trainer ``set_version``.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass


@dataclass
class StalenessCounters:
    accepted: int = 0  # cumulative samples accepted for training
    running: int = 0  # samples being generated now
    rejected: int = 0  # finished samples not accepted (filtered, failed)
    stale_dropped: int = 0  # samples refused at consumption for exceeding η


class StalenessManager:
    def __init__(self, eta: int, batch_size: int, max_concurrent: int | None = None, version: int = 0,
                 extra: int = 0):
        if eta < 0 or batch_size < 1 or extra < 0:
            raise ValueError(f"need eta >= 0, batch_size >= 1 and extra >= 0, got eta={eta}, "
                             f"batch_size={batch_size}, extra={extra}")
        self.eta, self.batch_size, self.extra = eta, batch_size, extra
        self.max_concurrent = max_concurrent if max_concurrent is not None else (eta + 1) * batch_size + extra
        self._lock = threading.Lock()
        self.version = version
        self.c = StalenessCounters(accepted=version * batch_size)

    def capacity(self) -> int:
        """How many more samples may start now."""
        with self._lock:
            return self._capacity()

    def _capacity(self) -> int:
        limit = (self.eta + self.version + 1) * self.batch_size + self.extra
        return max(0, min(limit - self.c.accepted - self.c.running, self.max_concurrent - self.c.running))

    def try_start(self, n: int = 1) -> int:
        """Reserve up to ``n`` generation slots; returns how many were granted."""
        with self._lock:
            k = min(n, self._capacity())
            self.c.running += k
            return k

    def finish(self, accepted: bool) -> None:
        """A started sample is done: accepted for training, or rejected (its slot is freed)."""
        with self._lock:
            if self.c.running <= 0:
                raise RuntimeError("finish() without a matching try_start()")
            self.c.running -= 1
            if accepted:
                self.c.accepted += 1
            else:
                self.c.rejected += 1

    def release(self, n: int = 1) -> None:
        """Return slots of samples set aside unfinished (aborted partials) without counting them."""
        with self._lock:
            if n > self.c.running:
                raise RuntimeError("release() of more slots than are running")
            self.c.running -= n

    def set_version(self, version: int) -> None:
        with self._lock:
            self.version = version

    def is_fresh(self, oldest_token_version: int, trainer_version: int | None = None) -> bool:
        """May a sample whose oldest token came from ``oldest_token_version`` be trained on now?"""
        v = self.version if trainer_version is None else trainer_version
        return v - oldest_token_version <= self.eta

    def drop_stale(self, n: int = 1) -> None:
        """Count ``n`` accepted samples that were refused at consumption; their quota is returned."""
        with self._lock:
            self.c.stale_dropped += n
            self.c.accepted -= n

    def state_dict(self) -> dict:
        with self._lock:
            return {"version": self.version, **asdict(self.c), "running": 0}

    def load_state_dict(self, d: dict) -> None:
        """Restore after a crash: nothing is running any more (in-flight work was lost or is re-queued)."""
        with self._lock:
            self.version = d["version"]
            self.c = StalenessCounters(d["accepted"], 0, d["rejected"], d["stale_dropped"])
