"""How far the engine's log-probs of the tokens it sampled are from the trainer's, under the weights of the
version that sampled them (``logprob_mismatch_*``; ``run.mismatch_alarm`` stops a run on it).

Tokens of the trainer's current version are read in the step's own passes; tokens one version old
(periodic mode, async) under the weights of that version, kept from the previous step
(``VersionCheck.previous_version``). For the alarm, a few rows of fresh tokens are read under both this
version's weights and the previous version's (``fresh_against_previous``): an engine that samples the
trained policy agrees better with the first, one whose weights stopped following with the second.

The weights of one version ago are kept on the CPU (a GPU trainer would otherwise hold a second copy all
run long; FSDP's shards stay where they are: a rank holds 1/N of them); with a LoRA adapter only its
tensors (the base never changes).
"""

from __future__ import annotations

import torch

from relayrl.train import distributed, lora
from relayrl.train.batch import TrainBatch


def mismatch_sums(logp: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor) -> tuple[float, float, float]:
    """(sum, max, count) of |log π_trainer − log π_engine| over the tokens in ``mask``."""
    diff = (logp - behav).abs() * mask
    return diff.sum().item(), diff.max().item() if diff.numel() else 0.0, mask.sum().item()


def sampled_by(versions: torch.Tensor, mask: torch.Tensor, version: int) -> torch.Tensor:
    """The tokens of ``mask`` that ``version`` sampled over a context it computed (float, ``mask``'s shape): those
    whose row's earlier trained tokens all came from ``version`` too. An engine that takes new weights in the
    middle of a row (an in-flight update: the hf engines, or vLLM's, outside partial rollouts) samples the row's
    later tokens with the new weights over keys and values the old ones computed; they carry the new version,
    but no forward of either version's weights gives their log-probs, so no mismatch is read on them."""
    v = versions.masked_fill(~mask.bool(), torch.iinfo(versions.dtype).max)  # (positions off the mask do not count)
    return mask * ((v.cummin(1).values == versions) & (versions == version))


def _rows(sel: torch.Tensor, n: int) -> list[int]:
    """Up to ``n`` rows with a token in ``sel``."""
    return torch.nonzero(sel.sum(1) > 0).flatten()[:n].tolist()


class VersionCheck:
    """The trainer's memory of the previous version's weights, and the two measures taken with it.
    ``rows``: rows of one-version-old tokens read under those weights (0: none); ``check_rows``: fresh
    rows read under both versions' weights each step (0: no check; the weights are then kept only in
    modes with stale tokens)."""

    CHECK_FIRST, CHECK_EVERY = 3, 8  # the check's steps: every one of the first three, then every eighth

    def __init__(self, rows: int = 16, check_rows: int = 0):
        self.rows, self.check_rows = rows, check_rows
        self.prev: tuple[int, dict] | None = None  # (version, its weights by name)

    def due(self, version: int) -> bool:
        """Is the alarm's check run at the step training ``version``? A copy of the trainable weights is what it
        costs (kept from the step before), so it runs where an engine that does not follow is most likely seen
        first, the first steps, then every ``CHECK_EVERY``-th: a copy one step in eight, not every step."""
        return version <= self.CHECK_FIRST or version % self.CHECK_EVERY == 0

    def _prev_params(self, fwd) -> dict:
        return {k: v.to(fwd.device, non_blocking=True) for k, v in self.prev[1].items()}

    @torch.no_grad()
    def fresh_against_previous(self, fwd, batch: TrainBatch, version: int | None) -> dict:
        """Mean mismatch of up to ``check_rows`` rows of tokens sampled by ``version``, under its weights and
        under the previous version's ({} on the first step, or with no such tokens)."""
        if version is None or not self.check_rows or not self.due(version) or self.prev is None or \
                self.prev[0] != version - 1:
            return {}
        sel = sampled_by(batch.versions, batch.loss_mask, version)
        rows = _rows(sel, self.check_rows)
        if not rows:
            return {}
        sub = batch.select(rows)
        sel = sel[torch.tensor(rows), : sub.loss_mask.shape[1]]
        now = mismatch_sums(fwd.logprobs(sub), sub.behav_logp, sel)
        prev = mismatch_sums(fwd.logprobs(sub, params=self._prev_params(fwd)), sub.behav_logp, sel)
        return {"logprob_mismatch_check": now[0] / now[2], "logprob_mismatch_check_prev_weights": prev[0] / prev[2]}

    @torch.no_grad()
    def previous_version(self, fwd, batch: TrainBatch, version: int | None) -> tuple[float, float, float]:
        """Mismatch sums of up to ``rows`` rows of tokens sampled one version ago, under that version's weights
        (a small forward pass); then this version's weights are kept for the next step."""
        out = (0.0, 0.0, 0.0)
        if version is None or not self.rows:
            return out
        if self.prev is not None and self.prev[0] == version - 1:
            sel = sampled_by(batch.versions, batch.loss_mask, version - 1)
            rows = _rows(sel, self.rows)
            if rows:
                sub = batch.select(rows)
                lp = fwd.logprobs(sub, params=self._prev_params(fwd))
                out = mismatch_sums(lp, sub.behav_logp, sel[torch.tensor(rows), : lp.shape[1]])
        # kept where the next step needs them: tokens one version old (periodic, async, partial rollouts), or the
        # alarm's check due then; else dropped (sync mode: no copy between checks)
        stale = bool(((batch.versions < version) & batch.loss_mask.bool()).any())
        self.prev = None
        if stale or (self.check_rows and self.due(version + 1)):
            if fwd.dp:  # (the shards, as ``PolicyForward.swapped`` puts them back)
                distributed.reshard(fwd.model)
            where = fwd.device if fwd.dp else torch.device("cpu")
            self.prev = (version, {k: p.detach().to(where, copy=True) for k, p in lora.trainable(fwd.model).items()})
        return out
