"""Inference engines behind one interface (``relayrl.engine.base.Engine``)."""

from relayrl.engine.base import Engine, EngineError

__all__ = ["Engine", "EngineError", "make_engine"]


def make_engine(cfg, model, tokenizer, version: int = 0, driven: bool = False) -> Engine:
    """Build the engine named by ``cfg.engine`` (a ``RolloutCfg``) around an already-loaded model.
    ``driven``: decoded by the threads that wait for it, where the engine can be (``hf``)."""
    if cfg.engine == "hf":
        from relayrl.engine.hf import HFEngine

        return HFEngine(model, tokenizer, max_batch=cfg.max_batch, version=version, driven=driven,
                        fast_decode=cfg.fast_decode)
    if cfg.engine == "hf-cb":
        from relayrl.engine.hf_cb import HFContinuousEngine
        from relayrl.records import SamplingParams

        params = SamplingParams(cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k)
        return HFContinuousEngine(
            model, tokenizer, params, version=version, num_blocks=cfg.cb_num_blocks, page_size=cfg.cb_page_size,
            max_batch_tokens=cfg.cb_max_batch_tokens, max_batch=cfg.max_batch,
        )
    raise ValueError(f"unknown engine {cfg.engine!r}; valid: hf, hf-cb")
