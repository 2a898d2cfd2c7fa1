"""A judge for the demo task, made here from nothing downloaded: the demo policy's own answers, labelled by the
verifier, teach a copy of the demo model to judge (relayrl sft); it then replaces the verifier in RL.

    python examples/judge_demo/make_judge.py runs/judge-demo     # ~10 min on 2 CPU cores
    relayrl train reward.judge.path=runs/judge-demo/judge reward.judge.template=examples/judge_demo/template.txt \\
        reward.fn=math reward.fn_weight=0 run.name=judged

The judge sees what examples/judge_demo/template.txt shows (the response, then the reference answer: nothing
between them and the reply, for a model of 1.8M parameters; a longer question after them left it at chance) and
replies "Score: 1" or "Score: 0". In the run, reward.fn_weight=0 leaves the verifier out of the reward (the judge's alone
trains) while the held-out accuracy stays the verifier's, so the two can be told apart.

1. ``relayrl eval`` samples the demo policy 4 times on 1,024 training prompts (and 256 held-out ones); the
   ``math`` verifier labels every answer.
2. Each answer becomes a judgment: the template filled with it, and the verifier's verdict as the reply; as many
   wrong answers as right ones are kept.
3. ``relayrl sft`` fine-tunes the demo model on the judgments: the judge.
4. The judge's agreement with the verifier on the held-out answers is measured and written to judge.json.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
TEMPLATE = (HERE / "template.txt").read_text()


def relayrl(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "relayrl.cli", *args], check=True)


def samples(out: Path, data: str, n: int, seed: int) -> list[dict]:
    relayrl("eval", "model.path=builtin:demo", f"data.eval_path={data}", f"eval.size={n}", "--samples", "4",
            f"eval.seed={seed}", "-o", str(out))
    return [json.loads(x) for x in (out / "eval_samples.jsonl").read_text().splitlines()
            if json.loads(x)["kind"] == "sampled" and not json.loads(x)["failure"]]


def judgment(r: dict) -> dict:
    prompt = TEMPLATE.format(prompt=r["prompt"][-1]["content"], answer=r["answer"], response=r["completion"],
                             metadata="{}")
    return {"prompt": prompt.rstrip("\n"), "response": f"Score: {int(r['reward'] >= 1)}", "label": int(r["reward"] >= 1)}


def balanced(rows: list[dict], seed: int) -> list[dict]:
    right = [r for r in rows if r["label"]]
    wrong = [r for r in rows if not r["label"]]
    random.Random(seed).shuffle(wrong)
    out = right + wrong[: len(right)]
    random.Random(seed + 1).shuffle(out)
    return [{"id": f"j{i}", **r} for i, r in enumerate(out)]


def agreement(judge: Path, rows: list[dict]) -> dict:
    from relayrl.rewards.judge import JudgeFailure, LocalJudge, parse_score

    j = LocalJudge(str(judge), "cpu", 8)
    try:
        replies = j.complete([r["prompt"] for r in rows], 600)
    finally:
        j.close()
    got = []
    for reply in replies:
        try:
            got.append(parse_score(reply))
        except JudgeFailure:
            got.append(None)
    agree = sum(g is not None and int(g >= 0.5) == r["label"] for g, r in zip(got, rows))
    return {"answers": len(rows), "agreement": agree / len(rows), "unreadable": sum(g is None for g in got),
            "right_answers": sum(r["label"] for r in rows)}


def main(out: Path, steps: int = 300) -> None:
    out.mkdir(parents=True, exist_ok=True)
    train = balanced([judgment(r) for r in samples(out / "train_samples", "builtin:demo", 1024, 1)], 0)
    held = [judgment(r) for r in samples(out / "held_out_samples", "builtin:demo-eval", 256, 2)]
    (out / "judgments.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    print(f"{len(train)} judgments ({sum(r['label'] for r in train)} of right answers)", flush=True)
    relayrl("sft", f"data.path={out / 'judgments.jsonl'}", "data.eval_path=null", f"run.output_dir={out}",
            "run.name=judge", f"run.steps={steps}", "run.progress=false", "trainer.lr=1e-3")
    judge = out / "judge" / "checkpoints" / f"step_{steps:06d}"
    result = {"judge": str(judge), **agreement(judge, held)}
    (out / "judge.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python examples/judge_demo/make_judge.py OUT [SFT_STEPS]")
    main(Path(sys.argv[1]), *(int(x) for x in sys.argv[2:]))
