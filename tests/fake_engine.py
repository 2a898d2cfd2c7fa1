"""An engine with random generation times, for property tests of the rollout controllers.

Each request has a random length; each ``get`` advances a simulated clock by one token for
``width`` random in-flight requests (taking ``delay`` seconds) (so requests finish in a random order) and returns those that
finished or were aborted. Tokens carry the version loaded when they were produced, like a real
engine; aborted requests return exactly the tokens produced so far.
"""

import contextlib
import random
import threading
import time

from relayrl.engine.base import Engine
from relayrl.records import Completion, FinishReason


class FakeEngine(Engine):
    def __init__(self, seed: int, max_len: int = 20, width: int = 3, eos: int = 2, delay: float = 0.0):
        self.rng, self.delay = random.Random(seed), delay
        self.max_len, self.width, self.eos = max_len, width, eos
        self._version = 0
        self.lock = threading.RLock()  # pause() holds it; abort and load_weights may run inside
        self.live: dict[str, dict] = {}
        self.aborted: set[str] = set()
        self.submitted: list[str] = []

    @property
    def version(self) -> int:
        return self._version

    def submit(self, requests):
        with self.lock:
            for r in requests:
                assert r.request_id not in self.live, f"{r.request_id} submitted twice"
                left = r.params.max_new_tokens
                target = min(left, self.rng.randint(1, self.max_len))
                self.live[r.request_id] = {"target": target, "left": left, "tokens": [], "lps": [], "vers": []}
                self.submitted.append(r.request_id)

    def get(self, timeout=None):
        with self.lock:
            idle = not self.live
        time.sleep(0.001 if idle else self.delay)  # one decoding step (or a short wait for work)
        out = []
        with self.lock:
            ids = list(self.live)
            for rid in ids:
                if rid in self.aborted:
                    s = self.live.pop(rid)
                    self.aborted.discard(rid)
                    out.append(Completion(rid, s["tokens"], s["lps"], s["vers"], FinishReason.ABORTED))
            ids = [i for i in ids if i in self.live]
            for rid in self.rng.sample(ids, min(self.width, len(ids))):
                s = self.live[rid]
                done = len(s["tokens"]) + 1 >= s["target"]
                s["tokens"].append(self.eos if done else 5)
                s["lps"].append(-0.5)
                s["vers"].append(self._version)
                if done:
                    self.live.pop(rid)
                    reason = FinishReason.STOP if s["target"] < s["left"] else FinishReason.LENGTH
                    out.append(Completion(rid, s["tokens"], s["lps"], s["vers"], reason))
        return out

    def abort(self, request_ids):
        with self.lock:
            self.aborted |= set(request_ids) & set(self.live)

    @contextlib.contextmanager
    def pause(self):
        with self.lock:
            yield

    def load_weights(self, state_dict, version):
        with self.lock:
            self._version = version

    def num_pending(self):
        with self.lock:
            return len(self.live)
