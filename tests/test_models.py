"""Loading models and tokenizers: clear errors for a bad path, raw prompts for base models, the
prompt-length check."""

import re
from pathlib import Path

import pytest
import torch

from relayrl.cli import main
from relayrl.data.datasets import DataError
from relayrl.models import ModelError, load_policy, load_tokenizer, resolve_model_path
from relayrl.data.lengths import check_prompt_lengths
from relayrl.models.prompts import encode_prompt, model_context
from relayrl.records import Prompt

DATA = str(Path(__file__).parent / "data_small.jsonl")


@pytest.fixture(scope="module")
def base_tokenizer_path(tiny_path, tmp_path_factory):
    """The tiny model's tokenizer saved without a chat template (as a base model's would be)."""
    tok = load_tokenizer(tiny_path)
    tok.chat_template = None
    out = tmp_path_factory.mktemp("base-tok")
    tok.save_pretrained(out)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return str(out)


@pytest.mark.parametrize("load, field", [(load_policy, "model.path"), (load_tokenizer, "model.path")])
def test_missing_model_path_names_field_and_path(tmp_path, load, field):
    """Before: a transformers traceback."""
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ModelError) as e:
        load(missing)
    assert str(e.value) == f"{field}={missing!r}: cannot load the {'model' if load is load_policy else 'tokenizer'}: " \
        "no such file or directory"


def test_a_run_folder_not_made_yet_is_not_looked_up_on_the_hub(tmp_path, monkeypatch):
    """``runs/proposer-sft`` before the guide's ``relayrl sft`` made it: with a ``runs`` folder here it is a local
    path and fails at once (before: the hub asked five times a file, 46 s offline, then "couldn't connect to
    huggingface.co"); a deeper path too; an ``org/name`` with no such folder here still goes to the hub, and its
    error says it is no folder here either."""
    monkeypatch.chdir(tmp_path)
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # (the hub's answer at once, on any machine: read at its import)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    (tmp_path / "runs").mkdir()
    for path in ("runs/proposer-sft", "a/b/c"):
        with pytest.raises(ModelError, match=f"^model.path='{path}': cannot load the tokenizer: no such file or directory$"):
            load_tokenizer(path)
    with pytest.raises(ModelError, match=rf"^model.path='nobody/none': cannot load the model: .*\(nor is it a folder "
                                         rf"here, in {re.escape(str(tmp_path))}\)$"):
        load_policy("nobody/none")


@pytest.mark.parametrize("files, needle", [
    ({}, "the folder has no config.json"),
    ({"config.json": "{"}, "cannot load the model: "),
    ({"config.json": '{"model_type": "llama"}'}, "cannot load the model: "),
])
def test_broken_model_folder_is_one_line(tmp_path, files, needle):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ModelError) as e:
        load_policy(str(tmp_path), field="model.path")
    assert str(e.value).startswith(f"model.path={str(tmp_path)!r}") and needle in str(e.value)
    assert "\n" not in str(e.value)


def test_tokenizer_field_is_named(tmp_path):
    with pytest.raises(ModelError, match=r"^model.tokenizer='/.*': cannot load the tokenizer: the folder has no"):
        load_tokenizer(str(tmp_path), field="model.tokenizer")
    with pytest.raises(ModelError, match="model.path='builtin:nope': unknown built-in model"):
        resolve_model_path("builtin:nope")


def test_cli_wrong_model_path_is_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "runs"
    assert main(["train", f"model.path={tmp_path}/missing", f"data.path={DATA}", "data.eval_path=null",
                 f"run.output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("relayrl: model error: model.path=") and err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


def test_tokenizer_without_template_needs_raw_prompts(base_tokenizer_path):
    """Before: a tokenizer without a chat template was a hard error, whatever the model."""
    with pytest.raises(ModelError, match="no chat template; for a base model set data.prompt_format=raw"):
        load_tokenizer(base_tokenizer_path, "chat")
    tok = load_tokenizer(base_tokenizer_path, "raw")
    with pytest.raises(ModelError, match="data.prompt_format=raw"):
        encode_prompt(tok, [{"role": "user", "content": "1+1"}])
    ids = encode_prompt(tok, [{"role": "user", "content": "Sum mod 10: a=3 b=4"}], "raw")
    assert ids == tok("Sum mod 10: a=3 b=4")["input_ids"] and tok.decode(ids) == "Sum mod 10: a=3 b=4"


def test_raw_encoding_refuses_chat_messages(tiny):
    _, tok = tiny
    with pytest.raises(ValueError, match="single plain-string prompt"):
        encode_prompt(tok, [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], "raw")


def test_model_context_reads_the_config(tiny_path):
    assert model_context(tiny_path) == 512


def _prompt(i: int, text: str) -> Prompt:
    return Prompt(id=f"p{i}", messages=[{"role": "user", "content": text}])


@pytest.mark.parametrize("fmt", ["chat", "raw"])
def test_prompt_length_check_is_exact_at_the_limit(tiny, fmt):
    _, tok = tiny
    long = _prompt(1, "a=3 b=4 " * 40)
    n = len(encode_prompt(tok, long.messages, fmt))
    check_prompt_lengths([_prompt(0, "short"), long], tok, n, fmt)
    with pytest.raises(DataError) as e:
        check_prompt_lengths([_prompt(0, "short"), long], tok, n - 1, fmt, source="d.jsonl")
    assert str(e.value).startswith(f"d.jsonl: prompt id 'p1': field 'prompt' is {n} tokens, more than the {n - 1}")


def test_prompt_length_check_tokenizes_only_prompts_that_may_not_fit(tiny):
    _, tok = tiny
    seen = []

    class Counting:  # the tokenizer, counting what it is asked to encode
        chat_template = tok.chat_template

        def apply_chat_template(self, messages, **kw):
            seen.append(messages[-1]["content"])
            return tok.apply_chat_template(messages, **kw)

    huge = "a=3 b=4 " * 625_000  # 5 MB: tokenizing it whole takes seconds
    prompts = [_prompt(i, f"a={i % 10} b=4") for i in range(200)] + [_prompt(200, huge)]
    with pytest.raises(DataError, match=r"prompt id 'p200': field 'prompt' is at least \d+ tokens, more than the 384"):
        check_prompt_lengths(prompts, Counting(), 512 - 128)
    # the template's overhead once, then only a prefix of the huge prompt
    assert seen[0] == "" and len(seen) == 2 and huge.startswith(seen[1]) and len(seen[1]) < 4000


def test_no_room_for_a_prompt():
    with pytest.raises(ValueError, match="no room for a prompt"):
        check_prompt_lengths([_prompt(0, "x")], None, 0)


def test_the_cache_keyword_is_read_from_the_model_under_a_lora_adapter(tiny):
    """PEFT's wrapper takes **kwargs: its signature names no cache, and ``past_key_values`` was passed, which
    transformers removes in 5.40. Here the installed transformers, and the newest's API: its forward as in
    transformers 5.24's modeling_llama.py (``cache``; ``past_key_values`` deprecated), under PEFT."""
    import inspect

    from transformers import DynamicCache

    from relayrl.config import LoraCfg
    from relayrl.models import cache_kwarg
    from relayrl.train import lora

    model, _ = tiny
    plain = cache_kwarg(model)
    assert plain == ("cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values")
    seen = {}

    class Newest(type(model)):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                    labels=None, use_cache=None, logits_to_keep=0, **kwargs):
            seen["cache"], seen["kwargs"] = cache, set(kwargs)
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache,
                                   **{plain: cache})

    newest = Newest(model.config)
    wrapped, _ = lora.wrap(newest, LoraCfg(r=2))
    assert cache_kwarg(wrapped) == "cache"
    cache = DynamicCache(config=newest.config)
    wrapped(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True, **{cache_kwarg(wrapped): cache})
    assert seen["cache"] is cache and "past_key_values" not in seen["kwargs"]  # (it reached the model's own forward)
    assert cache_kwarg(lora.wrap(model, LoraCfg(r=2))[0]) == plain  # the installed transformers, the same
