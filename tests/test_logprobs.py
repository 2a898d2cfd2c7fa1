"""trainer.logprob_chunk_tokens: log-probs and entropy through the LM head chunk by chunk (train/logprobs.py)
equal the whole logits' (values and gradients), and no more than a chunk of logits is ever held."""

import copy
import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from relayrl.config import AlgoCfg, TrainerCfg
from relayrl.train import logprobs as LP
from relayrl.train.logprobs import chunked_logprobs, plain_logprobs
from relayrl.train.trainer import Trainer
from tests.test_shared_prefix import _groups


def test_values_by_hand():
    # two tokens, vocabulary 3, the head the identity on 3-dim hidden states: logits are the hidden states
    h = torch.tensor([[0.0, math.log(2), math.log(3)], [1.0, 1.0, 1.0]])
    w = torch.eye(3)
    lp, ent = chunked_logprobs(h, w, None, torch.tensor([1, 0]), chunk=1, entropy=True)
    # softmax([1, 2, 3] / 6): token 1 has 2/6; a uniform row: 1/3, entropy log 3
    assert lp.tolist() == pytest.approx([math.log(2 / 6), math.log(1 / 3)], abs=1e-6)
    p = torch.tensor([1, 2, 3]) / 6
    assert ent.tolist() == pytest.approx([float(-(p * p.log()).sum()), math.log(3)], abs=1e-6)
    # T = 2: softmax(logits / 2); top-k 2 at T = 1: token 0 removed, token 2 keeps 3/5
    lp2, _ = chunked_logprobs(h[:1], w, None, torch.tensor([2]), temperature=2.0, chunk=1)
    q = torch.tensor([1, 2, 3]).sqrt()
    assert lp2.item() == pytest.approx(math.log(q[2] / q.sum()), abs=1e-6)
    lpk, _ = chunked_logprobs(h[:1], w, None, torch.tensor([2]), top_k=2, chunk=1)
    assert lpk.item() == pytest.approx(math.log(3 / 5), abs=1e-6)
    # the gradient by hand: d log q(t) / d logits = onehot(t) − q
    h1 = h[:1].clone().requires_grad_(True)
    chunked_logprobs(h1, w, None, torch.tensor([1]), chunk=1)[0].sum().backward()
    torch.testing.assert_close(h1.grad[0], torch.tensor([0.0, 1.0, 0.0]) - p)


CASES = [  # (T, top_k, top_p, chunk): chunk boundaries inside rows of 7, rows shorter than a chunk, one token a chunk
    (1.0, 0, 1.0, 3), (0.7, 0, 1.0, 5), (1.3, 4, 1.0, 1), (1.0, 0, 0.8, 10), (0.6, 5, 0.9, 4), (1.0, 0, 1.0, 100),
]


@pytest.mark.parametrize("T,top_k,top_p,chunk", CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_values_and_gradients_equal_the_whole_logits(T, top_k, top_p, chunk, bias):
    g = torch.Generator().manual_seed(0)
    h0 = torch.randn(3, 7, 8, generator=g, dtype=torch.float64)
    w0 = torch.randn(11, 8, generator=g, dtype=torch.float64)
    b0 = torch.randn(11, generator=g, dtype=torch.float64) if bias else None
    targets = torch.randint(0, 11, (3, 7), generator=g)
    a, c = torch.randn(3, 7, generator=g, dtype=torch.float64), torch.randn(3, 7, generator=g, dtype=torch.float64)
    out = []
    for chunked in (False, True):
        h, w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        b = None if b0 is None else b0.clone().requires_grad_(True)
        if chunked:
            lp, ent = chunked_logprobs(h, w, b, targets, T, top_k, top_p, chunk, entropy=True)
        else:
            lp, ent = plain_logprobs(F.linear(h, w, b), targets, T, top_k, top_p, entropy=True)
        ((a * lp).sum() + (c * ent).sum()).backward()
        out.append((lp, ent, h.grad, w.grad, None if b is None else b.grad))
    for x, y in zip(*out):
        if x is not None:
            torch.testing.assert_close(y.double(), x.double(), atol=1e-5, rtol=1e-5)
    assert out[1][2].abs().sum() > 0 and out[1][3].abs().sum() > 0


def test_entropy_alone_and_log_probs_alone_have_their_own_gradients():
    g = torch.Generator().manual_seed(1)
    h0, w0 = torch.randn(9, 6, generator=g), torch.randn(13, 6, generator=g)
    t = torch.randint(0, 13, (9,), generator=g)
    for pick in (0, 1):
        grads = []
        for chunked in (False, True):
            h, w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
            pair = (chunked_logprobs(h, w, None, t, 0.8, chunk=4, entropy=True) if chunked
                    else plain_logprobs(F.linear(h, w), t, 0.8, entropy=True))
            pair[pick].sum().backward()
            grads.append((h.grad, w.grad))
        for x, y in zip(*grads):
            torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-4)


def test_tied_head_gets_both_gradients():
    """The head's weight is also the embedding: its gradient is the sum of both uses, as with whole logits."""
    g = torch.Generator().manual_seed(2)
    w0 = torch.randn(10, 4, generator=g)
    ids = torch.randint(0, 10, (2, 5), generator=g)
    grads = []
    for chunked in (False, True):
        w = w0.clone().requires_grad_(True)
        h = torch.tanh(w[ids] * 2)
        t = ids.roll(-1, 1)
        lp = chunked_logprobs(h, w, None, t, chunk=3)[0] if chunked else plain_logprobs(F.linear(h, w), t)[0]
        lp.sum().backward()
        grads.append(w.grad)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-5)


def test_keep_computes_only_those_positions():
    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(2, 6, 4, generator=g), torch.randn(9, 4, generator=g)
    t = torch.randint(0, 9, (2, 6), generator=g)
    keep = torch.rand(2, 6, generator=g) > 0.4
    lp, ent = chunked_logprobs(h, w, None, t, chunk=2, entropy=True, keep=keep)
    want, went = plain_logprobs(F.linear(h, w), t, entropy=True)
    torch.testing.assert_close(lp[keep], want[keep])
    torch.testing.assert_close(ent[keep], went[keep])
    assert (lp[~keep] == 0).all() and (ent[~keep] == 0).all()


def test_no_more_than_a_chunk_of_logits_forward_or_backward(monkeypatch):
    rows = []
    head = LP._head_logits
    monkeypatch.setattr(LP, "_head_logits", lambda h, *a: rows.append(h.shape[0]) or head(h, *a))
    h = torch.randn(4, 9, 8, requires_grad=True)
    w = torch.randn(20, 8, requires_grad=True)
    lp, _ = chunked_logprobs(h, w, None, torch.randint(0, 20, (4, 9)), chunk=5)
    forward = len(rows)
    lp.sum().backward()
    assert forward == math.ceil(36 / 5) and len(rows) == 2 * forward and max(rows) == 5


class _LiveChunkTensors(TorchDispatchMode):
    """The most tensors of ``numel`` elements (a chunk's [c, V]) alive at once, by storage."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.live, self.most = numel, set(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() == self.numel * t.element_size():
                key = t.untyped_storage().data_ptr()
                if key not in self.live:
                    self.live.add(key)
                    weakref.finalize(t, self.live.discard, key)
                    self.most = max(self.most, len(self.live))
        return out


@pytest.mark.parametrize("entropy,T,top_p", [(False, 1.0, 1.0), (True, 1.0, 1.0), (True, 0.7, 1.0),
                                             (True, 1.0, 0.9)])
def test_a_chunk_holds_at_most_three_of_its_logit_sized_tensors(entropy, T, top_p):
    """The [c, V] tensors are a checkpointed step's peak (0.6 GB each at 1,024 tokens of a 152k vocabulary):
    forward and backward work in place (two live at most for the log-probs, three with the entropy's gradient;
    top-p's sort, probabilities and masks add theirs)."""
    c, V = 6, 1000  # (no other tensor of c × V elements: the hidden size is 8, 12 positions)
    h = torch.randn(12, 8, requires_grad=True)
    w = torch.randn(V, 8, requires_grad=True)
    t = torch.randint(0, V, (12,))
    with _LiveChunkTensors(c * V) as mode:
        lp, ent = chunked_logprobs(h, w, None, t, temperature=T, top_p=top_p, chunk=c, entropy=entropy)
        (lp.sum() + (ent.sum() if entropy else 0)).backward()
    assert mode.most <= (2 if not entropy else 3) + (4 if top_p < 1 else 0), mode.most  # (old code: 5, 7, 8, 9)


def test_float32_head_under_bf16_autocast():
    """trainer.bf16: bfloat16 hidden states, the head in float32 from the float32 weight (as install_head's
    plain logits), the hidden states' gradient back in bfloat16."""
    g = torch.Generator().manual_seed(4)
    h0, w0 = torch.randn(2, 5, 8, generator=g).bfloat16(), torch.randn(16, 8, generator=g)
    t = torch.randint(0, 16, (2, 5), generator=g)
    out = []
    for chunked in (False, True):
        h, w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        with torch.autocast("cpu", torch.bfloat16):
            if chunked:
                lp, _ = chunked_logprobs(h, w, None, t, chunk=3, float32=True)
            else:
                with torch.autocast("cpu", enabled=False):
                    lp, _ = plain_logprobs(F.linear(h.float(), w), t)
        lp.sum().backward()
        assert lp.dtype == torch.float32 and h.grad.dtype == torch.bfloat16
        out.append((lp, h.grad, w.grad))
    for x, y in zip(*out):
        torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5)


def test_the_float32_head_of_a_bfloat16_base_casts_its_weight():
    """A bfloat16 base (its head's weight bfloat16) asked for the float32 head: float32 logits from the weight cast,
    not "expected m1 and m2 to have the same dtype" (benchmarks/trainer_memory.py --base-dtype bfloat16)."""
    from relayrl.demo import model as demo_model
    from tests.families import build

    model = build("llama", demo_model.build_tokenizer(demo_model.RECIPE["seed"], 300)).bfloat16()
    LP.install_head(model, float32=True)
    head, x = model.get_output_embeddings(), torch.randn(3, 32).bfloat16()
    with torch.autocast("cpu", torch.bfloat16):
        z = head(x)
    assert z.dtype == torch.float32
    torch.testing.assert_close(z, F.linear(x.float(), head.weight.float()))


# -- through the trainer -----------------------------------------------------------------------------------

def _trainer(model, chunk, share, bf16=False, **algo):
    return Trainer(model, TrainerCfg(logprob_chunk_tokens=chunk, share_prefix=share, micro_batch_tokens=64, bf16=bf16),
                   AlgoCfg(**algo), 0.8, 10, 16, top_k=40, top_p=0.95)


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("bf16", [False, True])
def test_trainer_chunked_equals_whole_logits(tiny, share, bf16):
    """The policy's log-probs (π_old, the reference's), loss, entropy and gradient (tied embeddings: the demo's),
    plain forward and shared prefixes, float32 and bf16: chunks of 7 tokens against whole logits."""
    model, tok = tiny
    assert model.config.tie_word_embeddings
    batch = _groups(tok)
    out = []
    for chunk in (0, 7):
        m = copy.deepcopy(model)
        tr = _trainer(m, chunk, share, bf16, kl_coef=0.1, entropy_coef=0.01)
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            old = tr.logprobs(batch)
            ref = tr.logprobs(batch, tr.ref)
            if share:  # the shared path was taken
                assert tr.sharing.prefixes(m, batch, False) is not None
            m.zero_grad()
            m.train()
            sums = tr.accumulate(batch, old + 0.05 * batch.loss_mask, ref, batch.loss_mask.sum().item(), batch.size)
        out.append((old, ref, sums, [p.grad.clone() for p in m.parameters()]))
    (o0, r0, s0, g0), (o1, r1, s1, g1) = out
    tol = {"atol": 2e-3, "rtol": 1e-2} if bf16 else {"atol": 1e-5, "rtol": 1e-4}
    torch.testing.assert_close(o1, o0, **tol)
    torch.testing.assert_close(r1, r0, **tol)
    for k in ("loss", "kl", "entropy", "clip_frac"):
        assert s1[k] == pytest.approx(s0[k], rel=tol["rtol"], abs=tol["atol"]), k
    assert sum(g.abs().sum() for g in g1) > 0
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, **tol)


def test_trainer_step_with_chunks_is_the_whole_logits_step(tiny):
    model, tok = tiny
    batch = _groups(tok)
    steps = []
    for chunk in (0, 5):
        m = copy.deepcopy(model)
        metrics = _trainer(m, chunk, True, kl_coef=0.1).step(batch)
        steps.append((metrics, list(m.parameters())))
    (m0, p0), (m1, p1) = steps
    for k in ("loss", "grad_norm", "entropy", "logprob_mismatch_mean"):
        assert m1[k] == pytest.approx(m0[k], rel=1e-4, abs=1e-6), k
    for a, b in zip(p0, p1):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
