"""A frozen policy as a player of a multi-agent environment's other roles (``envs.multi``): an opponent
that is a checkpoint (the policy's own earlier one, a warm start, any ``from_pretrained`` folder).

``ModelPlayer(path)`` loads the model once per process (on the CPU, or ``device``) and answers a role's
conversation with one turn sampled by ``transformers``' ``generate``, off the episodes' loop (a thread,
one move at a time). Its sampling is seeded by the conversation: the same game so far, the same move, so
an evaluation against it compares policies, not luck. An environment uses it in its ``scripted``
(``envs.games.Nim(opponent=PATH)``).

``pool:RUN_DIR`` is fictitious self-play: each player (one per match) is one of that run's complete
checkpoints as they stand when the match starts (the policy's own earlier versions, while it trains), drawn
uniformly; the last few loaded are kept in memory.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import random
import threading
from collections import OrderedDict
from pathlib import Path

_LOADED: OrderedDict[tuple[str, str], tuple] = OrderedDict()  # (path, device) -> (model, tokenizer), newest last
_KEEP = 4  # models kept loaded (a pool's checkpoints)
_LOCK = threading.Lock()
_DRAWS = itertools.count()


def pool(spec: str) -> list[str]:
    """The complete checkpoints of the run folder ``pool:RUN_DIR`` names, oldest first."""
    run = Path(spec.removeprefix("pool:")).expanduser()
    return sorted(str(c) for c in (run / "checkpoints").glob("step_*") if (c / "state.json").exists())


def pool_member(spec: str, seed: int) -> str:
    """One of ``pool(spec)``, drawn uniformly."""
    steps = pool(spec)
    if not steps:
        raise ValueError(f"opponent {spec!r}: no complete checkpoint under {spec.removeprefix('pool:')}/checkpoints yet")
    return random.Random(seed * 1_000_003 + next(_DRAWS)).choice(steps)


class ModelPlayer:
    def __init__(self, path: str, temperature: float = 1.0, max_new_tokens: int = 8, seed: int = 0,
                 device: str = "cpu"):
        from relayrl.models import resolve_model_path

        if temperature < 0 or max_new_tokens < 1:
            raise ValueError(f"opponent {path}: temperature ≥ 0 and max_new_tokens ≥ 1, got {temperature}, "
                             f"{max_new_tokens}")
        if path.startswith("pool:"):
            path = pool_member(path, seed)
        self.path = resolve_model_path(path, log=lambda *a, **k: None, field="env.args.opponent")
        self.temperature, self.max_new_tokens, self.seed, self.device = temperature, max_new_tokens, seed, device

    def _loaded(self):
        key = (self.path, self.device)
        if key not in _LOADED:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            tok = AutoTokenizer.from_pretrained(self.path)
            model = AutoModelForCausalLM.from_pretrained(self.path).to(self.device).eval()
            _LOADED[key] = (model, tok)
            while len(_LOADED) > _KEEP:
                _LOADED.popitem(last=False)
        _LOADED.move_to_end(key)
        return _LOADED[key]

    def move_now(self, messages: list[dict]) -> str:
        """One turn's text for ``messages`` (blocking)."""
        import torch

        with _LOCK:
            model, tok = self._loaded()
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True,
                                          return_tensors="pt")["input_ids"].to(self.device)
            key = json.dumps([self.seed, messages], sort_keys=True).encode()
            # its own generator, seeded by the match: the process's torch RNG (the trainer's, the engine's) is
            # never reseeded from this worker thread
            g = torch.Generator(device=self.device).manual_seed(
                int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little"))
            out, cache, feed = [], None, ids
            with torch.no_grad():
                for _ in range(self.max_new_tokens):
                    step = model(input_ids=feed, past_key_values=cache, use_cache=True)
                    logits, cache = step.logits[0, -1].float(), step.past_key_values
                    if self.temperature > 0:
                        nxt = int(torch.multinomial(torch.softmax(logits / self.temperature, -1), 1, generator=g))
                    else:
                        nxt = int(logits.argmax())
                    if nxt == tok.eos_token_id:
                        break
                    out.append(nxt)
                    feed = torch.tensor([[nxt]], device=self.device)
            return tok.decode(out, skip_special_tokens=True)

    async def move(self, messages: list[dict]) -> str:
        return await asyncio.to_thread(self.move_now, messages)
