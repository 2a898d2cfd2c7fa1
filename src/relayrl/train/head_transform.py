"""What a model does to its LM head's output before returning it as logits, found from the model itself.

Some families change the head's output z before it leaves the forward: Granite divides it
(``logits_scaling``), Cohere multiplies it (``logit_scale``), Falcon-H1 too (``lm_head_multiplier``),
Gemma 2 and 3 squash it (``final_logit_softcapping``: cap · tanh(z / cap)). The chunked head
(``logprobs.py``) computes the logits itself, so it must apply the same map, and its output, which
passes through the model's map on its way out, must survive it.

``probe`` finds the map by running the model's forward once with a head that returns values of its
choosing (from 1e-3 to 1e4, both signs) and reading what comes out, whatever the family or the
name of its setting: every map seen so far is ``LogitMap``'s L = scale · z or L = scale · cap ·
tanh(z / cap) (a multiplier before or after the softcap is one of these). A map outside that form,
one that depends on the position or on trainable parameters, is refused with one line, never
approximated. ``logprobs.check_head`` then compares the chunked head with the model's own logits.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from relayrl.models import ModelError

REL_TOL = 1e-5  # a map is taken when it reproduces every probed value to this (relative) tolerance


class HeadTransformError(ModelError):
    """A model whose map of its head's output the chunked head cannot reproduce (a one-line model error)."""


@dataclass(frozen=True)
class LogitMap:
    """L = scale · z (``cap`` None), or L = scale · cap · tanh(z / cap)."""

    scale: float = 1.0
    cap: float | None = None

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and self.cap is None

    def forward_(self, z: torch.Tensor, divide: float = 1.0, slope: bool = False):
        """(L / ``divide`` from z in place, dL/dz / ``divide`` elementwise or None where it is the constant
        scale / divide). z: float32, consumed."""
        d = None
        if self.cap is not None:
            z = z.div_(self.cap).tanh_()
            if slope:  # scale (1 − tanh²), before z is scaled over
                d = torch.addcmul(torch.ones_like(z), z, z, value=-1.0).mul_(self.scale / divide)
            z = z.mul_(self.cap)
        f = self.scale / divide
        return (z.mul_(f) if f != 1.0 else z), d

    def encode(self, y: torch.Tensor) -> torch.Tensor:
        """A tensor the model's map turns into ``y`` · ``carry`` (the chunked head's output, which the model
        then maps as it maps logits): z = y / scale, or with a cap, cap · atanh(carry · y / (scale · cap))
        with ``carry`` small enough for tanh to be inverted to float32's precision."""
        if self.cap is None:
            return y / self.scale if self.scale != 1.0 else y
        return torch.atanh(y * (self.carry / (self.scale * self.cap))) * self.cap

    @property
    def carry(self) -> float:
        """The factor ``encode``'s values come out of the model's map with (1 without a cap): |y| up to
        1e4 (a log-prob or an entropy) stays within tanh's nearly linear part, |u| ≤ 1e-3."""
        return 1.0 if self.cap is None else 1e-7 * self.scale * self.cap

    def decode(self, out: torch.Tensor) -> torch.Tensor:
        return out / self.carry if self.cap is not None else out


def _grid(n: int, device, dtype=torch.float32) -> torch.Tensor:
    """``n`` probe values: ±(1e-3 .. 1e4) on a log scale and the interval [-4, 4], repeated to fill."""
    mags = torch.logspace(-3, 4, 64, dtype=torch.float64)
    base = torch.cat([mags, -mags, torch.linspace(-4, 4, 32, dtype=torch.float64)])
    reps = math.ceil(n / base.numel())
    return base.repeat(reps)[:n].to(device=device, dtype=dtype)


def _fit(z: torch.Tensor, out: torch.Tensor) -> LogitMap | None:
    """The ``LogitMap`` that maps ``z`` to ``out`` (float64, flat), or None."""
    def fits(m: LogitMap) -> bool:
        want = m.forward_(z.clone(), 1.0)[0]
        return bool(((want - out).abs() <= REL_TOL * out.abs().clamp(min=1.0)).all())

    nonzero = z != 0
    small = nonzero & (z.abs() == z.abs()[nonzero].min())
    slope = (out[small] / z[small]).mean().item()  # dL/dz at 0: the scale, with or without a cap
    if not math.isfinite(slope) or slope == 0.0:
        return None
    linear = LogitMap(scale=slope)
    if fits(linear):
        return LogitMap() if abs(slope - 1.0) <= REL_TOL else linear
    top = out[z == z.max()].mean().item()  # with a cap, the largest probe saturates: scale · cap
    if not math.isfinite(top) or top <= 0:
        return None
    capped = LogitMap(scale=slope, cap=top / slope)
    return capped if fits(capped) else None


@contextlib.contextmanager
def _head_returns(head, value: torch.Tensor):
    """Inside, ``head``'s forward returns ``value`` (its input's leading shape) whatever its input."""
    forward = head.forward
    head.forward = lambda x: value.reshape(*x.shape[:-1], -1).to(x.device)
    try:
        yield
    finally:
        head.forward = forward


def probe(model) -> LogitMap:
    """The map ``model``'s forward applies to its output projection's output (``HeadTransformError`` where
    it is not a scale or a softcap, varies by position, or involves trainable parameters)."""
    head = model.get_output_embeddings()
    name = type(getattr(model, "get_base_model", lambda: model)()).__name__
    vocab = head.weight.shape[0]
    tokens = max(2, math.ceil(512 / vocab))
    z = _grid(tokens * vocab, head.weight.device).reshape(1, tokens, vocab)
    ids = torch.zeros(1, tokens, dtype=torch.long, device=head.weight.device)
    was = model.training
    model.eval()
    try:
        with torch.enable_grad(), torch.autocast(ids.device.type, enabled=False), _head_returns(head, z):
            out = model(input_ids=ids, use_cache=False).logits
    finally:
        model.train(was)
    why = None
    if out.requires_grad:
        why = "depends on trainable parameters"
    elif tuple(out.shape) != tuple(z.shape):
        why = f"changes the logits' shape ({tuple(z.shape)} -> {tuple(out.shape)})"
    else:
        found = _fit(z.double().flatten(), out.detach().double().flatten())
        if found is not None:
            return found
        why = "is not a scale or a softcap"
    raise HeadTransformError(f"trainer.logprob_chunk_tokens: {name} transforms its logits after the output "
                             f"projection in a way the chunked head cannot reproduce (the map {why}): set "
                             "trainer.logprob_chunk_tokens=0")
