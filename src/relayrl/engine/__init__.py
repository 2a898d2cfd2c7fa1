"""Inference engines behind one interface (``relayrl.engine.base.Engine``)."""

from relayrl.engine.base import Engine, EngineError

__all__ = ["Engine", "EngineError", "make_engine"]


def make_engine(r, model, tokenizer, version: int = 0, driven: bool = False, adapter=None) -> Engine:
    """Build the engine named by ``r.engine`` (``r``: the rollout section, a ``RolloutCfg``) around an
    already-loaded model. ``driven``: decoded by the threads that wait for it, where the engine can be (``hf``).
    ``adapter`` (``engine.adapter.AdapterMerge``, model.lora): ``model`` is the base, and weight updates bring
    the adapter only."""
    if r.engine == "hf":
        from relayrl.engine.hf import HFEngine
        from relayrl.engine.speculative import Speculator

        spec = (Speculator(r.speculative_sources, r.speculative_max_draft, r.speculative_batch_tokens,
                           lead=r.speculative_lead)
                if r.speculative == "on" else None)
        return HFEngine(model, tokenizer, max_batch=r.max_batch, version=version, driven=driven,
                        fast_decode=r.fast_decode, adapter=adapter, speculator=spec)
    if r.engine == "hf-cb":
        from relayrl.engine.hf_cb import HFContinuousEngine
        from relayrl.records import SamplingParams

        params = SamplingParams(r.max_new_tokens, r.temperature, r.top_p, r.top_k)
        return HFContinuousEngine(
            model, tokenizer, params, version=version, num_blocks=r.cb_num_blocks, page_size=r.cb_page_size,
            max_batch_tokens=r.cb_max_batch_tokens, max_batch=r.max_batch, adapter=adapter,
        )
    raise ValueError(f"unknown engine {r.engine!r}; valid: hf, hf-cb")
