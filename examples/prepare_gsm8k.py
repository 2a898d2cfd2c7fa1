"""Convert GSM8K (the hub's ``openai/gsm8k``, config ``main``) to the JSONL files that
``examples/qwen2.5-0.5b-gsm8k.yaml`` reads:

    python examples/prepare_gsm8k.py data/gsm8k     # -> data/gsm8k/train.jsonl (7,473), test.jsonl (1,319)

Needs the hub (or the dataset in the local datasets cache). Each row keeps GSM8K's question and
its answer verbatim, reasoning and all ("... #### 72"): the ``math`` verifier compares against
the text after the last '####' (``relayrl.rewards.reference_answer``). Rows get ids
``gsm8k-<split>-<index>`` (the index in the split, from 0), which relayrl logs per step.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Mapping
from pathlib import Path


def to_row(example: Mapping, split: str, index: int) -> dict:
    """One GSM8K example ({"question", "answer"}) as a row of the recipe's JSONL."""
    question, answer = example["question"], example["answer"]
    if "####" not in answer:  # (the "socratic" config has it too; anything else is not GSM8K)
        raise ValueError(f"{split} example {index}: the answer has no '#### <final answer>' line")
    return {"id": f"gsm8k-{split}-{index:05d}", "question": question.strip(), "answer": answer.strip()}


def convert(splits: Mapping[str, Iterable[Mapping]], out_dir: str | Path) -> dict[str, Path]:
    """Write ``<out_dir>/<split>.jsonl`` for each split; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, examples in splits.items():
        path = out / f"{split}.jsonl"
        with path.open("w", encoding="utf-8") as f:
            for i, ex in enumerate(examples):
                f.write(json.dumps(to_row(ex, split, i), ensure_ascii=False) + "\n")
        paths[split] = path
    return paths


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Convert GSM8K (openai/gsm8k, config main) to the JSONL files of "
                                            "examples/qwen2.5-0.5b-gsm8k.yaml.")
    p.add_argument("out_dir", nargs="?", default="data/gsm8k", help="where train.jsonl and test.jsonl go")
    args = p.parse_args(argv)
    from datasets import load_dataset

    ds = load_dataset("openai/gsm8k", "main")
    for split, path in convert({s: ds[s] for s in ("train", "test")}, args.out_dir).items():
        print(f"{split}: {ds[split].num_rows} rows -> {path}")


if __name__ == "__main__":
    main()
