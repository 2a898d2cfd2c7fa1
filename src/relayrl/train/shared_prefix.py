"""One forward for the prompt that a group's rows share (``trainer.share_prefix``).

The G responses to one prompt start with the same tokens. A plain forward computes them G times;
here a (mini-)batch's prefixes are forwarded once, and every micro-batch of its rows forwards only
the rows' own tokens (their suffixes), attending to their prefix through its KV cache. The training
step keeps the prefix pass's graph, collects the gradient each micro-batch sends into the cached
keys and values (they enter each micro-batch as leaves), and sends it back through the prefix pass
once at the end (``Prefixes.backward``): the gradient is the plain forward's (up to float rounding;
tested, logits and gradients), for the prefix's compute once per group instead of once per row.

A row's prefix ends before its first trained position (``loss_mask``: the logits there predict the
first trained token, so its suffix starts at that position), and at the tokens every row of its
group holds alike (agent branches whose histories differ share less). Prefixes are right-padded
into one pass; the pads are masked out of the suffixes' attention (an attention mask with holes)
and each suffix gets its own positions (``position_ids`` after its prefix): no softmax is empty.

What this needs of a model: a causal LM (or the critic's body) taking a ``DynamicCache`` with a 2-D
attention mask, ``position_ids`` and ``cache_position`` (transformers decoders). The trainer and the
critic each compare a group's outputs with the plain forward's on their first step and fall back to
the plain forward, with one line in the log, where they differ (``PrefixSharing.verify``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from relayrl.models import cache_kwarg


def cuts(input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
         group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(owner [N], cut [N]): each row's group (0..g-1) and its prefix's length: the leading tokens
    every row of its group holds alike, before the first position any of them trains."""
    N, L = input_ids.shape
    trained = loss_mask.bool()
    first = torch.where(trained.any(1), trained.float().argmax(1), torch.full((N,), L - 1))
    _, owner = torch.unique(group, return_inverse=True)
    cut = torch.zeros(N, dtype=torch.long)
    for g in range(int(owner.max()) + 1):
        rows = torch.nonzero(owner == g).flatten()
        same = (input_ids[rows] == input_ids[rows[0]]).all(0) & attention_mask[rows].bool().all(0)
        cut[rows] = min(int(same.long().cumprod(0).sum()), int(first[rows].min()))
    return owner, cut


def worth_it(owner: torch.Tensor, cut: torch.Tensor, min_prefix: int = 2) -> bool:
    """Whether some group has two rows or more with a prefix of ``min_prefix`` tokens or more."""
    shared = torch.bincount(owner)[owner] > 1
    return bool((shared & (cut >= min_prefix)).any())


class Unshareable(RuntimeError):
    """A model whose cache holds more than keys and values (a hybrid's recurrent state): a prefix's keys and values
    alone do not give its suffixes their context."""


def _state_beside_keys(cache) -> str | None:
    """The name of a state a cache layer holds beside its keys and values (Falcon-H1's Mamba conv and recurrent
    states), or None."""
    for layer in getattr(cache, "layers", []):
        for name, v in vars(layer).items():
            if name in ("keys", "values"):
                continue
            if (torch.is_tensor(v) and v.numel()) or (isinstance(v, dict) and any(torch.is_tensor(x) for x in v.values())):
                return f"{type(layer).__name__}.{name}"
    return None


def _logits(out) -> torch.Tensor:
    return out.logits


class Prefixes:
    """The prefixes of ``batch``'s groups forwarded once (``grad``: the graph kept for ``backward``),
    and its rows' outputs given micro-batch by micro-batch (``outputs``). ``model``: the module that
    takes the cache (a causal LM, or the critic's body); ``call(targets, **kwargs)`` runs it (default: itself,
    ``targets`` ignored): ``targets`` is None for the prefixes' pass (its outputs are not read, only its cache)
    and, for a micro-batch's suffixes, (the token each position predicts [k, S], whether it is trained [k, S]),
    for a head that reads only those (``logprobs.reading``); ``readout(output)`` [k, S, X]: what is read off
    its output (default: the logits)."""

    def __init__(self, model, batch, owner: torch.Tensor, cut: torch.Tensor, budget: int, grad: bool, call=None,
                 readout=_logits):
        self.model, self.batch, self.owner, self.cut, self.readout = model, batch, owner, cut, readout
        self.call = call or (lambda targets=None, **kw: model(**kw))
        self.dev = next(model.parameters()).device
        self.kw = cache_kwarg(model)
        self.config = getattr(model, "module", model).config
        self.lens = batch.attention_mask.sum(1)
        g = int(owner.max()) + 1
        first = [int(torch.nonzero(owner == i)[0]) for i in range(g)]
        self.gcut = cut[torch.tensor(first)]  # [g]
        C = self.C = int(self.gcut.max())
        self.mask = (torch.arange(C) < self.gcut.unsqueeze(1)).long()  # [g, C]
        ids = torch.where(self.mask.bool(), batch.input_ids[torch.tensor(first), :C], 0)
        # the prefix pass, in chunks of groups under the token budget; each chunk's keys and values padded to C
        order = sorted(range(g), key=lambda i: int(self.gcut[i]))
        chunks, cur = [], []
        for i in order:
            if cur and (len(cur) + 1) * int(self.gcut[i]) > budget:
                chunks.append(cur)
                cur = []
            cur.append(i)
        chunks.append(cur)
        pairs = []  # per chunk, per layer: (keys, values) [rows, heads, C, dim]; None: a chunk with no prefix
        for ch in chunks:
            c, t = max(int(self.gcut[i]) for i in ch), torch.tensor(ch)
            if c == 0:
                pairs.append(None)
                continue
            cache = DynamicCache(config=self.config)
            self.call(None, input_ids=ids[t, :c].to(self.dev), attention_mask=self.mask[t, :c].to(self.dev),
                      use_cache=True, **{self.kw: cache})
            if (extra := _state_beside_keys(cache)) is not None:
                raise Unshareable(f"its cache holds {extra} beside keys and values (a recurrent layer's state, which "
                                  "a prefix's keys and values do not carry)")
            pairs.append([tuple(F.pad(x, (0, 0, 0, C - c)) for x in (layer.keys, layer.values))
                          for layer in cache.layers])
        like = next(p for p in pairs if p is not None)
        back = torch.tensor([i for ch in chunks for i in ch]).argsort().to(self.dev)  # chunk order -> group order

        def part(p, ch, layer: int, j: int) -> torch.Tensor:
            x = like[layer][j]
            return p[layer][j] if p is not None else x.new_zeros((len(ch), *x.shape[1:]))

        self.kv = [[torch.cat([part(p, ch, layer, j) for p, ch in zip(pairs, chunks)])[back] for j in (0, 1)]
                        for layer in range(len(like))]
        # what each micro-batch reads: leaves, whose gradients backward() sends through the prefix pass
        self.leaves = [[x.detach().requires_grad_(grad) for x in pair] for pair in self.kv]

    def micro_batches(self, budget: int) -> list[list[int]]:
        """Rows sorted by suffix length, each micro-batch with rows × longest suffix ≤ ``budget``."""
        suffix = (self.lens - self.cut).tolist()
        groups, cur, longest = [], [], 0
        for i in sorted(range(len(suffix)), key=lambda i: suffix[i]):
            if cur and max(longest, suffix[i]) * (len(cur) + 1) > budget:
                groups.append(cur)
                cur, longest = [], 0
            cur.append(i)
            longest = max(longest, suffix[i])
        return groups + [cur] if cur else groups

    def outputs(self, idx: list[int]) -> torch.Tensor:
        """Outputs [k, L-1, X] (logits: X the vocabulary) of rows ``idx`` aligned with the plain forward's
        ``[:, :-1]`` of ``batch.select(idx)`` (L: their longest row); positions inside a row's prefix hold
        its first suffix output (nothing trained is predicted there)."""
        t = torch.tensor(idx)
        cut, lens, own = self.cut[t], self.lens[t], self.owner[t]
        L, S = int(lens.max()), int((lens - cut).max())
        C = max(int(cut.max()), 1)  # these rows' longest prefix (at least one position: a masked one, if none)
        pos = cut.unsqueeze(1) + torch.arange(S)  # [k, S]: each suffix token's position in its row
        inside = pos < lens.unsqueeze(1)
        rows = self.batch.input_ids[t]
        ids = torch.where(inside, rows.gather(1, pos.clamp(max=rows.shape[1] - 1)), 0)
        att = torch.cat([self.mask[own, :C], inside.long()], 1)
        # what each suffix position predicts (the row's next token), and whether that is trained
        nxt = rows.gather(1, (pos + 1).clamp(max=rows.shape[1] - 1))
        lm = self.batch.loss_mask[t]
        trained = (pos < lm.shape[1]) & lm.gather(1, pos.clamp(max=lm.shape[1] - 1)).bool()
        cache = DynamicCache(config=self.config)
        o = own.to(self.dev)
        for layer, (k, v) in enumerate(self.leaves):
            cache.update(k[o, :, :C], v[o, :, :C], layer)
        d = self.dev
        out = self.call((nxt.to(d), trained.to(d)), input_ids=ids.to(d), attention_mask=att.to(d),
                        position_ids=pos.to(d), cache_position=torch.arange(C, C + S, device=d), use_cache=True,
                        **{self.kw: cache})
        out = self.readout(out)  # [k, S, X]
        at = (torch.arange(L - 1) - cut.unsqueeze(1)).clamp(0, S - 1).to(d)  # [k, L-1]
        return out.gather(1, at.unsqueeze(-1).expand(-1, -1, out.shape[-1]))

    def backward(self) -> None:
        """The gradient the micro-batches sent into the cached keys and values, through the prefix pass."""
        outs = [x for pair in self.kv for x in pair]
        grads = [x.grad for pair in self.leaves for x in pair]
        live = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        if live:
            torch.autograd.backward([o for o, _ in live], [g for _, g in live])
        self.kv = self.leaves = []


class PrefixSharing:
    """The trainer's switch (``trainer.share_prefix``): on unless the model's first check fails."""

    def __init__(self, enabled: bool, budget: int, log=print, tol: float = 1e-3):
        self.enabled, self.verified, self.budget, self.log, self.tol = enabled, False, budget, log, tol

    def prefixes(self, model, batch, grad: bool, call=None, readout=_logits) -> Prefixes | None:
        """``batch``'s prefixes forwarded, or None: sharing is off, or nothing in ``batch`` is shared."""
        if not self.enabled or batch.group is None or batch.size < 2:
            return None
        owner, cut = cuts(batch.input_ids, batch.attention_mask, batch.loss_mask, batch.group)
        if not worth_it(owner, cut):
            return None
        try:
            return Prefixes(model, batch, owner, cut, self.budget, grad, call, readout)
        except Unshareable as e:
            self.enabled = False
            self.log(f"trainer.share_prefix: off for this model: {e}; training with the plain forward")
            return None

    @torch.no_grad()
    def verify(self, model, batch, plain=None, readout=_logits, call=None) -> None:
        """Once: one group's rows' outputs through the shared prefix against the plain forward's
        (``plain(mb)`` [k, L-1, X]; default: ``model``'s logits), on the positions they train; off (and
        said) where they differ by more than ``tol``. ``call``: as ``Prefixes``'."""
        if self.verified or not self.enabled or batch.group is None or batch.images:  # (images: never shared)
            return
        self.verified = True
        rows = torch.nonzero(batch.group == batch.group[0]).flatten()[:8].tolist()
        mb = batch.select(rows)
        try:
            pre = self.prefixes(model, mb, grad=False, call=call, readout=readout)
            if pre is None:
                self.verified = False  # (nothing shared in this batch: check the next one)
                return
            dev = next(model.parameters()).device
            mb = mb.to(dev)
            want = plain(mb) if plain else model(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                                                 use_cache=False).logits[:, :-1]
            diff = (pre.outputs(list(range(mb.size))) - want).abs().amax(-1)[mb.loss_mask.bool()].max().item()
            why = None if diff <= self.tol else f"differ from its plain forward's by {diff:.2g} (> {self.tol:g})"
        except Exception as e:  # noqa: BLE001 (a model that takes no KV cache, or fills another kind)
            why = f"could not be computed ({type(e).__name__}: {e})"
        if why:
            self.enabled = False
            self.log(f"trainer.share_prefix: this model's outputs through a shared prefix {why}: training with the "
                     "plain forward")
