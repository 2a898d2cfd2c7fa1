"""Activation checkpointing per decoder layer (``trainer.gradient_checkpointing``).

Each decoder layer (the classes a model names in ``_no_split_modules``, FSDP2's unit too) keeps only
its input for the backward pass and runs its forward again there (torch's non-reentrant
``checkpoint``): the activations held by a training step drop from every layer's intermediates to
one hidden state per layer, for about one more forward of compute.

Not transformers' ``gradient_checkpointing_enable``: its layers drop the KV cache in training
(``GradientCheckpointingLayer``: ``past_key_values=None``), and ``trainer.share_prefix`` trains
through one (the responses read their prompt's cached keys and values, and the prompt's pass
fills the cache). Here the cache is kept: a layer writes its keys and values into it during the
forward, and its replay in the backward pass starts from the cache as the first run found it (its
layers' state, restored) and leaves it as that run left it, so the replay computes what the forward
did (checked by torch: a replay that saved other tensors raises).

Only where it saves something: in training mode with gradients on. Under ``no_grad`` (the frozen
KL reference, the π_old and mismatch recomputes, the critic's values) a layer runs plainly. The
forward is patched on the instance, before FSDP2 shards it (``fully_shard``'s hooks run around the
checkpointed forward; the replay runs between them, on the gathered weights).
"""

from __future__ import annotations

import math
import types

import torch
from torch.utils.checkpoint import checkpoint

# "auto": on from this many parameters (see TrainerCfg.gradient_checkpointing)
AUTO_MIN_PARAMS = 100_000_000


def wanted(setting: str, model: torch.nn.Module) -> bool:
    """Whether ``trainer.gradient_checkpointing`` (``on`` / ``off`` / ``auto``) checkpoints ``model``."""
    if setting == "auto":
        return sum(math.prod(p.shape) for p in model.parameters()) >= AUTO_MIN_PARAMS
    return setting == "on"


def _cache_of(args, kwargs):
    from transformers import Cache

    return next((v for v in (*args, *kwargs.values()) if isinstance(v, Cache)), None)


def _forward(layer, *args, **kwargs):
    """A decoder layer's forward, checkpointed in training with gradients on."""
    run = layer._relayrl_plain_forward
    if not (layer.training and torch.is_grad_enabled()):
        return run(*args, **kwargs)
    cache = _cache_of(args, kwargs)
    if cache is None:
        return checkpoint(run, *args, use_reentrant=False, **kwargs)
    before = [dict(x.__dict__) for x in cache.layers]
    after: list = []

    def replayable(*a, **kw):
        if after:  # the replay: from the cache as the first run found it, and back as it left it
            for x, state in zip(cache.layers, before):
                x.__dict__.update(state)
        try:
            return run(*a, **kw)
        finally:
            if after:
                for x, state in zip(cache.layers, after[0]):
                    x.__dict__.update(state)
            else:
                after.append([dict(x.__dict__) for x in cache.layers])

    return checkpoint(replayable, *args, use_reentrant=False, **kwargs)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``model``'s decoder layers: its modules of the classes in ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def enable(model: torch.nn.Module) -> int:
    """Checkpoint each of ``model``'s decoder layers (in place; before sharding); the number of layers.
    A model with none (no ``_no_split_modules``) is refused: nothing would be checkpointed."""
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"trainer.gradient_checkpointing: {type(model).__name__} names no decoder layer class "
                         "(_no_split_modules): nothing to checkpoint; set trainer.gradient_checkpointing=off")
    for layer in layers:
        if not hasattr(layer, "_relayrl_plain_forward"):
            layer._relayrl_plain_forward = layer.forward
            layer.forward = types.MethodType(_forward, layer)
    return len(layers)
