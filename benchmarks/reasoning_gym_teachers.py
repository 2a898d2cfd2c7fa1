"""A task no one here wrote: three reasoning-gym tasks, a student warm-started by ``relayrl sft`` on the
question/answer pairs reasoning-gym generates, then RL (its verifier) or on-policy distillation from a larger
teacher fine-tuned the same way; held-out accuracy before SFT → after SFT → after RL / OPD, over seeds.

Tasks (made easy enough for models of a few million parameters, on a CPU): ``basic_arithmetic`` (two or three
one-digit terms), ``chain_sum`` (the same, its own phrasing), ``spell_backward`` (words of 3-5 letters).
Training rows: 3,000 per task (seed 1); held out: 100 per task (seed 2). An SFT target is the answer in
reasoning-gym's own format, ``<answer>X</answer>``, which its scorer reads (``reward.fn=reasoning_gym``).

- student: ``builtin:demo`` (1.8M parameters), ``relayrl sft`` for ``--student-sft-steps`` steps (per seed);
- teacher: the demo's tokenizer on a larger Llama (hidden 384, 6 layers, ~10M parameters, random init),
  ``relayrl sft`` for ``--teacher-sft-steps`` steps (once, seed 0);
- then from each seed's SFT checkpoint, ``--rl-steps`` steps of ``relayrl train`` with the verifier (GRPO), and
  the same with the teacher alone (``teacher.path``, ``algo.reward_coef=0``).

    python benchmarks/reasoning_gym_teachers.py              # 3 seeds (~1 h on 2 quiet cores)
    python benchmarks/reasoning_gym_teachers.py --seeds 1 --rl-steps 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_info, write_results  # noqa: E402

TASKS = {
    "basic_arithmetic": "min_terms=2&max_terms=3&min_digits=1&max_digits=1",
    "chain_sum": "min_terms=2&max_terms=3&min_digits=1&max_digits=1",
    "spell_backward": "min_word_len=3&max_word_len=5",
}
TEACHER_SHAPE = {"hidden_size": 384, "layers": 6, "heads": 6, "intermediate_size": 1024}
COMMON = ["reward.fn=reasoning_gym", "rollout.max_new_tokens=32", "eval.size=300", "run.progress=false"]


def relayrl(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "relayrl.cli", *args], check=True, stdout=subprocess.DEVNULL)


def write_data(work: Path) -> tuple[Path, Path]:
    from relayrl.envs.adapters import reasoning_gym as rga

    out = []
    for split, size, seed in (("train", 3000, 1), ("eval", 100, 2)):
        rows = []
        for task, config in TASKS.items():
            for r in rga.rows(f"reasoning_gym:{task}?size={size}&seed={seed}&{config}"):
                rows.append({**r, "response": f"<answer>{r['answer']}</answer>"})
        path = work / f"{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        out.append(path)
    return out[0], out[1]


def make_teacher_base(work: Path) -> Path:
    """The teacher's architecture, randomly initialised, with the demo's tokenizer."""
    from relayrl.demo import model as demo_model

    folder = work / "teacher-base"
    if not (folder / "config.json").exists():
        import torch

        torch.manual_seed(0)
        tok = demo_model.build_tokenizer(demo_model.RECIPE["seed"], demo_model.RECIPE["vocab_size"])
        demo_model.build_model(tok, {**demo_model.RECIPE, **TEACHER_SHAPE}).save_pretrained(folder)
        tok.save_pretrained(folder)
    return folder


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def sft_run(work: Path, name: str, model: str, train: Path, held: Path, steps: int, seed: int, lr: str) -> Path:
    run = work / name
    if not (run / "summary.json").exists():
        relayrl("sft", f"model.path={model}", f"data.path={train}", f"data.eval_path={held}", f"run.output_dir={work}",
                f"run.name={name}", f"run.steps={steps}", f"run.seed={seed}", f"trainer.lr={lr}",
                "trainer.warmup_steps=10", *COMMON)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--student-sft-steps", type=int, default=300)
    ap.add_argument("--teacher-sft-steps", type=int, default=800)
    ap.add_argument("--rl-steps", type=int, default=60)
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "relayrl-rg-teachers"))
    ap.add_argument("--name", default="reasoning_gym_teachers")
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    train, held = write_data(work)
    teacher_run = sft_run(work, "teacher", str(make_teacher_base(work)), train, held, a.teacher_sft_steps, 0, "1e-3")
    teacher = teacher_run / "checkpoints" / f"step_{a.teacher_sft_steps:06d}"
    t = summary(teacher_run)
    print(f"teacher: {t['eval_accuracy_before']:.1%} → {t['eval_accuracy_after']:.1%}", flush=True)
    results = []
    for seed in range(a.seeds):
        s = summary(sft_run(work, f"student-sft-{seed}", "builtin:demo", train, held, a.student_sft_steps, seed, "1e-3"))
        ckpt = work / f"student-sft-{seed}" / "checkpoints" / f"step_{a.student_sft_steps:06d}"
        row = {"seed": seed, "before_sft": s["eval_accuracy_before"], "after_sft": s["eval_accuracy_after"]}
        for kind, extra in (("rl", []), ("opd", [f"teacher.path={teacher}", "algo.reward_coef=0"])):
            name = f"student-{kind}-{seed}"
            if not (work / name / "summary.json").exists():
                relayrl("train", f"model.path={ckpt}", f"data.path={train}", f"data.eval_path={held}",
                        f"run.output_dir={work}", f"run.name={name}", f"run.steps={a.rl_steps}", f"run.seed={seed}",
                        *COMMON, *extra)
            r = summary(work / name)
            row[f"after_{kind}"] = r["eval_accuracy_after"]
            row[f"{kind}_seconds"] = r["wall_seconds"]
        print(json.dumps(row), flush=True)
        results.append(row)

    def cell(key: str) -> str:
        xs = [r[key] for r in results]
        return f"{statistics.mean(xs):.1%} ± {statistics.pstdev(xs):.1%} ({', '.join(f'{x:.1%}' for x in xs)})"

    rows = [["student (builtin:demo, 1.8M)", cell("before_sft"), cell("after_sft"), cell("after_rl"), cell("after_opd")],
            ["teacher (10M, SFT only)", f"{t['eval_accuracy_before']:.1%}", f"{t['eval_accuracy_after']:.1%}", "—", "—"]]
    header = ["model", "before SFT", "after SFT", f"after RL ({a.rl_steps} steps)", f"after OPD ({a.rl_steps} steps)"]
    write_results(Path(a.out), a.name, header, rows, {"machine": machine_info(), "args": vars(a), "tasks": TASKS,
                                                       "seeds": results, "teacher": t})


if __name__ == "__main__":
    main()
