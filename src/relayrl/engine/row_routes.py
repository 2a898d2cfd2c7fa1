"""A mixture of experts' routes on the hf engine's rows: for every token a row feeds forward, the experts each
MoE layer chose (``models.moe.Recorder``), appended to the row in the order its tokens were fed, whichever
forward fed them (the model's own, or relayrl's decoding forward: a deduplicated prefill, one token a row, a
verified draft of which only the accepted tokens count)."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from relayrl.models import moe


class RowRoutes:
    def __init__(self, model):
        self._rec = moe.Recorder(model)
        self._last: torch.Tensor | None = None  # the last captured forward's routes, [T, layers, k]

    @contextlib.contextmanager
    def captured(self):
        """Capture the routes of the forward run inside the block (then in ``_last``)."""
        with self._rec.capture():
            yield
        self._last = self._rec.routes()

    @contextlib.contextmanager
    def forward(self, rows: list, real: list[int], rows_of: Callable[[], torch.Tensor] | None = None):
        """A forward of ``rows`` (left-padded; ``real[i]`` real tokens at the end of row i): each row's real
        tokens' routes appended to it. ``rows_of``: when the forward may run fewer rows than ``rows`` (contexts
        computed once for several rows), a call that says after it which forward row held each row's
        (``FastDecoder.prefill``'s ``rows_of``)."""
        with self.captured():
            yield
        index = rows_of() if rows_of is not None else None
        n = len(rows) if index is None else int(index.max()) + 1
        got = self._last.view(n, -1, *self._last.shape[1:])
        if index is not None:
            got = got[index.cpu()]
        for row, k, r in zip(rows, real, got):
            row.routes.append(r[r.shape[0] - k:])

    def verified(self, rows: list, width: int, accepted: list[int]) -> None:
        """After a verification forward (run in ``captured``) of each row's last token and its draft (``width``
        positions a row): a row's routes for its last token and the draft tokens it accepted (the tokens after
        were never the row's)."""
        got = self._last.view(len(rows), width, *self._last.shape[1:])
        for row, a, r in zip(rows, accepted, got):
            row.routes.append(r[: a + 1])
