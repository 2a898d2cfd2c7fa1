"""Padding-free micro-batches (``trainer.pack``): rows concatenated end to end into one sequence.

A padded micro-batch forwards rows × its longest row; with responses of a long tail (most short, a
few at the length limit) most of that is padding, computed through every layer and thrown away.
Packed, a micro-batch is one sequence of its rows' real tokens only, under a budget of real tokens
(``micro_batches(..., packed=True)``); each row's position ids restart at 0, and transformers'
masking (``masking_utils.find_packed_sequence_indices``: called with no 2-D attention mask and no
KV cache) confines each token's attention to the earlier tokens of its own row, so every row sees
what it sees padded: the same per-token log-probs and gradient (tested against the padded path).

The attention kernel decides what packing costs: a varlen kernel (flash attention on a GPU) skips
the other rows' blocks, while SDPA and eager attention on a CPU materialise a T × T mask and
compute every block, so a packed micro-batch of many short rows costs more attention than padded
rows of them. The MLP and the head cost per real token, and that is what padding wastes.
"""

from __future__ import annotations

import torch

from relayrl.models import ModelError


class Packed:
    """The real tokens of right-padded rows (``attention_mask`` [k, L]) as one row, and back."""

    def __init__(self, attention_mask: torch.Tensor):
        self.keep = attention_mask.bool()  # [k, L]
        lengths = self.keep.sum(1)
        # position of each real token within its own row: 0, 1, ..., l_i - 1, row after row
        starts = torch.cumsum(lengths, 0) - lengths
        total = int(lengths.sum())
        self.position_ids = (torch.arange(total, device=lengths.device)
                             - torch.repeat_interleave(starts, lengths)).unsqueeze(0)  # [1, T]

    def flat(self, x: torch.Tensor) -> torch.Tensor:
        """[k, L, ...] → [1, T, ...]: the real tokens' entries, row after row."""
        return x[self.keep].unsqueeze(0)

    def unflat(self, y: torch.Tensor) -> torch.Tensor:
        """[1, T, ...] → [k, L, ...], zero at the padding."""
        out = y.new_zeros(*self.keep.shape, *y.shape[2:])
        out[self.keep] = y[0]
        return out


def padding_fraction(lengths: list[int], groups: list[list[int]], packed: bool) -> float:
    """The share of the token positions the micro-batches ``groups`` forward that are padding: rows ×
    longest each (padded), or none (packed)."""
    if packed or not groups:
        return 0.0
    forwarded = sum(len(g) * max(lengths[i] for i in g) for g in groups)
    return 1 - sum(lengths[i] for g in groups for i in g) / forwarded


class PackingError(ModelError):
    """A model whose packed forward is not its padded one (trainer.pack refused in one line)."""


def _float32_probe(model):
    """A float32 model of ``model``'s architecture, for the check where ``model``'s weights are bfloat16 (whose
    rounding, 0.01–0.1 nats here, would hide a leak: Falcon-H1's is 0.006): its config with at most 2 layers (lists
    per layer cut to match) and a vocabulary of at most 512, random weights (its head ×10), torch's RNG left as it was."""
    import copy

    base = getattr(model, "get_base_model", lambda: model)()
    cfg = copy.deepcopy(base.config)
    n, keep = cfg.num_hidden_layers, min(cfg.num_hidden_layers, 2)
    for key, value in list(vars(cfg).items()):
        if isinstance(value, list) and len(value) == n:
            setattr(cfg, key, value[:keep])
    cfg.num_hidden_layers, cfg.vocab_size = keep, min(cfg.vocab_size, 512)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(cfg, key, None), int) and getattr(cfg, key) >= cfg.vocab_size:
            setattr(cfg, key, 0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        probe = type(base)(cfg).float()
    with torch.no_grad():  # (sharper log-probs: a leak shows 10x larger, float32's rounding stays far below tol)
        probe.get_output_embeddings().weight.mul_(10)
    return probe


@torch.no_grad()
def check_packing(model, tol: float = 1e-4) -> None:
    """The model's log-probs of three rows packed into one sequence against the same rows padded (float32, eval
    mode): a ``PackingError`` naming the difference where they differ. Transformers confines attention to each
    packed row from the position ids, but not every layer follows (a recurrent layer's state runs on across rows,
    Falcon-H1's Mamba; a sliding window or attention sinks over packed rows, gpt-oss), and such a model would train
    on other numbers than it samples with: found from the model, once, when the trainer starts. A model in bfloat16
    is checked on a float32 model of its architecture (``_float32_probe``)."""
    probe = next(model.parameters()).dtype != torch.float32
    if probe:
        name = type(getattr(model, "get_base_model", lambda: model)()).__name__
        model = _float32_probe(model)
    p = next(model.parameters())
    vocab = model.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    lengths = [9, 5, 12, 7]
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(0, vocab, (n,), generator=g)
        att[i, :n] = 1
    ids, att = ids.to(p.device), att.to(p.device)
    was = model.training
    model.eval()
    try:
        with torch.autocast(p.device.type, enabled=False):
            padded = model(input_ids=ids, attention_mask=att, use_cache=False).logits.float().log_softmax(-1)
            pk = Packed(att)
            packed = pk.unflat(model(input_ids=pk.flat(ids), position_ids=pk.position_ids, use_cache=False).logits
                               .float().log_softmax(-1))
    finally:
        model.train(was)
    m = att.bool()
    err = (packed[m] - padded[m]).abs().max().item()
    if not err <= tol:
        name = name if probe else type(getattr(model, "get_base_model", lambda: model)()).__name__
        raise PackingError(f"trainer.pack: {name}'s log-probs for rows packed into one sequence differ from its padded "
                           f"rows' by {err:.2g} (a layer that does not stop at the packed rows' boundaries: a "
                           "recurrent state, a sliding window or attention sinks): set trainer.pack=false")
