"""Log-probs and entropy through the LM head, a chunk of tokens at a time (``trainer.logprob_chunk_tokens``).

A plain forward materialises float32 logits for every position, [tokens, vocabulary] (a 16k-token
micro-batch of a 152k-token vocabulary: 10 GB, and as much again for their gradient). Here the head
is applied to the final hidden states chunk by chunk (``ChunkedHead``, an autograd function): each
chunk's logits give its tokens' log-probs under the distribution the engine sampled from
(temperature, then top-k / top-p: ``token_sampling.sampled_logprobs``) and, when asked, their
entropy (of softmax(logits / T), untruncated: ``models.entropy_from_logits``), and are dropped. The
backward pass recomputes each chunk's logits from the saved hidden states and sends the gradient
to the hidden states and to the head's weight (and bias), chunk by chunk: no more than ``chunk``
tokens' float32 logits are held at once, forward or backward.

The gradient by hand, for x = logits / T and the kept tokens' distribution q = softmax(x masked):
d log q(t) / dx = onehot(t) − q (zero on the removed tokens, which a mask sets to a constant), and for
the entropy H of p = softmax(x): dH/dx = −p (log p + H); both times 1/T for the logits.

How the trainer uses it (``install_head``, ``reading``): the model's own forward runs whole (FSDP2's
hooks gather its weights as usual), and its output projection, while ``reading`` is on, returns
[rows, positions, 2] (log-prob, entropy) instead of logits, or nothing at all (a pass run for its
KV cache only: the shared prefixes'). The float32 head of ``trainer.bf16`` is the same patch.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from relayrl.algos.token_sampling import REMOVED, sampled_logprobs, truncation_mask
from relayrl.models import entropy_from_logits
from relayrl.train.head_transform import HeadTransformError, LogitMap, probe


def _scaled_(z: torch.Tensor, T: float, lmap: LogitMap, slope: bool = False):
    """(the scores m(z) / T in float32, with ``lmap``'s m the model's own map of its head's output; and, for
    ``slope``, d scores / dz where not the constant m.scale / T, else None), in place where ``z`` is float32
    (the head's fresh output: consumed)."""
    return lmap.forward_(z.float(), T, slope)


def _head_logits(h: torch.Tensor, weight: torch.Tensor, bias, float32: bool) -> torch.Tensor:
    """The head on hidden states ``h`` [c, H]: in float32 (``float32``), else in the weight's dtype."""
    dt = torch.float32 if float32 else weight.dtype
    return F.linear(h.to(dt), weight.to(dt), None if bias is None else bias.to(dt))


# A chunk's [c, V] tensors are the largest of a checkpointed step (1,024 tokens of a 152k vocabulary: 0.6 GB
# each): both passes below work in place, so that no more than three are live at once.

def _entropy(x: torch.Tensor):
    """(entropy [c], log p, p) of p = softmax(x), the untruncated scores."""
    logp = F.log_softmax(x, -1)
    p = logp.exp()
    return -torch.einsum("cv,cv->c", p, logp), logp, p  # (a row-wise dot: no [c, V] product)


def _masked_(x: torch.Tensor, t: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The scores the engine sampled from: ``x`` with top-k / top-p's removed tokens (never the target) set to
    REMOVED, in place."""
    remove = truncation_mask(x, top_k, top_p)
    return x if remove is None else x.masked_fill_(remove.scatter(-1, t.unsqueeze(-1), False), REMOVED)


def _chunk_forward(z: torch.Tensor, t: torch.Tensor, T: float, top_k: int, top_p: float, entropy: bool,
                   lmap: LogitMap):
    """(log-probs [c], entropy [c] or None) of one chunk's head output ``z`` [c, V] (consumed) and targets ``t`` [c]."""
    x, _ = _scaled_(z, T, lmap)
    del z
    ent = _entropy(x)[0] if entropy else None
    xm = _masked_(x, t, top_k, top_p)
    return xm.gather(-1, t.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(xm, -1), ent


def _chunk_grad(z: torch.Tensor, t: torch.Tensor, T: float, top_k: int, top_p: float, g_lp, g_ent,
                lmap: LogitMap) -> torch.Tensor:
    """d loss / d z for one chunk's head output ``z`` [c, V] (consumed), given the gradients of its log-probs
    ``g_lp`` and entropy ``g_ent`` [c] (one of them may be None): g_lp (onehot(t) − q) − g_ent p (log p + H),
    times d scores / dz (1/T, times the model's map's slope)."""
    x, slope = _scaled_(z, T, lmap, slope=lmap.cap is not None)
    del z
    gx = p = None
    if g_ent is not None:
        ent, logp, p = _entropy(x)
        gx = logp.add_(ent[:, None]).mul_(p).mul_(-g_ent.float()[:, None])
        del logp
    if g_lp is not None:
        g = g_lp.float()[:, None]
        truncated = top_k > 0 or top_p < 1.0
        q = p if p is not None and not truncated else _masked_(x, t, top_k, top_p).softmax(-1)
        del x, p
        q = q.mul_(-g).scatter_add_(-1, t.unsqueeze(-1), g)
        gx = q if gx is None else gx.add_(q)
    if slope is not None:
        return gx.mul_(slope)
    f = lmap.scale / T
    return gx.mul_(f) if f != 1.0 else gx


class ChunkedHead(torch.autograd.Function):
    """(log-probs [M], entropy [M]) of hidden states [M, H] through the head, ``chunk`` rows at a time."""

    @staticmethod
    def forward(ctx, h, weight, bias, targets, T, top_k, top_p, chunk, entropy, float32, lmap):
        lp = h.new_empty(h.shape[0], dtype=torch.float32)
        ent = h.new_zeros(h.shape[0], dtype=torch.float32)
        with torch.autocast(h.device.type, enabled=False), torch.no_grad():
            for s in range(0, h.shape[0], chunk):
                a, b = _chunk_forward(_head_logits(h[s : s + chunk], weight, bias, float32), targets[s : s + chunk],
                                      T, top_k, top_p, entropy, lmap)
                lp[s : s + chunk] = a
                if b is not None:
                    ent[s : s + chunk] = b
        ctx.save_for_backward(h, weight, bias, targets)
        ctx.args = (T, top_k, top_p, chunk, entropy, float32, lmap)
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        h, weight, bias, targets = ctx.saved_tensors
        T, top_k, top_p, chunk, entropy, float32, lmap = ctx.args
        g_ent = g_ent if entropy else None
        if g_lp is None and g_ent is None:
            return (None,) * 11
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        g_h = torch.zeros_like(h) if want_h else None
        g_w = torch.zeros_like(weight, dtype=torch.float32) if want_w else None
        g_b = torch.zeros_like(bias, dtype=torch.float32) if want_b and bias is not None else None
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, h.shape[0], chunk):
                hc, t = h[s : s + chunk], targets[s : s + chunk]
                gx = _chunk_grad(_head_logits(hc, weight, bias, float32), t, T, top_k, top_p,
                                 None if g_lp is None else g_lp[s : s + chunk],
                                 None if g_ent is None else g_ent[s : s + chunk], lmap)
                gz = gx.to(torch.float32 if float32 else weight.dtype)  # (the head's dtype)
                if g_h is not None:
                    g_h[s : s + chunk] = (gz @ weight.to(gz.dtype)).to(h.dtype)
                if g_w is not None:
                    g_w.addmm_(gz.t().float(), hc.float())
                if g_b is not None:
                    g_b += gz.sum(0).float()
                del gx, gz  # (before the next chunk's)
        return (g_h, None if g_w is None else g_w.to(weight.dtype), None if g_b is None else g_b.to(bias.dtype),
                None, None, None, None, None, None, None, None)


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                     temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, chunk: int = 4096,
                     entropy: bool = False, float32: bool = False, keep: torch.Tensor | None = None,
                     lmap: LogitMap = LogitMap()):
    """(log-probs, entropy or None), shaped as ``targets``, of hidden states [..., H] through the head
    ``weight`` [V, H] (``bias``) and the model's map of its output (``lmap``), ``chunk`` tokens at a time.
    ``keep`` (bool, ``targets``' shape): only those positions computed, the others 0."""
    shape = targets.shape
    h, t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    if keep is not None:
        where = torch.nonzero(keep.reshape(-1)).squeeze(1)
        h, t = h.index_select(0, where), t.index_select(0, where)
    lp, ent = ChunkedHead.apply(h, weight, bias, t, temperature, top_k, top_p, max(1, chunk), entropy, float32, lmap)
    if keep is not None:
        lp = lp.new_zeros(shape.numel()).index_copy(0, where, lp)
        ent = ent.new_zeros(shape.numel()).index_copy(0, where, ent)
    return lp.reshape(shape), ent.reshape(shape) if entropy else None


def plain_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                   top_p: float = 1.0, entropy: bool = False):
    """The unchunked reference: (log-probs, entropy or None) of whole logits."""
    lp = sampled_logprobs(logits, targets, temperature, top_k, top_p)
    return lp, entropy_from_logits(logits, temperature) if entropy else None


# -- the head, patched -------------------------------------------------------------------------------

@dataclass
class Reading:
    """What the head returns while ``reading``: targets [N, S] aligned with the positions it sees (None:
    nothing, a pass run for its cache), and the rest of ``chunked_logprobs``' arguments."""

    targets: torch.Tensor | None
    keep: torch.Tensor | None = None
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    chunk: int = 4096
    entropy: bool = False
    read: bool = False  # set by the head: it ran


def install_head(model, float32: bool) -> None:
    """Patch ``model``'s output projection: plain logits (``float32``: computed in float32 under
    autocast, from its weight, tied or its own, in float32: a bfloat16 base's cast) unless ``reading`` is on. The forward
    is bound to this module, so that a deep copy's is its copy's.

    What the model's forward does to the head's output after it (a scale, a softcap: ``head_transform``)
    is found once, here: the chunked head applies it to its logits, and encodes its own output so that the
    model's map gives it back (decoded by a hook on ``model``'s forward, where the map is not a scale)."""
    head = model.get_output_embeddings()
    lmap = probe(model)

    def forward(head, x: torch.Tensor) -> torch.Tensor:
        r = head._relayrl_reading
        if r is not None:
            r.read = True
        if r is None:
            if not float32:
                return F.linear(x, head.weight, head.bias)
            with torch.autocast(x.device.type, enabled=False):  # (.float(): a bfloat16 base's head, cast)
                return F.linear(x.float(), head.weight.float(), None if head.bias is None else head.bias.float())
        if r.targets is None:
            return x[..., :0]
        lp, ent = chunked_logprobs(x, head.weight, head.bias, r.targets, r.temperature, r.top_k, r.top_p, r.chunk,
                                   r.entropy, float32, r.keep, lmap)
        return lmap.encode(torch.stack([lp, lp.new_zeros(()).expand_as(lp) if ent is None else ent], -1))

    def decode(module, args, out):  # (what it reads, it reads off ``module``: a deep copy's hook is its copy's)
        h = module.get_output_embeddings()
        if h._relayrl_reading is None or h._relayrl_map.carry == 1.0:
            return out
        out.logits = h._relayrl_map.decode(out.logits)
        return out

    head._relayrl_reading = None
    head._relayrl_map = lmap
    head.forward = types.MethodType(forward, head)
    if getattr(model, "_relayrl_decode", None) is None:
        model._relayrl_decode = model.register_forward_hook(decode)


@torch.no_grad()
def check_head(model, readout: "Readout", tokens: int = 12) -> None:
    """The chunked head's log-probs and entropy against the model's own logits' on a short random row
    (``install_head``'s model, float32, no autocast): a ``HeadTransformError`` naming the difference where they
    differ, never wrong numbers. Done once, when the trainer starts."""
    head = model.get_output_embeddings()
    vocab = head.weight.shape[0]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, tokens), generator=g).to(head.weight.device)
    targets = torch.cat([ids[:, 1:], ids[:, :1]], 1)
    was = model.training
    model.eval()
    try:
        with torch.autocast(ids.device.type, enabled=False):
            logits = model(input_ids=ids, use_cache=False).logits.float()
            want = readout.logp(logits, targets), entropy_from_logits(logits, readout.temperature)
            with reading(model, Reading(targets, None, readout.temperature, readout.top_k, readout.top_p,
                                        max(1, tokens // 3), True)):
                out = model(input_ids=ids, use_cache=False).logits
    finally:
        model.train(was)
    for name, got, w in (("log-probs", out[..., 0], want[0]), ("entropy", out[..., 1], want[1])):
        err = (got - w).abs().max().item()
        if not err <= 1e-3 * max(1.0, w.abs().max().item()):
            raise HeadTransformError(f"trainer.logprob_chunk_tokens: the chunked head's {name} differ from "
                                     f"{type(model).__name__}'s own by {err:.2g} (its map of the head's output, "
                                     f"{head._relayrl_map}, is not reproduced): set trainer.logprob_chunk_tokens=0")


@dataclass
class Readout:
    """The trainer's log-probs: the engine's distribution (T, top-k, top-p), through the head in chunks of
    ``chunk`` tokens (0: from whole logits)."""

    chunk: int
    temperature: float
    top_k: int = 0
    top_p: float = 1.0

    def context(self, model, targets: torch.Tensor | None, keep: torch.Tensor | None, entropy: bool):
        """Inside, ``model``'s head returns (log-prob, entropy) of ``targets`` (None: nothing, a pass for its
        cache only), where chunked; else (``chunk`` 0) it returns the logits."""
        if not self.chunk:
            return contextlib.nullcontext()
        return reading(model, Reading(targets, keep, self.temperature, self.top_k, self.top_p, self.chunk, entropy))

    def logp(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """log π of the targets under the distribution the engine samples from, from whole logits."""
        return sampled_logprobs(logits, targets, self.temperature, self.top_k, self.top_p)

    def split(self, out: torch.Tensor, targets: torch.Tensor, entropy_grad: bool | None = None):
        """(log-probs, entropy or None) from a forward's outputs (logits, or chunked (log-prob, entropy)
        pairs); the entropy only for ``entropy_grad`` not None, with its gradient if true."""
        if self.chunk:
            ent = None if entropy_grad is None else out[..., 1] if entropy_grad else out[..., 1].detach()
            return out[..., 0], ent
        ent = None if entropy_grad is None else entropy_from_logits(out if entropy_grad else out.detach(),
                                                                    self.temperature)
        return self.logp(out, targets), ent


@contextlib.contextmanager
def reading(model, r: Reading | None):
    """``model``'s head (``install_head``) returns ``r``'s (log-prob, entropy) pairs inside (None: logits).
    A forward that did not run this head (a module that runs another model's) raises: its output would be
    read as pairs."""
    head = model.get_output_embeddings()
    was, head._relayrl_reading = head._relayrl_reading, r
    try:
        yield
    finally:
        head._relayrl_reading = was
    if r is not None and not r.read:
        raise RuntimeError(f"trainer.logprob_chunk_tokens: {type(model).__name__}'s forward did not run its own "
                           "output projection (get_output_embeddings): set trainer.logprob_chunk_tokens=0")
