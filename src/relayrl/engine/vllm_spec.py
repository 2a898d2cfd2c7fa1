"""Speculative decoding in vLLM (``rollout.speculative=on`` with ``rollout.engine=vllm``): what its API takes
and how relayrl counts it.

vLLM's n-gram proposer (``method="ngram"``) drafts from the request's own prompt and output: relayrl's ``prompt``
source. Its drafts carry no probabilities, so its rejection sampler keeps a draft token x with probability p(x)
and otherwise draws from p without x, renormalised: the rule for a deterministic draft (../spec/speculative.md
A2), exact where its kernels run (a GPU: below); the log-probs it returns are the emitted tokens' under the sampling distribution
(``logprobs_mode="processed_logprobs"``), checked against the trainer's recompute by tests/test_engine_vllm.py.

The other sources are not passed to vLLM. Its ``method="suffix"`` (a suffix tree over earlier outputs: history
and siblings together) needs the ``arctic-inference`` package, which PyPI ships as a source archive only, built
against vLLM 0.26 and registering a plugin that patches vLLM (this build is 0.32); ``method="custom_class"``
imports a proposer class into the engine's process and calls ``propose`` with the batch's token arrays only (no
request id, no prompt boundary), so a prompt's earlier responses cannot be looked up by prompt there.

On vLLM's CPU build (0.32) speculation is not exact, so it is refused there: with the n-gram method on the demo model
it emitted tokens the policy gives e^-10 to e^-14, reported with log-prob −5.645 (log 1/283: uniform over the
vocabulary) or NaN, and kept 15 of 902 draft tokens (its rejection sampler's Triton kernels have no CPU backend;
vLLM says "Triton is installed, but doesn't include CPU backend. Disabling Triton."). On a GPU the same path is
the one vLLM tests; tests/test_engine_vllm.py checks it there (a GPU test: not run on this project's machines).
"""

from __future__ import annotations

import threading

from relayrl.engine.speculative import add_counts


NO_CPU_SPECULATION = (
    "rollout.speculative=on with rollout.engine=vllm needs a CUDA GPU: vLLM's CPU build samples speculative tokens "
    "from a broken distribution (measured on 0.32: tokens the policy gives e^-10 drawn as if uniform, NaN "
    "log-probs), which would make the rollout's tokens not the policy's samples; on this machine use "
    "rollout.engine=hf, whose speculative decoding is exact (docs/concepts/speculative.md)")


def speculative_config(max_draft: int) -> dict:
    """vLLM's ``speculative_config``: prompt lookup, up to ``max_draft`` tokens, from the longest of the last 8 .. 2
    tokens found (relayrl's own n-gram lengths)."""
    return {"method": "ngram", "num_speculative_tokens": max_draft, "prompt_lookup_max": 8, "prompt_lookup_min": 2}


class SpecCounts:
    """Draft tokens made and kept in vLLM, from its per-step scheduler stats (a stat logger it calls with them):
    relayrl's ``spec/...`` counts, by source ``prompt``, taken as ``HFEngine.take_spec`` gives them."""

    def __init__(self):
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()

    def logger(self):
        """A ``StatLoggerFactory`` for ``AsyncLLM.from_engine_args(stat_loggers=...)``."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        owner = self

        class Logger(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
                s = getattr(scheduler_stats, "spec_decoding_stats", None)
                emitted = getattr(iteration_stats, "num_generation_tokens", 0) or 0
                owner.record(s.num_draft_tokens if s else 0, s.num_accepted_tokens if s else 0, emitted)

            def log_engine_initialized(self):
                pass

        return Logger

    def record(self, drafted: int, accepted: int, emitted: int) -> None:
        """One engine step: ``emitted`` tokens, ``accepted`` of them drafts. Each row's forward emits one token
        past the draft tokens it kept, so the row-forwards are ``emitted − accepted``."""
        with self.lock:
            add_counts(self.counts, {"drafted": drafted, "accepted": accepted, "drafted_prompt": drafted,
                                     "accepted_prompt": accepted, "row_forwards": emitted - accepted,
                                     "emitted": emitted})

    def take(self) -> dict[str, int]:
        with self.lock:
            c, self.counts = self.counts, {}
        return c
