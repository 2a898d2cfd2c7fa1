"""The asyncio front: many episodes await their own generations at once; cancelling one aborts
its request; an engine failure reaches every waiter."""

import asyncio
import time

import pytest
import torch

from relayrl.engine import EngineError
from relayrl.engine.async_front import AsyncEngine
from relayrl.engine.hf import HFEngine
from relayrl.models import token_logprobs
from relayrl.records import FinishReason, GenRequest, SamplingParams
from tests.fake_engine import FakeEngine


def _ids(tok):
    return list(tok.apply_chat_template([{"role": "user", "content": "Add 3 4"}], add_generation_prompt=True)["input_ids"])


def test_concurrent_episodes_each_get_their_own_completion(tiny):
    model, tok = tiny
    engine = HFEngine(model, tok, eos_token_ids=[])

    async def main():
        front = AsyncEngine(engine, asyncio.get_running_loop())
        try:
            budgets = [3, 9, 5, 12, 1, 7]
            reqs = [GenRequest(f"e{i}", _ids(tok), SamplingParams(n, 1.0)) for i, n in enumerate(budgets)]
            outs = await asyncio.gather(*(front.generate(r) for r in reqs))
        finally:
            front.close()
        return reqs, outs

    try:
        reqs, outs = asyncio.run(main())
    finally:
        engine.close()
    for r, c in zip(reqs, outs):
        assert c.request_id == r.request_id and len(c.token_ids) == r.params.max_new_tokens
        assert c.finish_reason == FinishReason.LENGTH and set(c.versions) == {0}
        x = torch.tensor([r.prompt_ids + c.token_ids])
        with torch.no_grad():
            lp = token_logprobs(model(input_ids=x).logits[:, len(r.prompt_ids) - 1 : -1], x[:, len(r.prompt_ids):])
        assert torch.allclose(lp[0], torch.tensor(c.logprobs), atol=1e-4)


def test_cancelling_an_episode_aborts_its_request(tiny):
    model, tok = tiny
    engine = HFEngine(model, tok, eos_token_ids=[])

    async def main():
        front = AsyncEngine(engine, asyncio.get_running_loop())
        try:
            task = asyncio.create_task(front.generate(GenRequest("long", _ids(tok), SamplingParams(10**5, 1.0))))
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            deadline = time.monotonic() + 10
            while engine.num_pending() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert engine.num_pending() == 0  # the engine stopped it (it would run 10^5 tokens)
            after = await front.generate(GenRequest("next", _ids(tok), SamplingParams(4, 1.0)))
            assert len(after.token_ids) == 4
        finally:
            front.close()

    try:
        asyncio.run(main())
    finally:
        engine.close()


def test_an_engine_failure_reaches_every_waiting_episode():
    class Broken(FakeEngine):
        def get(self, timeout=None):
            time.sleep(0.05)
            raise EngineError("the engine process died (killed by SIGKILL)")

    async def main():
        front = AsyncEngine(Broken(0), asyncio.get_running_loop())
        try:
            reqs = [GenRequest(f"r{i}", [1, 2], SamplingParams(5)) for i in range(3)]
            return await asyncio.gather(*(front.generate(r) for r in reqs), return_exceptions=True)
        finally:
            front.close()

    outs = asyncio.run(asyncio.wait_for(main(), 10))
    assert all(isinstance(o, EngineError) and "died" in str(o) for o in outs)


def test_a_submit_that_raises_fails_its_episodes_instead_of_leaving_them_waiting():
    class Refuses(FakeEngine):
        def submit(self, requests):
            raise IndexError("list index out of range")

    async def main():
        front = AsyncEngine(Refuses(0), asyncio.get_running_loop())
        try:
            reqs = [GenRequest(f"r{i}", [1, 2], SamplingParams(5)) for i in range(2)]
            return await asyncio.gather(*(front.generate(r) for r in reqs), return_exceptions=True)
        finally:
            front.close()

    outs = asyncio.run(asyncio.wait_for(main(), 10))
    assert all(isinstance(o, EngineError) and "IndexError" in str(o) for o in outs)


@pytest.mark.parametrize("driven", [False, True])
def test_stream_yields_tokens_as_sampled_and_leaving_early_aborts(tiny, driven):
    """``stream``: pieces of one token each, then the last with its finish reason; together they are
    the response (tokens, log-probs, versions). Breaking out of the loop aborts the request. A
    driven engine streams too, decoded by the thread that waits (here, a helper thread)."""
    import threading

    model, tok = tiny
    engine = HFEngine(model, tok, eos_token_ids=[], driven=driven)
    stop = threading.Event()
    if driven:  # the thread that waits decodes; stands in for the trainer's
        threading.Thread(target=lambda: [engine.serve(stop.is_set, 0.01) for _ in iter(stop.is_set, True)],
                         daemon=True).start()

    async def main():
        front = AsyncEngine(engine, asyncio.get_running_loop())
        pumping = asyncio.get_running_loop().create_task(_pump(front)) if driven else None
        try:
            pieces = [c async for c in front.stream(GenRequest("s", _ids(tok), SamplingParams(12, 1.0)))]
            early = []
            async for c in front.stream(GenRequest("t", _ids(tok), SamplingParams(500, 1.0))):
                early.append(c)
                if len(early) == 3:
                    break
            for _ in range(200):
                if engine.num_pending() == 0:
                    break
                await asyncio.sleep(0.01)
            return pieces, early, engine.num_pending()
        finally:
            if pumping:
                pumping.cancel()
            front.close()

    try:
        pieces, early, pending = asyncio.run(main())
    finally:
        stop.set()
        engine.close()
    assert len(pieces) == 12 and all(p.finish_reason is None for p in pieces[:-1])
    assert pieces[-1].finish_reason == FinishReason.LENGTH
    assert all(len(p.token_ids) == len(p.logprobs) == len(p.versions) == 1 for p in pieces)
    assert len(early) == 3 and pending == 0  # the abandoned stream was aborted


async def _pump(front):
    while True:
        front.pump()
        await asyncio.sleep(0.002)
