"""The hf engine on image prompts: each image encoded once for its group (relayrl's ``vision.FeatureCache``) against
once per response, side by side, and the trainer's activation memory per image.

The model is a random Idefics3 with a SigLIP-base-shaped vision tower (768 hidden, 12 layers, 384-pixel images: 576
patches, 144 image tokens an image after the pixel shuffle) and a small Llama, built from its config (nothing is
downloaded). ``--prompts`` prompts of one image each, ``--group`` responses each, ``--new`` tokens a response
(greedy, so both ways decode the same tokens); each way runs ``--repeats`` times, alternated, best kept. Printed:
seconds, tokens/s, images encoded, the ratio; then what the trainer's forward keeps for its backward over rows
with 1 and with 4 images (the tower frozen, the default: an image's encoding keeps nothing).

    python benchmarks/vision_engine.py
    python benchmarks/vision_engine.py --prompts 2 --group 4 --new 4 --repeats 1   # a quick check
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_info, results_dir, write_results  # noqa: E402


class PerResponse:
    """A feature cache that keeps nothing: every row of a batch encodes its images (no sharing)."""

    def __init__(self):
        self.encoded = 0

    def get(self, model, refs):
        from relayrl.models import vision

        self.encoded += len(refs)
        return [vision.features(model, r) for r in refs]

    def clear(self):
        pass


def build(folder: Path) -> str:
    import torch

    from relayrl.demo import vision_model

    tok = vision_model.build_tokenizer()
    proc = vision_model.build_processor(tok, 384)
    torch.manual_seed(0)
    model = vision_model.build_model(proc.tokenizer, 384, {"hidden_size": 768, "intermediate_size": 3072,
                                                           "num_hidden_layers": 12, "num_attention_heads": 12},
                                     {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8,
                                      "num_key_value_heads": 4, "max_position_embeddings": 2048})
    model.save_pretrained(folder)
    proc.save_pretrained(folder)
    return str(folder)


def images(n: int) -> list[str]:
    import random

    from relayrl.demo.vlm_demo import render
    from relayrl.models.images import to_ref

    rng = random.Random(0)
    return [to_ref(render(rng.randrange(10), rng.randrange(10), rng, size=384), None, "bench") for _ in range(n)]


def engine_run(path: str, refs: list[str], group: int, new: int, shared: bool) -> tuple[float, int, int]:
    from relayrl.engine.hf import HFEngine
    from relayrl.models import load_policy, load_tokenizer
    from relayrl.models.prompts import encode_prompt
    from relayrl.records import GenRequest, SamplingParams

    tok, model = load_tokenizer(path), load_policy(path)
    eng = HFEngine(model, tok, driven=True)
    if not shared:
        eng._images = PerResponse()
    reqs = []
    for i, ref in enumerate(refs):
        ids = encode_prompt(tok, [{"role": "user", "content": "<image>Which digit is on the left?"}], "chat", (ref,))
        reqs += [GenRequest(f"p{i}/{k}", ids, SamplingParams(new, temperature=0.0), images=(ref,)) for k in range(group)]
    t0 = time.perf_counter()
    out = eng.generate(reqs)
    seconds = time.perf_counter() - t0
    eng.close()
    return seconds, sum(len(c.token_ids) for c in out), eng._images.encoded


def trainer_saved(path: str, refs: list[str], per_row: int, rows: int) -> float:
    """MiB the forward over ``rows`` rows of ``per_row`` images each keeps for its backward (autograd's saved
    tensors, each storage counted once): the trainer's activation memory, the tower frozen (the default)."""
    import torch

    from relayrl.models import load_policy, load_tokenizer, vision
    from relayrl.models.prompts import encode_prompt

    tok, model = load_tokenizer(path), load_policy(path)
    vision.freeze_tower(model, False)
    row_refs = [tuple(refs[(r * per_row + k) % len(refs)] for k in range(per_row)) for r in range(rows)]
    ids = [encode_prompt(tok, [{"role": "user", "content": "<image>" * per_row + "Which?"}], "chat", rr) + [5] * 16
           for rr in row_refs]
    n = max(map(len, ids))
    x = torch.tensor([i + [tok.pad_token_id] * (n - len(i)) for i in ids])
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**vision.inputs(model, x, row_refs), use_cache=False).logits
    out.float().log_softmax(-1).mean().backward()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(b for k, b in seen.items() if k not in params) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        path = build(Path(tmp) / "vlm")
        refs = images(args.prompts)
        best = {}
        for _ in range(args.repeats):
            for shared in (True, False):
                s, toks, enc = engine_run(path, refs, args.group, args.new, shared)
                if shared not in best or s < best[shared][0]:
                    best[shared] = (s, toks, enc)
        mem = {k: trainer_saved(path, images(8), k, 4) for k in (1, 4)}
    rows = [[name, f"{s:.2f}", f"{toks / s:.1f}", str(enc)] for name, (s, toks, enc) in
            (("each image once a group", best[True]), ("each image once a response", best[False]))]
    ratio = best[False][0] / best[True][0]
    for r in rows:
        print(" | ".join(r))
    print(f"ratio (once a response / once a group): {ratio:.2f}x the time")
    print(f"trainer, 4 rows: kept for the backward {mem[1]:.1f} MiB with 1 image a row, {mem[4]:.1f} MiB with 4 "
          f"({(mem[4] - mem[1]) / 12:.2f} MiB an image)")
    write_results(results_dir(args.out), "vision_engine", ["encoding", "s", "tokens/s", "images encoded"], rows,
                  {"machine": machine_info(), "args": vars(args), "ratio": ratio, "trainer_saved_mib": mem})


if __name__ == "__main__":
    main()
