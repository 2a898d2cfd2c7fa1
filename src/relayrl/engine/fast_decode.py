"""relayrl's own decoding forward for Llama-family models, used by the ``hf`` engine.

On a CPU, decoding a small model one token at a time is mostly Python: transformers' forward
builds masks, walks 7 ``nn.Linear`` modules per layer and grows its KV cache with ``torch.cat``
at every token. This forward does the same arithmetic with fewer, larger calls: q/k/v as one
matrix product and gate/up as another (their weights become views into one fused tensor, so
``load_state_dict`` still updates them in place and nothing is stored twice), a KV cache that
grows in chunks and is written in place, rows that finish leaving it by a swap (``KVCache.keep``),
an additive padding mask kept across tokens, and the G identical contexts of a prompt prefilled
once (``benchmarks/engines.py``: 1.27x the tokens/s of the model's own forward on the demo task;
the swap another 1.14x, ``benchmarks/decode_ab.py``).

Supported: ``llama``, ``mistral`` and ``qwen2`` (full attention), ``qwen3`` (its q/k norms) — with
any RoPE type (the model's own rotary module computes cos/sin) — and the mixtures of experts built on
them, ``qwen3_moe``, ``qwen2_moe`` and ``mixtral``, whose expert blocks are their own modules called as
they are (a MoE engine records their routes with hooks: ``row_routes.py``). Anything else, or a model of these
types whose logits this forward does not reproduce (``check``: compared with the model's own
forward when the engine starts), decodes through the model's forward as before
(``rollout.fast_decode=false`` forces that).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral")


def unsupported(model) -> str | None:
    """Why this forward cannot decode ``model`` (None: it can)."""
    c = model.config
    if c.model_type not in SUPPORTED:
        return f"model type {c.model_type!r} (supported: {', '.join(SUPPORTED)})"
    if getattr(c, "hidden_act", "silu") != "silu":
        return f"activation {c.hidden_act!r}"
    windowed = (getattr(c, "use_sliding_window", c.model_type in ("mistral", "mixtral"))
                and getattr(c, "sliding_window", None))
    if windowed or any(t != "full_attention" for t in (getattr(c, "layer_types", None) or [])):
        return "sliding-window attention"
    layer = model.model.layers[0]
    needed = ("q_proj", "k_proj", "v_proj", "o_proj")
    if not all(hasattr(layer.self_attn, n) for n in needed) or not all(
            hasattr(x.mlp, "gate_proj") or hasattr(x.mlp, "experts") for x in model.model.layers):
        return "its layers are not Llama's"
    groups = [(a.q_proj, a.k_proj, a.v_proj) for a in (x.self_attn for x in model.model.layers)]
    groups += [(x.mlp.gate_proj, x.mlp.up_proj) for x in model.model.layers if hasattr(x.mlp, "gate_proj")]
    for group in groups:
        if len({m.bias is None for m in group}) > 1:
            return "projections fused together differ in having a bias"
    return None


def _fuse(linears: list[torch.nn.Linear]) -> tuple[Tensor, Tensor | None]:
    """One weight (and bias) for ``linears``; each module's parameter becomes a view into it."""
    weight = torch.cat([m.weight.data for m in linears])
    biased = linears[0].bias is not None  # (all or none: ``unsupported``)
    bias = torch.cat([m.bias.data for m in linears]) if biased else None
    at = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = weight[at : at + n]
        if biased:
            m.bias.data = bias[at : at + n]
        at += n
    return weight, bias


class KVCache:
    """Keys and values per layer, [rows, kv heads, capacity, head dim], written in place; ``mask``
    [rows, capacity] is 0 where a row attends and a large negative number where it does not (left
    padding, columns not written yet)."""

    def __init__(self, layers: int, rows: int, kv_heads: int, head_dim: int, capacity: int, like: Tensor):
        shape = (rows, kv_heads, capacity, head_dim)
        self.k = [like.new_zeros(shape) for _ in range(layers)]
        self.v = [like.new_zeros(shape) for _ in range(layers)]
        self.masked = torch.finfo(like.dtype).min
        self.mask = like.new_full((rows, capacity), self.masked)
        self.n = 0  # columns written

    def reserve(self, extra: int) -> None:
        cap = self.mask.shape[1]
        if self.n + extra <= cap:
            return
        grow = max(self.n + extra - cap, 64, cap // 2)
        pad = lambda t: torch.cat([t, t.new_zeros(*t.shape[:2], grow, t.shape[3])], dim=2)  # noqa: E731
        self.k, self.v = [pad(t) for t in self.k], [pad(t) for t in self.v]
        self.mask = torch.cat([self.mask, self.mask.new_full((self.mask.shape[0], grow), self.masked)], 1)

    @torch.inference_mode()
    def select(self, idx: Tensor) -> None:
        """The rows ``idx``, in that order, as a new cache (the prefill's G copies of a context)."""
        self.k = [t.index_select(0, idx) for t in self.k]
        self.v = [t.index_select(0, idx) for t in self.v]
        self.mask = self.mask.index_select(0, idx)

    @torch.inference_mode()
    def keep(self, rows: list[int]) -> list[int]:
        """Keep ``rows`` (ascending; the others finished) and return their new order: row j is now
        what row ``order[j]`` was. A finished row's slot among the first ``len(rows)`` takes a kept
        row from past them, and the batch becomes the first ``len(rows)`` rows, a view: a few rows
        are copied, not the whole cache (which cost 14% of the demo's decoding time, once per finish)."""
        k, kept = len(rows), set(rows)
        holes = [i for i in range(k) if i not in kept]
        movers = [i for i in rows if i >= k]
        order = list(range(k))
        for h, m in zip(holes, movers):
            order[h] = m
        if holes:
            dst, src = torch.tensor(holes, device=self.mask.device), torch.tensor(movers, device=self.mask.device)
            for t in self.k + self.v:
                t[dst, :, : self.n] = t[src, :, : self.n]
            self.mask[dst] = self.mask[src]
        self.k, self.v, self.mask = [t[:k] for t in self.k], [t[:k] for t in self.v], self.mask[:k]
        return order


class FastDecoder:
    """``prefill`` a left-padded batch, then ``decode`` one token per row at a time (or ``verify`` a draft
    of several)."""

    def __init__(self, model):
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"relayrl's decoding forward does not support this model: {why}")
        self.model, c = model, model.config
        self.layers = []
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            qkv, qkv_bias = _fuse([a.q_proj, a.k_proj, a.v_proj])
            dense = hasattr(m, "gate_proj")  # (else a mixture of experts' block, called as it is)
            gate_up, gate_up_bias = _fuse([m.gate_proj, m.up_proj]) if dense else (None, None)
            self.layers.append((layer, qkv, qkv_bias, gate_up, gate_up_bias))
        a = model.model.layers[0].self_attn
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim, self.scaling = a.head_dim, a.scaling
        self.rows_of: Tensor | None = None  # the last prefill's forward row for each row (its context's)

    @torch.inference_mode()
    def new_cache(self, rows: int, capacity: int) -> KVCache:
        like = self.model.model.embed_tokens.weight
        return KVCache(len(self.layers), rows, self.kv_heads, self.head_dim, capacity, like)

    @staticmethod
    def _norm(norm, x: Tensor) -> Tensor:  # transformers' RMSNorm: in float32, weight after the cast back
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        return norm.weight * h.to(x.dtype)

    @staticmethod
    def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    @torch.inference_mode()
    def prefill(self, ids: Tensor, attention: Tensor, positions: Tensor, capacity: int) -> tuple[Tensor, KVCache]:
        """``ids``, ``attention`` (1 = token, 0 = left padding), ``positions``: [rows, S]. Returns the
        last column's logits and the cache (room for ``capacity`` columns; it grows if need be).
        Rows with the same context (the G samples of one prompt) are computed once and copied."""
        unique, inverse = torch.unique(torch.cat([ids, attention], dim=1), dim=0, return_inverse=True)
        first = torch.empty(len(unique), dtype=torch.long, device=ids.device)
        first[inverse] = torch.arange(len(ids), device=ids.device)  # a row holding each context
        cache = self.new_cache(len(unique), max(capacity, ids.shape[1]))
        cache.mask[:, : ids.shape[1]] = torch.where(attention[first].bool(), 0.0, cache.masked)
        logits = self._forward(ids[first], positions[first], cache)
        self.rows_of = inverse
        if not torch.equal(inverse, torch.arange(len(ids), device=ids.device)):  # (unique sorts the rows)
            cache.select(inverse)
            logits = logits.index_select(0, inverse)
        return logits, cache

    @torch.inference_mode()
    def decode(self, tokens: Tensor, positions: Tensor, cache: KVCache) -> Tensor:
        """One new token per row (``tokens``, ``positions``: [rows]); returns its logits [rows, vocab]."""
        cache.reserve(1)
        cache.mask[:, cache.n] = 0.0
        return self._forward(tokens[:, None], positions[:, None], cache)

    @torch.inference_mode()
    def verify(self, tokens: Tensor, positions: Tensor, cache: KVCache) -> Tensor:
        """A row's last token and its draft (``tokens``, ``positions``: [rows, k+1]) in one forward; the
        logits after each [rows, k+1, vocab] (speculative decoding). ``reject`` then masks the columns
        of the draft tokens a row did not accept."""
        cache.reserve(tokens.shape[1])
        cache.mask[:, cache.n : cache.n + tokens.shape[1]] = 0.0
        return self._forward(tokens, positions, cache, every=True)

    @staticmethod
    @torch.inference_mode()
    def reject(cache: KVCache, accepted: list[int], width: int) -> None:
        """After ``verify`` of ``width`` columns: a row attends to its last token and the ``accepted`` draft
        tokens after it, never again to the rest (their keys and values stay, masked: the rows' columns
        are shared). The columns past every row's accepted tokens are given back: the next forward writes
        there (a cache as long as a batch's verified tokens, not its drafts, which every later step attends over)."""
        cols = torch.arange(width, device=cache.mask.device)
        kept = torch.tensor(accepted, device=cache.mask.device)  # (from the host: no wait for the device)
        cache.mask[:, cache.n - width : cache.n].masked_fill_(cols[None, :] > kept[:, None], cache.masked)
        cache.n -= width - 1 - max(accepted)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        """Attention of ``q`` [rows, heads, S, head dim] over the cache. Without grouped heads: two matrix
        products and a softmax, which on a CPU at the demo's size take 40% less time than
        ``scaled_dot_product_attention`` for one new token a row and a third of it for a verification's two
        (``mask`` [rows × heads, S, columns]: ``_forward`` expands it once a forward); else that kernel."""
        if self.heads == self.kv_heads:
            scores = torch.baddbmm(mask, q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2), alpha=self.scaling)
            return torch.bmm(torch.softmax(scores, -1), v.flatten(0, 1)).view(q.shape)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling,
                                              enable_gqa=self.heads != self.kv_heads)

    def _forward(self, ids: Tensor, positions: Tensor, cache: KVCache, every: bool = False) -> Tensor:
        b, s = ids.shape
        n0, n1 = cache.n, cache.n + s
        x = F.embedding(ids, self.model.model.embed_tokens.weight)
        cos, sin = self.model.model.rotary_emb(x, positions)
        cos, sin = cos[:, None], sin[:, None]  # [rows, 1, S, head dim]
        mask = cache.mask[:, None, None, :n1]
        if s > 1:  # the new columns see each other causally
            causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril()
            mask = mask.expand(b, 1, s, n1).clone()
            mask[..., n0:n1].masked_fill_(~causal, cache.masked)
        if self.heads == self.kv_heads:  # (``_attend``'s matrix products: the mask of each row's every head)
            mask = mask.expand(b, self.heads, s, n1).reshape(b * self.heads, s, n1)
        h_, kv_ = self.heads * self.head_dim, self.kv_heads * self.head_dim
        for i, (layer, qkv_w, qkv_b, gu_w, gu_b) in enumerate(self.layers):
            attn = layer.self_attn
            qkv = F.linear(self._norm(layer.input_layernorm, x), qkv_w, qkv_b)
            q = qkv[..., :h_].view(b, s, self.heads, self.head_dim)
            k = qkv[..., h_ : h_ + kv_].view(b, s, self.kv_heads, self.head_dim)
            v = qkv[..., h_ + kv_ :].view(b, s, self.kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):  # qwen3
                q, k = self._norm(attn.q_norm, q), self._norm(attn.k_norm, k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            cache.k[i][:, :, n0:n1] = self._rotate(k, cos, sin)
            cache.v[i][:, :, n0:n1] = v
            out = self._attend(self._rotate(q, cos, sin), cache.k[i][:, :, :n1], cache.v[i][:, :, :n1], mask)
            x = x + F.linear(out.transpose(1, 2).reshape(b, s, h_), attn.o_proj.weight, attn.o_proj.bias)
            h = self._norm(layer.post_attention_layernorm, x)
            if gu_w is None:  # a mixture of experts' block
                x = x + layer.mlp(h)
                continue
            gate, up = F.linear(h, gu_w, gu_b).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.mlp.down_proj.weight, layer.mlp.down_proj.bias)
        cache.n = n1
        last = self._norm(self.model.model.norm, x if every else x[:, -1])
        return F.linear(last, self.model.lm_head.weight, getattr(self.model.lm_head, "bias", None))


@torch.no_grad()
def check(decoder: FastDecoder, atol: float | None = None) -> str | None:
    """Compare this forward with the model's own on a small left-padded batch (prefill, then three
    tokens): None when the logits agree within ``atol`` (relative to their scale; default 1e-3 in
    float32, 2e-2 in 16-bit types), else why not."""
    model = decoder.model
    if atol is None:
        atol = 1e-3 if model.model.embed_tokens.weight.dtype == torch.float32 else 2e-2
    vocab = model.config.vocab_size
    device = model.model.embed_tokens.weight.device
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 7), generator=g).to(device)
    att = torch.ones_like(ids)
    att[1, :3] = 0  # row 1 is left-padded
    full = torch.cat([ids, torch.randint(0, vocab, (2, 3), generator=g).to(device)], dim=1)
    full_att = torch.cat([att, torch.ones(2, 3, dtype=att.dtype, device=device)], dim=1)
    pos = (full_att.cumsum(-1) - 1).clamp(min=0)
    want = model(input_ids=full, attention_mask=full_att, position_ids=pos).logits[:, 6:].float()
    logits, cache = decoder.prefill(ids, att, pos[:, :7], 8)  # (small: the check grows it once)
    got = [logits]
    for t in range(7, 10):
        got.append(decoder.decode(full[:, t], pos[:, t], cache))
    got = torch.stack(got, dim=1).float()
    err = (got - want).abs().max().item() / max(1.0, want.abs().max().item())
    return None if err <= atol else f"its logits differ from the model's by {err:.2e} (relative)"


def fast_decoder(model) -> FastDecoder | None:
    """This forward for ``model`` if it supports the model and reproduces its logits, else None
    (with a warning saying why, when the model is of a supported type)."""
    if unsupported(model) is not None:
        return None
    decoder = FastDecoder(model)
    why = check(decoder)
    if why is not None:
        warnings.warn(f"rollout.fast_decode: decoding through the model's own forward: {why}", stacklevel=2)
        return None
    return decoder
