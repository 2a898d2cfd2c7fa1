"""The Qwen2.5-0.5B GSM8K recipe (examples/qwen2.5-0.5b-gsm8k.yaml), end to end on a stand-in.

No hub access here, so the stand-in is a tiny *Qwen2* of the same shape (grouped-query attention,
tied embeddings, Qwen2.5-Instruct's generation config) with a tokenizer built the way Qwen2.5's
is: byte-level BPE behind Qwen2's pre-tokenizer regex and NFC, saved as a ``Qwen2Tokenizer``, with
ChatML special tokens and a Qwen2.5-style chat template. Why built that way: ``AutoTokenizer``
loads a folder whose tokenizer_config names ``Qwen2Tokenizer`` by *rebuilding* the tokenizer from
its vocab and merges with Qwen2's own pre-tokenizer and normalizer, whatever tokenizer.json says;
a BPE trained behind another pre-tokenizer (GPT-2's regex keeps " 48" one piece, Qwen2's splits
digits) then loads with other token ids. Trained behind Qwen2's, it loads unchanged (tested).
"""

import importlib.util
import json
import math
from pathlib import Path

import pytest

from relayrl.config import load_config

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "examples" / "qwen2.5-0.5b-gsm8k.yaml"
SAMPLE = ROOT / "examples" / "data" / "gsm8k_style_sample.jsonl"

# Qwen2.5's chat template without its tool-calling branches: a default system message when the
# conversation has none, ChatML turns, "<|im_start|>assistant\n" as the generation prompt
QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # Qwen2.5's order, after the BPE vocabulary


def _sample_rows() -> list[dict]:
    return [json.loads(line) for line in SAMPLE.read_text().splitlines() if line.strip()]


def _qwen_style_tokenizer():
    """(Qwen2Tokenizer, the trained ``tokenizers.Tokenizer`` it was built from)."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    bpe.decoder = decoders.ByteLevel()
    corpus = [r["question"] + "\n" + r["answer"] for r in _sample_rows()]
    corpus += ["Please reason step by step, and put your final answer within \\boxed{}.", "system\nuser\nassistant\n"]
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=512, special_tokens=[],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model = json.loads(bpe.to_str())["model"]
    vocab = dict(model["vocab"])
    for t in SPECIAL:
        vocab[t] = len(vocab)
    bpe.add_special_tokens(SPECIAL)  # (the same ids: they follow the vocabulary here too)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[tuple(m) for m in model["merges"]], eos_token="<|im_end|>",
                         pad_token="<|endoftext|>", unk_token=None, bos_token=None,
                         additional_special_tokens=["<|im_start|>", "<|im_end|>"], chat_template=QWEN25_TEMPLATE,
                         model_max_length=131072)
    return tok, bpe


def build_tiny_qwen(path: Path, hidden_size: int = 64):
    """A tiny Qwen2 with Qwen2.5-0.5B-Instruct's shape of config, saved into ``path``; returns the
    trained BPE its tokenizer was built from. (vLLM's CPU attention wants Qwen2.5-0.5B's head size,
    64: hidden_size=256 gives it.)"""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tok, bpe = _qwen_style_tokenizer()
    eot, im_end = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
                      rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                      use_sliding_window=False, bos_token_id=eot, eos_token_id=im_end)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    # Qwen2.5-*-Instruct's generation_config.json: two stop ids, and sampling settings that relayrl's
    # engines must not apply (the trainer recomputes the policy's own distribution at the run's T)
    model.generation_config = GenerationConfig(bos_token_id=eot, eos_token_id=[im_end, eot], pad_token_id=eot,
                                               do_sample=True, temperature=0.7, top_p=0.8, top_k=20,
                                               repetition_penalty=1.05)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return bpe


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory) -> tuple[str, object]:
    """(folder, trained BPE)."""
    path = tmp_path_factory.mktemp("tiny-qwen2.5")
    return str(path), build_tiny_qwen(path)


def test_tokenizer_loads_as_qwen2_and_round_trips(tiny_qwen):
    from relayrl.models import load_tokenizer
    from relayrl.models.prompts import encode_prompt

    path, bpe = tiny_qwen
    assert json.loads((Path(path) / "tokenizer_config.json").read_text())["tokenizer_class"] == "Qwen2Tokenizer"
    tok = load_tokenizer(path, "chat")  # as the pipeline loads it (AutoTokenizer)
    assert type(tok).__name__ == "Qwen2Tokenizer"
    text = "Natalia sold 48/2 = <<48/2=24>>24 clips.\n\n  #### 72 \\boxed{72} café 🙂"
    assert tok(text)["input_ids"] == bpe.encode(text).ids  # the trained ids, not a rebuilt tokenizer's
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.tokenize(" 1234") == ["Ġ", "1", "2", "3", "4"]  # Qwen2's regex: one digit a token
    ids = tok.convert_tokens_to_ids(SPECIAL)
    assert ids == list(range(len(tok) - 3, len(tok))) and (tok.pad_token_id, tok.eos_token_id) == (ids[0], ids[2])
    prompt = encode_prompt(tok, [{"role": "system", "content": "S"}, {"role": "user", "content": "What is 6*7?"}])
    assert tok.decode(prompt) == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nWhat is 6*7?<|im_end|>\n" \
                                 "<|im_start|>assistant\n"
    assert prompt[0] == ids[1] and prompt.count(ids[2]) == 2  # special tokens are single ids


def test_qwen2tokenizer_rebuilds_a_tokenizer_behind_its_own_pre_tokenizer(tmp_path):
    """Why the tokenizer above is trained behind Qwen2's pre-tokenizer: a byte-level BPE trained
    behind GPT-2's regex, saved with tokenizer_class Qwen2Tokenizer, loads through AutoTokenizer
    with Qwen2's regex in place of its own, and so with other ids (still decoding to the text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(["she sold 48 clips and 72 pens, 48 + 24 = 72"] * 20, trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>").save_pretrained(
        tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "Qwen2Tokenizer"}))
    tok = AutoTokenizer.from_pretrained(tmp_path)
    text = "she sold 48 clips"
    assert bpe.encode(text).tokens == ["she", "Ġsold", "Ġ48", "Ġclips"]
    assert tok.tokenize(text) == ["she", "Ġsold", "Ġ", "4", "8", "Ġclips"]  # Qwen2's regex: digits apart
    assert tok(text)["input_ids"] != bpe.encode(text).ids and tok.decode(tok(text)["input_ids"]) == text


def test_recipe_validates_with_only_the_engine_changed():
    """The YAML loads through the CLI's loader; with rollout.engine=hf (what the test below trains
    with, and what a machine without vLLM can run) nothing else changes and nothing else fails (a
    vllm_* setting in the recipe would: the config refuses settings that do not apply)."""
    hf = load_config(RECIPE, ["rollout.engine=hf"])
    vllm = load_config(RECIPE)  # (needs 'vllm' among rollout.engine's values: config.py has it)
    assert vllm.rollout.engine == "vllm" and hf.rollout.engine == "hf"
    a, b = hf.model_dump(), vllm.model_dump()
    a["rollout"].pop("engine"), b["rollout"].pop("engine")
    assert a == b
    assert vllm.model.path == "Qwen/Qwen2.5-0.5B-Instruct" and vllm.reward.fn == "math"
    assert vllm.model.system_prompt == "Please reason step by step, and put your final answer within \\boxed{}."
    assert (vllm.data.prompt_field, vllm.data.answer_field) == ("question", "answer")
    assert vllm.algo.advantage == "grpo" and vllm.trainer.lr == 1e-6


def test_math_verifier_takes_the_final_answer_after_hashes():
    """Hand-computed: the gold is what follows the last '####'. Before, math-verify parsed the
    whole solution and took the first anchored number ('Answer: ... 4'), so a right \\boxed{10}
    scored 0 here and a wrong \\boxed{4} scored 1."""
    from relayrl.rewards.verifiers import math_reward, reference_answer

    gold = "Answer: first we find x = 4.\nThen 4+6=<<4+6=10>>10\n#### 10"
    assert reference_answer(gold) == "10"
    assert reference_answer("72") == "72" and reference_answer("a #### b #### -7 ") == "-7"
    assert reference_answer("nothing after ####") == "nothing after ####"  # (no final answer: kept whole)
    assert math_reward("4+6 = 10, so \\boxed{10}", gold, {}) == 1.0
    assert math_reward("\\boxed{4}", gold, {}) == 0.0
    assert math_reward("\\boxed{\\frac{1}{2}}", "Half of 1 is 1/2=<<1/2=0.5>>0.5\n#### 0.5", {}) == 1.0
    assert math_reward("\\boxed{1,600}", "#### 1600", {}) == 1.0
    for row in _sample_rows():  # every sample row: its own final answer right, an intermediate one wrong
        final = row["answer"].rsplit("####", 1)[1].strip()
        assert math_reward(f"So the answer is \\boxed{{{final}}}.", row["answer"], {}) == 1.0, row["id"]
        assert math_reward(f"\\boxed{{{int(final) + 1}}}", row["answer"], {}) == 0.0, row["id"]


def test_prepare_gsm8k_converts_rows_the_recipe_reads(tmp_path, monkeypatch):
    import datasets

    from relayrl.data.datasets import load_prompts

    spec = importlib.util.spec_from_file_location("prepare_gsm8k", ROOT / "examples" / "prepare_gsm8k.py")
    prep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prep)
    made_up = {"question": "Ann has 3 bags of 4 apples. How many apples does she have? ",
               "answer": "She has 3*4=<<3*4=12>>12 apples.\n#### 12"}
    assert prep.to_row(made_up, "train", 7) == {"id": "gsm8k-train-00007", "question": made_up["question"].strip(),
                                                "answer": made_up["answer"]}
    with pytest.raises(ValueError, match="no '#### <final answer>'"):
        prep.to_row({"question": "q", "answer": "12"}, "test", 0)
    paths = prep.convert({"train": [made_up, made_up], "test": [made_up]}, tmp_path / "gsm8k")
    cfg = load_config(RECIPE, [f"data.path={paths['train']}"])
    d = cfg.data
    (p, q) = load_prompts(str(paths["train"]), d.prompt_field, d.answer_field, d.id_field,
                          system_prompt=cfg.model.system_prompt)
    assert (p.id, q.id) == ("gsm8k-train-00000", "gsm8k-train-00001") and p.answer == made_up["answer"]
    assert p.messages == [{"role": "system", "content": cfg.model.system_prompt},
                          {"role": "user", "content": made_up["question"].strip()}]
    assert len(paths["test"].read_text().splitlines()) == 1
    # the script's main(), with the hub's dataset replaced by one of the same shape
    fake = datasets.DatasetDict({"train": datasets.Dataset.from_list([made_up] * 3),
                                 "test": datasets.Dataset.from_list([made_up])})
    asked = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: asked.append(a) or fake)
    prep.main([str(tmp_path / "main")])
    assert asked == [("openai/gsm8k", "main")]
    assert [len((tmp_path / "main" / f"{s}.jsonl").read_text().splitlines()) for s in ("train", "test")] == [3, 1]


def _finite(value) -> bool:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return True
    if isinstance(value, (int, float)):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return True


@pytest.mark.slow
def test_recipe_trains_the_tiny_qwen_through_the_cli_entry_point(tiny_qwen, tmp_path):
    """The recipe as a user loads it, with the model, the engine, the data and the size overridden,
    run through the function ``relayrl train`` calls."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relayrl.run.loop import train

    path, bpe = tiny_qwen
    cfg = load_config(RECIPE, [
        f"model.path={path}", "rollout.engine=hf", f"data.path={SAMPLE}", f"data.eval_path={SAMPLE}",
        f"run.output_dir={tmp_path / 'runs'}", "run.steps=2", "run.progress=false",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=16",
        "eval.size=2", "eval.every=0", "reward.workers=1",
    ])
    assert cfg.model.dtype == "float32" and cfg.algo.advantage == "grpo"
    summary = train(cfg)
    assert summary["steps"] == 2 and summary["samples"] == 2 * 2 * 2
    assert summary["reward_failures"] == 0 and summary["reward_timeouts"] == 0
    assert summary["eval_accuracy_before"] is not None and summary["eval_accuracy_after"] is not None
    rows = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        bad = {k: v for k, v in r.items() if not _finite(v)}
        assert not bad, f"non-finite metrics at step {r['step']}: {bad}"
        for key in ("reward_mean", "response_len_mean", "grad_norm", "entropy", "logprob_mismatch_mean"):
            assert key in r, key
    # the engine sampled at the run's temperature, not Qwen's generation config (T=0.7, top-k 20,
    # repetition penalty): the trainer's log-probs of the sampled tokens agree with the engine's
    assert max(r["logprob_mismatch_mean"] for r in rows) < 1e-3
    ckpt = cfg.run_dir / "checkpoints" / "step_000002"
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tok = AutoTokenizer.from_pretrained(ckpt)
    text = "She has 3*4=<<3*4=12>>12 apples.\n#### 12"
    assert type(tok).__name__ == "Qwen2Tokenizer" and tok(text)["input_ids"] == bpe.encode(text).ids
    assert tok.chat_template == QWEN25_TEMPLATE
