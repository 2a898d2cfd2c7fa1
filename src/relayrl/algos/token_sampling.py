"""The distribution tokens are sampled from, computed the same way by the engine and the trainer.

Temperature, then top-k, then top-p (nucleus), in transformers' order and with its tie rules.
With ``top_k > 0`` or ``top_p < 1`` the behaviour policy is the *truncated* distribution; the
trainer reproduces the truncation (a mask from its own logits, renormalised over the kept
tokens), so π_θ and π_behav are the same kind of object and every importance ratio compares
like with like. The alternative, correcting an untruncated π_θ against a truncated π_behav,
biases every ratio upwards by 1/(kept mass); refusing top-p would rule out a common setting.
Removed tokens get a large finite negative score rather than -inf, so log-probs stay finite
(-inf × a zero mask is NaN).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

REMOVED = -1e9


def truncation_mask(scores: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor | None:
    """Boolean mask of the tokens top-k / top-p remove from ``scores`` (already divided by the
    temperature), or None when neither is on. top-k keeps every token tied with the k-th; top-p
    removes a token when the probability of it and every less likely token is ≤ 1 − p (the most
    likely token is always kept)."""
    remove = None
    if top_k and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        remove = scores < kth
        scores = scores.masked_fill(remove, REMOVED)
    if top_p < 1.0:
        asc, idx = torch.sort(scores, dim=-1)
        tail = asc.softmax(-1).cumsum(-1) <= 1 - top_p
        tail[..., -1] = False
        by_p = tail.scatter(-1, idx, tail)
        remove = by_p if remove is None else remove | by_p
    return remove


def sampling_scores(logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Scores to sample from (float32): logits / T with removed tokens at ``REMOVED``. T = 0
    (greedy) leaves the logits unscaled."""
    x = logits.float()
    if temperature > 0 and temperature != 1.0:
        x = x / temperature
    remove = truncation_mask(x, top_k, top_p)
    return x if remove is None else x.masked_fill(remove, REMOVED)


def sampled_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0, top_k: int = 0,
                     top_p: float = 1.0) -> Tensor:
    """log π(target) under the sampling distribution, differentiable in ``logits`` (the trainer's
    side). The target itself is never removed: where the trainer's logits and the engine's differ
    by rounding at the truncation boundary, the token the engine sampled keeps a finite log-prob
    instead of one of −1e9."""
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    with torch.no_grad():
        remove = truncation_mask(x, top_k, top_p)
        if remove is not None:
            remove = remove.scatter(-1, targets.unsqueeze(-1), False)
    if remove is not None:
        x = x.masked_fill(remove, REMOVED)
    return torch.gather(F.log_softmax(x, dim=-1), -1, targets.unsqueeze(-1)).squeeze(-1)


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (a bijection: two xor-shift-multiply rounds) on int64 tensors holding
    32-bit values; the products stay below 2^63."""
    mask = 0xFFFFFFFF
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & mask
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & mask
    return x ^ (x >> 16)


def seeded_uniform(seeds: Tensor, positions: Tensor) -> Tensor:
    """One uniform number in (0, 1) per row, a function of its (seed, position) alone (int64 tensors;
    seeds taken modulo 2^32): the same row draws the same number whatever else is in its batch."""
    x = _mix32(_mix32(seeds & 0xFFFFFFFF) ^ (positions & 0xFFFFFFFF))
    return ((x >> 8).double() + 0.5) / 2**24


def sample_tokens(scores: Tensor, seeds: Tensor | None = None, positions: Tensor | None = None) -> Tensor:
    """A token per row from softmax(``scores``): from the global random stream, or (``seeds``) by
    inverting the row's cumulative distribution at ``seeded_uniform(seed, position)``. Rows whose
    seed is negative draw their number from the global stream."""
    probs = torch.softmax(scores, dim=-1)
    if seeds is None:
        return torch.multinomial(probs, 1).squeeze(1)
    u = seeded_uniform(seeds, positions)
    own = seeds < 0
    if own.any():
        u = torch.where(own, torch.rand(len(u), dtype=u.dtype, device=u.device), u)
    cdf = probs.double().cumsum(-1)
    # scaled by the row's total (rounding leaves it a hair off 1): never past the last token with mass
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).squeeze(1).clamp(max=scores.shape[-1] - 1)
