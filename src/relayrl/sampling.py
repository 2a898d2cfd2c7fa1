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
