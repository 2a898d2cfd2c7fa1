"""Vision-language policies: their processor, a prompt with images as tokens, and the image features that the
engine and the trainer both feed the language model.

A model whose config has a ``vision_config`` loads with ``AutoModelForImageTextToText`` and its ``AutoProcessor``,
which must come with an image processor (a processor that cannot be built is refused in one line, never replaced
by the bare tokenizer). The processor is kept on the tokenizer and on the model (``processor_of``), so every
engine and the trainer reach it from what they already hold.

A prompt's images are encoded by the vision tower (frozen by default: ``vision.train_tower``) into features that
take the place of the image tokens in the language model's input embeddings (``embed``): the engine feeds those
embeddings to its prefill (a group's G responses share one encoding of each image: ``FeatureCache``), the trainer
to its forward, so both score the same tokens under the same inputs. Gemma 3's image tokens attend to each other
both ways: ``inputs`` marks each placed image's tokens (``token_type_ids``), from which the model builds that mask in
the engine's prefill and the trainer's forward alike (a sampled image token is no image's, so it stays causal).
Families whose image tokens need positions of their own (Qwen's 3-D mRoPE) are refused at start in one line until
they are built (``check_family``).
"""

from __future__ import annotations

import collections
from typing import Sequence

import torch

from relayrl.models.images import IMAGE, key, open_image, refs_of

ATTR = "relayrl_processor"
# families whose image features replace image tokens and whose positions stay 1-D: built (smolvlm is idefics3's
# architecture; its processor needs torchvision, which does not import beside this machine's torch: not tested)
FAMILIES = ("idefics3", "smolvlm", "gemma3")
BLOCKS = ("gemma3",)  # families whose image tokens attend to each other both ways (token_type_ids)
TOWERS = ("vision_model", "connector", "vision_tower", "multi_modal_projector")  # (idefics3's, gemma3's)
_WHY_NOT = {
    "qwen2_vl": "its image tokens take 3-D (mRoPE) positions",
    "qwen2_5_vl": "its image tokens take 3-D (mRoPE) positions",
    "qwen3_vl": "its image tokens take 3-D (mRoPE) positions",
    "qwen3_vl_moe": "its image tokens take 3-D (mRoPE) positions",
}


# families the hf engine takes that vLLM is not trusted with yet, and why
NOT_ON_VLLM = {"gemma3": "its image tokens attend to each other both ways, which relayrl has not checked vLLM does "
                         "(vLLM's Gemma 3 needs torchvision, which does not import beside this project's CPU torch)"}


def not_on_vllm(path: str) -> str:
    """Why the vLLM engine refuses the vision-language model at ``path``, or ''."""
    import json
    from pathlib import Path

    kind = json.loads((Path(path) / "config.json").read_text()).get("model_type")
    return f"a {kind} vision-language model is not supported on vLLM yet: {NOT_ON_VLLM[kind]}" if kind in NOT_ON_VLLM \
        else ""


class VisionError(ValueError):
    pass


def check_family(kind: str, field: str = "model.path") -> None:
    """Refuse, in one line, a vision-language family (its ``model_type``) relayrl cannot yet train exactly."""
    if kind not in FAMILIES:
        why = _WHY_NOT.get(kind, "its image inputs are not wired into relayrl's engine and trainer")
        raise VisionError(f"{field}: a {kind} vision-language model is not supported yet: {why} "
                          f"(supported: {', '.join(FAMILIES)}; docs/reference/families.md)")


def attach(obj, processor):
    setattr(obj, ATTR, processor)
    return obj


def processor_of(obj):
    """The processor attached to a tokenizer or a model (through PEFT's and FSDP's wrappers), or None."""
    for o in (obj, getattr(obj, "module", None)):
        if o is not None:
            try:
                return getattr(o, ATTR)
            except AttributeError:
                continue
    return None


def freeze_tower(model, train: bool) -> None:
    """A vision-language policy's vision tower and connector frozen (``vision.train_tower=false``); else nothing."""
    if processor_of(model) is None or train:
        return
    for m in _tower(model):
        m.requires_grad_(False)


def _tower(model) -> list:
    """The vision tower and its connector (by the names the families give them)."""
    inner = _inner(model).model
    return [getattr(inner, n) for n in TOWERS if hasattr(inner, n)]


def lora_exclude(model) -> str | None:
    """PEFT's ``exclude_modules`` for a policy whose vision tower is frozen (``vision.train_tower=false``): its
    adapters go on the language model only (a tower's q_proj shares the language model's name)."""
    if processor_of(model) is None or any(p.requires_grad for m in _tower(model) for p in m.parameters()):
        return None
    return rf".*\b({'|'.join(TOWERS)})\b.*"


def save_tokenizer(tokenizer, path) -> None:
    """The tokenizer into ``path``; a vision-language model's whole processor (its image processor's settings and
    chat template with it), so a checkpoint or an export loads with ``AutoProcessor``."""
    (processor_of(tokenizer) or tokenizer).save_pretrained(path)


def _parts(messages: list[dict]) -> list[dict]:
    """Messages with their ``IMAGE`` markers as the content parts chat templates render (the references that an
    episode's messages carry, ``images.with_images``, left out)."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if k != "images"}
        pieces = m["content"].split(IMAGE) if isinstance(m.get("content"), str) else [m.get("content")]
        if len(pieces) == 1:
            out.append(m)
            continue
        parts = []
        for i, text in enumerate(pieces):
            if i:
                parts.append({"type": "image"})
            if text:
                parts.append({"type": "text", "text": text})
        out.append({**m, "content": parts})
    return out


def encode(tokenizer, messages: list[dict], images: Sequence[str], add_generation_prompt: bool = True,
           tools: list[dict] | None = None) -> list[int]:
    """A conversation with images as token ids: the processor's chat template, each image expanded to its tokens."""
    proc = processor_of(tokenizer)
    if proc is None:
        raise VisionError(f"a prompt with {len(images)} image(s), but the model is text-only (model.path has no "
                          "image processor); drop the rows' images (vision.image_field=null) or use a vision-language "
                          "model")
    try:
        text = proc.apply_chat_template(_parts(messages), add_generation_prompt=add_generation_prompt, tokenize=False,
                                        **({"tools": tools} if tools else {}))
        out = proc(text=[text], images=[[open_image(r) for r in images]] if images else None)
    except Exception as e:  # (a template that cannot place an image part, a processor's own refusal)
        raise VisionError(f"the processor cannot encode this prompt with its {len(images)} image(s): "
                          f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}") from None
    return list(out["input_ids"][0])


def render(tokenizer, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> list[int]:
    """``encode`` for an episode's messages, each carrying its own images' references (``images.refs_of``). A
    message with none has no image: an ``IMAGE`` in its text (a turn where the policy sampled an image token, a tool's
    output) is text, never a place for the next image."""
    messages = [m if m.get("images") or not isinstance(m.get("content"), str) else
                {**m, "content": m["content"].replace(IMAGE, _NOT_IMAGE)} for m in messages]
    return encode(tokenizer, messages, refs_of(messages), add_generation_prompt, tools)


_NOT_IMAGE = IMAGE[:-1] + " >"  # (IMAGE, spelled so that no processor counts it)


def span(processor, ref: str) -> list[int]:
    """The token ids the processor expands one image to (its image tokens and the markers around them): where the
    image is in a context is where these ids are, so a lone image token the policy sampled is never taken for one."""
    kept = processor.__dict__.setdefault("_relayrl_spans", {})
    if key(ref) not in kept:
        if len(kept) >= 256:
            kept.clear()
        ids = processor(text=[processor.image_token], images=[[open_image(ref)]], add_special_tokens=False)
        ids = [int(t) for t in ids["input_ids"][0]]
        # (from its first special token to its last: text around them, Gemma 3's "\n\n", may merge with a
        # neighbour's characters in the prompt's tokens)
        special = set(processor.tokenizer.added_tokens_decoder)
        ends = [i for i, t in enumerate(ids) if t in special]
        kept[key(ref)] = ids[ends[0]:ends[-1] + 1] if ends else ids
    return kept[key(ref)]


def find(ids: list[int], s: list[int], start: int) -> int | None:
    """Where ``s`` first occurs in ``ids`` from ``start``, or None."""
    j = start
    while True:
        try:
            j = ids.index(s[0], j)
        except ValueError:
            return None
        if ids[j:j + len(s)] == s:
            return j
        j += 1


def image_token_id(model) -> int:
    cfg = model.config
    return getattr(cfg, "image_token_id", None) or getattr(cfg, "image_token_index")


def _inner(model):
    """The transformers model under PEFT's wrapper (FSDP2 keeps the class)."""
    return model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model


def features(model, ref: str) -> torch.Tensor:
    """[image tokens, hidden]: the vision tower's (and its connector's) output for one image, its pixels from the
    model's own image processor (one image: a tiling processor's tiles are that image's); with a graph only where
    the tower trains (``vision.train_tower``) and grad is on."""
    pix = processor_of(model).image_processor([[open_image(ref)]], return_tensors="pt")
    inner = _inner(model).model
    tower = [p for m in _tower(model) for p in m.parameters()]
    mask = {"pixel_attention_mask": pix["pixel_attention_mask"]} if "pixel_attention_mask" in pix else {}
    with torch.set_grad_enabled(torch.is_grad_enabled() and any(p.requires_grad for p in tower)):
        out = inner.get_image_features(pixel_values=pix["pixel_values"].to(tower[0].dtype), **mask)
    out = getattr(out, "pooler_output", out)  # (transformers 5: the connector's output as the pooled one)
    if isinstance(out, (list, tuple)):  # (transformers 5.25: one tensor per sample)
        out = torch.cat([f.reshape(-1, f.shape[-1]) for f in out])
    return out.reshape(-1, out.shape[-1])


class FeatureCache:
    """Image features by reference, the most recent ``size`` kept: a group's responses, and a prompt resumed
    across steps, share one encoding. Cleared when the vision tower's weights change."""

    def __init__(self, size: int = 64):
        self.size, self._kept = size, collections.OrderedDict()
        self.encoded = 0  # images encoded (the benchmark's count of what sharing saved)

    def get(self, model, refs: Sequence[str]) -> list[torch.Tensor]:
        for r in dict.fromkeys(refs):
            if key(r) not in self._kept:
                self._kept[key(r)] = features(model, r)
                self.encoded += 1
        for r in refs:
            self._kept.move_to_end(key(r))
        out = [self._kept[key(r)] for r in refs]  # (before trimming: one call may hold more images than are kept)
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)
        return out

    def clear(self) -> None:
        self._kept.clear()


def embed(model, ids: torch.Tensor, images: Sequence[Sequence[str]], cache: FeatureCache | None = None
          ) -> torch.Tensor:
    """[rows, L, hidden] input embeddings of ``ids`` with each row's images' features in place of their image tokens
    (``images[i]``: the references of row i's images, in the order of their spans, ``span``; a row may have none).
    An image token the policy sampled is a token. Without a ``cache`` (the trainer's forward) each image is encoded
    once for the call."""
    return _embed(model, ids, images, cache)[0]


def _embed(model, ids: torch.Tensor, images: Sequence[Sequence[str]], cache: FeatureCache | None
           ) -> tuple[torch.Tensor, list]:
    """``embed``'s embeddings, and each row's (row, positions of its images' tokens, their features)."""
    cache = cache if cache is not None else FeatureCache(size=1 << 30)
    emb = model.get_input_embeddings()(ids)
    token, proc = image_token_id(model), processor_of(model)
    rows = []
    for i, refs in enumerate(images):
        if not refs:
            continue
        feats, row, at, where = cache.get(model, refs), ids[i].tolist(), 0, []
        for n, (ref, f) in enumerate(zip(refs, feats), 1):
            s = span(proc, ref)
            j = find(row, s, at)
            slots = [] if j is None else [j + k for k, x in enumerate(s) if x == token]
            if j is None or len(slots) != len(f):
                raise VisionError(f"row {i}: image {n}'s tokens ({len(s)}, the processor's expansion) are not in its "
                                  "ids in order (a context cut through an image?)")
            where, at = where + slots, j + len(s)
        rows.append((i, torch.tensor(where, device=ids.device), torch.cat(feats).to(emb.dtype)))
    if not rows:
        return emb, rows
    emb = emb.clone()
    for i, where, flat in rows:
        emb[i, where] = flat
    return emb, rows


def inputs(model, ids: torch.Tensor, images: Sequence[Sequence[str]] | None, cache: FeatureCache | None = None
           ) -> dict:
    """The language model's input for ``ids``: the ids themselves, or where a row has images the embeddings
    with their features in place (``embed``), and for a family whose image tokens see each other both ways
    (``BLOCKS``) the placed images' tokens marked 1 in ``token_type_ids``."""
    if not images or not any(images):
        return {"input_ids": ids}
    emb, rows = _embed(model, ids, images, cache)
    if getattr(_inner(model).config, "model_type", None) not in BLOCKS:
        return {"inputs_embeds": emb}
    types = torch.zeros_like(ids)
    for i, where, _ in rows:
        types[i, where] = 1
    return {"inputs_embeds": emb, "token_type_ids": types}
