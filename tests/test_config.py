import re
import pytest

from relayrl.cli import main
from relayrl.config import ConfigError, describe, load_config


def test_defaults_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("trainer:\n  lr: 1.0e-5\nrollout:\n  group_size: 4\n")
    cfg = load_config(f, ["rollout.group_size=6", "algo.dual_clip=null", "run.name=x"])
    assert cfg.trainer.lr == 1e-5 and cfg.rollout.group_size == 6 and cfg.algo.dual_clip is None
    assert cfg.run_dir.name == "x"


@pytest.mark.parametrize(
    "override, needle",
    [
        ("trainer.lrr=1", "trainer.lrr"),
        ("trainr.lr=1", "unknown section 'trainr'"),
        ("trainer.lr=abc", "trainer.lr"),
        ("rollout.engine=foo", "rollout.engine"),
        ("algo.advantage=grpoo", "gigpo, grpo, rae, reinforce_pp, reinforce_pp_baseline, rloo"),
        ("trainer=1", "section.key"),
    ],
)
def test_bad_keys_and_values_name_the_key(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert needle in str(e.value)


def test_typo_suggests_and_lists_valid_keys():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["trainer.lrr=1"])
    assert "Did you mean 'trainer.lr'" in str(e.value) and "warmup_steps" in str(e.value)


def test_a_section_typo_suggests_the_section(tmp_path):
    (tmp_path / "c.yaml").write_text("rolout:\n  group_size: 2\n")
    for path, overrides in ((None, ["rolout.group_size=2"]), (tmp_path / "c.yaml", [])):
        with pytest.raises(ConfigError, match="unknown section 'rolout'. Did you mean 'rollout'\\? Valid sections: "):
            load_config(path, overrides)


def test_yaml_unknown_key_names_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("rollout:\n  grup_size: 4\n")
    with pytest.raises(ConfigError, match="bad.yaml: unknown key 'rollout.grup_size'"):
        load_config(f)


def test_cli_typo_fails_at_once(capsys):
    assert main(["train", "trainer.lrr=1"]) == 2
    assert "trainer.lrr" in capsys.readouterr().err


def test_help_documents_every_field():
    text = describe()
    from relayrl.config import Config
    from relayrl.config.load import nested_fields

    for sec, info in Config.model_fields.items():
        for name, _ in nested_fields(info.annotation):
            assert f"{sec}.{name} " in text
    assert "model.lora.r " in text  # (a section's own section, by its fields)


@pytest.mark.parametrize("overrides, needle", [
    (["algo.norm_len=0", "algo.agg=seq_mean_token_sum_norm"], "algo.norm_len: Input should be greater than or equal"),
    (["algo.clip_low=1"], "algo.clip_low: Input should be less than 1"),
    (["algo.clip_low=5"], "algo.clip_low"),
    (["algo.clip_high=100"], "algo.clip_high"),
    (["algo.offpolicy=tis", "algo.tis_cap=0.5"], "algo.tis_cap"),
    (["rollout.temperature=1e-9"], "rollout.temperature"),
    (["rollout.temperature=1000"], "rollout.temperature"),
    (["rollout.partial=true", "rollout.over_provision=1e6"], "rollout.over_provision"),
    (["eval.samples=100000"], "eval.samples"),
    (["trainer.betas=[0.9, 1.5]"], "trainer.betas"),
    (["trainer.lr=.inf"], "trainer.lr: Input should be a finite number"),
    (["algo.kl_coef=.nan"], "algo.kl_coef"),
    (["trainer.lr=true"], "trainer.lr must be a number, got True"),
    (["run.name=a/b"], "run.name: must be a plain folder name"),
    (["run.name=.."], "run.name: must be a plain folder name"),
    (["run.name=."], "run.name: must be a plain folder name"),
    (["run.name="], "run.name: must be a plain folder name"),
    (["eval.every=100", "run.steps=10"], "eval.every=100 is more than run.steps=10"),
])
def test_out_of_range_values_name_the_field(overrides, needle):
    """Before: norm_len=0 gave a NaN loss, clip_low ≥ 1 a negative ratio floor, inf passed every bound."""
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_updates_per_step_beyond_the_batch_names_both_fields():
    """Before: accepted, then crashed in the trainer on an empty mini-batch."""
    with pytest.raises(ConfigError) as e:
        load_config(None, ["trainer.updates_per_step=9", "rollout.prompts_per_step=2", "rollout.group_size=4"])
    fields = ("trainer.updates_per_step=9", "rollout.prompts_per_step", "rollout.group_size")
    assert all(f in str(e.value) for f in fields)
    assert load_config(None, ["trainer.updates_per_step=8", "rollout.prompts_per_step=2",
                              "rollout.group_size=4"]).trainer.updates_per_step == 8


@pytest.mark.parametrize("overrides, field, when", [
    (["rollout.max_staleness=3"], "rollout.max_staleness", "run.mode=async"),
    (["rollout.over_provision=2"], "rollout.over_provision", "rollout.partial=true"),
    (["run.mode=async", "rollout.partial=true", "rollout.over_provision=2"], "rollout.over_provision",
     "sync or periodic"),
    (["rollout.cb_num_blocks=64"], "rollout.cb_num_blocks", "rollout.engine=hf-cb"),
    (["rollout.cb_page_size=64"], "rollout.cb_page_size", "rollout.engine=hf-cb"),
    (["rollout.vllm_sleep=true"], "rollout.vllm_sleep", "rollout.engine=vllm"),
    (["algo.tis_cap=3"], "algo.tis_cap", "algo.offpolicy=tis"),
    (["algo.tis_level=sequence"], "algo.tis_level", "algo.offpolicy=tis"),
    (["algo.m2po_tau=0.1"], "algo.m2po_tau", "algo.offpolicy=m2po"),
    (["algo.norm_len=64"], "algo.norm_len", "algo.agg=seq_mean_token_sum_norm"),
    (["algo.kl_coef=0", "algo.kl_estimator=k1"], "algo.kl_estimator", "algo.kl_coef > 0"),
    (["rollout.engine_threads=1"], "rollout.engine_threads", "own process"),
    (["run.mode=async", "rollout.engine_process=false", "rollout.engine_threads=1"], "rollout.engine_threads",
     "own process"),
    (["data.prompt_format=raw", "model.system_prompt=be brief"], "model.system_prompt", "data.prompt_format=chat"),
    (["data.eval_path=null", "eval.size=4"], "eval.size", "data.eval_path is set"),
])
def test_fields_the_mode_ignores_are_rejected_when_set(overrides, field, when):
    """Before: set and silently ignored (e.g. max_staleness in sync mode)."""
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert f"{field} is set, but it only applies" in str(e.value) and when in str(e.value)


def test_a_files_field_the_command_line_leaves_without_effect_is_dropped(tmp_path):
    """``relayrl train examples/agent_demo.yaml data.eval_path=null``: the file's eval.size no longer applies and
    cannot be unset from the command line, so it is dropped (before: "eval.size is set ... remove it"); set on the
    command line itself, or where the command line decided nothing, it is still refused."""
    f = tmp_path / "c.yaml"
    f.write_text("run:\n  mode: async\n  steps: 5\ndata:\n  eval_path: builtin:demo-eval\neval:\n  size: 7\n"
                 "rollout:\n  max_staleness: 3\n")
    cfg = load_config(str(f), ["data.eval_path=null", "run.mode=sync"])
    assert cfg.data.eval_path is None and "size" not in cfg.eval.model_fields_set and cfg.run.steps == 5
    assert "max_staleness" not in cfg.rollout.model_fields_set
    assert load_config(str(f), ["data.eval_path=null"]).rollout.max_staleness == 3  # (still async: it applies)
    with pytest.raises(ConfigError, match="eval.size is set, but it only applies"):
        load_config(str(f), ["data.eval_path=null", "eval.size=7"])
    f.write_text("data:\n  eval_path: null\neval:\n  size: 7\n")
    with pytest.raises(ConfigError, match="eval.size is set, but it only applies"):
        load_config(str(f), ["run.steps=3"])


@pytest.mark.parametrize("overrides", [
    ["run.mode=async", "rollout.max_staleness=4"],
    ["rollout.partial=true", "rollout.over_provision=2"],
    ["rollout.engine=hf-cb", "rollout.cb_num_blocks=64"],
    ["algo.offpolicy=tis", "algo.tis_cap=3", "algo.tis_level=sequence"],
    ["algo.offpolicy=m2po", "algo.m2po_tau=0.1"],
    ["algo.agg=seq_mean_token_sum_norm", "algo.norm_len=64"],
    ["algo.kl_coef=0.1", "algo.kl_estimator=k1"],
    ["run.mode=periodic", "rollout.engine_threads=1"],
    ["rollout.engine_process=true", "rollout.engine_threads=1"],
])
def test_fields_are_accepted_where_they_apply(overrides):
    load_config(None, overrides)


def test_yaml_file_sets_count_as_explicit(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("rollout:\n  max_staleness: 2\n")
    with pytest.raises(ConfigError, match="rollout.max_staleness is set"):
        load_config(f)


def test_dumped_config_loads_back(tmp_path):
    """config.yaml holds every field that applies, so `relayrl train runs/x/config.yaml` works."""
    from relayrl.config import dump_config

    for overrides in ([], ["run.mode=async", "rollout.max_staleness=4"], ["algo.offpolicy=tis", "data.eval_path=null"]):
        cfg = load_config(None, overrides)
        dump_config(cfg, tmp_path / "config.yaml")
        assert load_config(tmp_path / "config.yaml") == cfg


@pytest.mark.parametrize("typed, kept", [("2024", "2024"), ("1e3", "1e3"), ("1.0e3", "1.0e3"), ("007", "007"),
                                         ("true", "true"), ("0x10", "0x10"), ("my-run", "my-run")])
def test_string_fields_keep_numbers_as_typed(tmp_path, typed, kept):
    """Before: `run.name=2024` was "not a valid string"."""
    assert load_config(None, [f"run.name={typed}"]).run.name == kept
    f = tmp_path / "c.yaml"
    f.write_text(f"run:\n  name: {typed}\nmodel:\n  system_prompt: {typed}\n")
    cfg = load_config(f)
    assert cfg.run.name == kept and cfg.model.system_prompt == kept


@pytest.mark.parametrize("text, needle", [
    ("", "the config file is empty"),
    ("- a\n- b\n", "top level must be a mapping of sections, got list"),
    ("run: [1, 2]\n", "'run' must be a mapping of fields"),
    ("run:\n  name: [unclosed\n", "not valid YAML"),
    (b"\xff\xfe\x00garbage", "not a UTF-8 text file"),
    ("run:\n  steps: 1\n  steps: {a: {b: c}}\n", "run.steps"),
    ("1: 2\n", "unknown section '1'"),
    ("run: {1: 2}\n", "unknown key 'run.1'"),
])
def test_bad_config_files_name_the_file(tmp_path, text, needle):
    f = tmp_path / "c.yaml"
    f.write_bytes(text) if isinstance(text, bytes) else f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert "c.yaml" in str(e.value) or "run.steps" in needle


def test_run_section_left_empty_is_fine(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("run:\n# name: x\ntrainer:\n  lr: 1.0e-5\n")
    assert load_config(f).trainer.lr == 1e-5


def _one_error_line(capsys) -> str:
    out = capsys.readouterr()
    lines = out.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("relayrl: ") and "Traceback" not in out.err + out.out
    return lines[0]


@pytest.mark.parametrize("argv, kind", [
    (["train", "--bogus"], "usage"),
    (["train", "notaconfig"], "usage"),
    (["train", "trainer.lr=abc", "rollout.group_size=x"], "config"),
    (["train", "data.path=/no/such.jsonl", "data.eval_path=null"], "data"),
    (["eval", "data.eval_path=null"], "input"),
])
def test_cli_errors_are_one_line_with_status_2(capsys, tmp_path, argv, kind):
    assert main([*argv, f"run.output_dir={tmp_path}"]) == 2  # (never the working folder's runs/)
    assert _one_error_line(capsys).startswith(f"relayrl: {kind} error: ")


def test_eval_without_held_out_prompts_says_to_add_them_even_with_samples(capsys, tmp_path):
    """The change that makes the command work (data.eval_path=FILE), not "remove eval.samples"."""
    for argv in (["eval", "data.eval_path=null"], ["eval", "--samples", "8", "data.eval_path=null"]):
        assert main([*argv, f"run.output_dir={tmp_path}"]) == 2
        line = _one_error_line(capsys)
        assert "nothing to evaluate; add data.eval_path=FILE to the command" in line and "remove" not in line


def test_cli_folds_multiline_messages(capsys):
    assert main(["train", "trainer.lr=abc", "rollout.group_size=x"]) == 2
    line = _one_error_line(capsys)
    assert "trainer.lr" in line and "rollout.group_size" in line and "; " in line


@pytest.mark.parametrize("error, kind, status", [
    ("relayrl.engine.base:EngineError", "engine", 1),
    ("relayrl.run.resume:ResumeError", "resume", 2),
    ("relayrl.data.datasets:DataError", "data", 2),
    ("relayrl.models:ModelError", "model", 2),
])
def test_cli_maps_run_time_errors(monkeypatch, capsys, tmp_path, error, kind, status):
    import importlib

    import relayrl.run.loop

    module, name = error.split(":")
    exc = getattr(importlib.import_module(module), name)

    def fail(cfg, resume=False):
        raise exc("it went wrong\n  on two lines")

    monkeypatch.setattr(relayrl.run.loop, "train", fail)
    assert main(["train", f"run.output_dir={tmp_path}"]) == status
    assert _one_error_line(capsys) == f"relayrl: {kind} error: it went wrong; on two lines"


def test_cli_escapes_control_characters(capsys, tmp_path):
    assert main(["train", f"data.path={tmp_path}/a\rb\x1b[2J.jsonl", "data.eval_path=null", f"run.output_dir={tmp_path}"]) == 2
    line = _one_error_line(capsys)
    assert "\r" not in line and "\x1b" not in line and "\\r" in line


def test_cli_unexpected_errors_keep_their_traceback(monkeypatch):
    import relayrl.run.loop

    def bug(cfg, resume=False):
        raise KeyError("a bug")

    monkeypatch.setattr(relayrl.run.loop, "train", bug)
    with pytest.raises(KeyError):
        main(["train"])


@pytest.mark.parametrize("overrides, message", [
    (["env.max_turns=3"], "env.max_turns is set, but it only applies with an environment"),
    (["algo.advantage=gigpo"], "algo.advantage='gigpo' needs an environment"),
    (["env.name=calculator", "algo.gamma=0.9"], "algo.gamma is set, but it only applies with algo.advantage=gigpo"),
    (["env.name=calculator", "run.mode=async", "rollout.stale=discard"], "rollout.stale"),  # removed: never stale
    # an agent program's extra branches would count as episodes, and its episodes carry no anchor states
    (["env.name=agent:my_agent.py:run", "algo.advantage=gigpo"],
     "algo.advantage='gigpo' does not combine with env.name=agent:my_agent.py:run"),
])
def test_agent_settings_that_do_not_apply_are_rejected(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, overrides)


@pytest.mark.parametrize("overrides, message", [
    (["run.mode=async"], "needs run.mode=sync and run.backend=local (here run.mode=async"),
    (["run.mode=periodic"], "here run.mode=periodic"),
    (["run.backend=ray"], "here run.mode=sync, run.backend=ray"),
])
def test_vllm_sleep_only_where_nothing_generates_while_training(overrides, message):
    """An engine asleep while the trainer steps cannot generate ahead (nor sleep as a Ray actor:
    not wired)."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, ["rollout.engine=vllm", "rollout.vllm_sleep=true", *overrides])
    assert load_config(None, ["rollout.engine=vllm", "rollout.vllm_sleep=true"]).rollout.vllm_sleep


def test_agent_settings_load():
    cfg = load_config(None, ["env.name=calculator", "env.args={delay_s: 0.2}", "env.max_turns=3",
                             "algo.advantage=gigpo", "algo.gamma=0.9", "run.mode=async"])
    assert cfg.env.args == {"delay_s": 0.2} and cfg.env.max_turns == 3 and cfg.algo.gamma == 0.9


@pytest.mark.parametrize("overrides, budget, dynamic", [
    ([], "adaptive", True),  # the default run: a group baseline (grpo) over 8 responses
    (["algo.advantage=rloo", "rollout.group_size=2"], "adaptive", True),
    (["algo.advantage=reinforce_pp", "rollout.group_size=1"], "fixed", False),  # one response: no group variance
    (["algo.advantage=gae"], "fixed", False),  # a critic's baseline, not the group's
    (["algo.advantage=reinforce_pp"], "fixed", False),
    (["rollout.dynamic_sampling=false"], "adaptive", False),  # what the user sets stays
    (["algo.advantage=gae", "rollout.budget=adaptive"], "adaptive", False),
    # a teacher beside a verifier: a group whose rewards are equal still carries the teacher's per-token signal
    (["teacher.path=runs/demo"], "fixed", False),
    (["teacher.path=runs/demo", "algo.reward_coef=0", "reward.fn=none"], "fixed", False),
])
def test_adaptive_sampling_is_the_default_where_a_group_baseline_uses_it(overrides, budget, dynamic):
    cfg = load_config(None, overrides)
    assert (cfg.rollout.budget, cfg.rollout.dynamic_sampling) == (budget, dynamic)


# ---- model.lora: a section's own section (three levels)


def test_lora_learning_rate_follows_the_adapter_unless_set():
    from relayrl.config.sections import LORA_LR_FACTOR

    default = load_config(None, []).trainer.lr
    on = load_config(None, ["model.lora.r=8"])
    assert on.model.lora.r == 8 and on.trainer.lr == pytest.approx(default * LORA_LR_FACTOR)
    assert load_config(None, ["model.lora.r=8", "trainer.lr=3e-4"]).trainer.lr == 3e-4  # set: stays
    assert load_config(None, ["trainer.lr=3e-4"]).trainer.lr == 3e-4
    assert load_config(None, ["model.lora.r=0"]).trainer.lr == default  # off: full fine-tuning's


@pytest.mark.parametrize("overrides, needle", [
    (["model.lora.alpha=16"], "model.lora.alpha is set, but it only applies with an adapter (model.lora.r > 0)"),
    (["model.lora.targets=[q_proj]"], "model.lora.targets is set"),
    (["model.lora.rank=8"], "unknown key 'model.lora.rank'"),
    (["model.lora.r=-1"], "model.lora.r: Input should be greater than or equal to 0"),
    (["model.lora.r=8", "model.lora.dropout=1"], "model.lora.dropout"),
    (["model.lora.r=8", "model.lora.targets=[]"], "model.lora.targets: must be 'all-linear' or a non-empty list"),
    (["model.lora=8"], "'model.lora' must be a mapping"),
    (["model.lora.r.x=8"], "must be section.key"),
])
def test_lora_errors_name_the_field(overrides, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config(None, overrides)


def test_lora_from_yaml_round_trips(tmp_path):
    from relayrl.config import dump_config, recorded_tree

    f = tmp_path / "c.yaml"
    f.write_text("model:\n  lora:\n    r: 4\n    targets: q_proj, v_proj\n")
    cfg = load_config(str(f), ["model.lora.alpha=8"])  # the command line over the file, field by field
    assert (cfg.model.lora.r, cfg.model.lora.alpha, cfg.model.lora.targets) == (4, 8.0, ["q_proj", "v_proj"])
    dump_config(cfg, tmp_path / "out.yaml")
    assert load_config(str(tmp_path / "out.yaml"), []) == cfg
    assert load_config(None, [], base=recorded_tree(cfg.model_dump(mode="json"))) == cfg
    off = load_config(None, [])  # off: the adapter's other fields are left out of the resolved config
    dump_config(off, tmp_path / "off.yaml")
    assert load_config(str(tmp_path / "off.yaml"), []) == off


def test_a_config_recorded_before_a_subsections_newer_field_loads_back():
    """A checkpoint of an older version records model.lora without a field added since (per_role): its other
    fields, at their defaults, are not taken as set (they would be refused with model.lora.r=0), and a value it
    did set stays."""
    from relayrl.config import recorded_tree

    old = load_config(None, []).model_dump(mode="json")
    del old["model"]["lora"]["per_role"]
    assert "lora" not in recorded_tree(old).get("model", {})
    assert load_config(None, [], base=recorded_tree(old)) == load_config(None, [])
    old["model"]["lora"]["r"] = 8
    assert recorded_tree(old)["model"]["lora"] == {"r": 8}


def test_a_lora_rank_vllm_cannot_serve_is_refused_by_name():
    with pytest.raises(ConfigError, match="model.lora.r=513 with rollout.engine=vllm"):
        load_config(None, ["model.lora.r=513", "rollout.engine=vllm"])
    assert load_config(None, ["model.lora.r=300", "rollout.engine=vllm"]).model.lora.r == 300  # (vLLM rounds up)


@pytest.mark.parametrize("text, want", [("on", "on"), ("off", "off"), ("true", "on"), ("auto", "auto")])
def test_gradient_checkpointing_on_off_as_yaml_reads_them(text, want, tmp_path):
    """Unquoted, YAML 1.1 reads on/off as booleans: the field takes them as its words (it refused `=on` before)."""
    assert load_config(None, [f"trainer.gradient_checkpointing={text}"]).trainer.gradient_checkpointing == want
    f = tmp_path / "c.yaml"
    f.write_text(f"trainer:\n  gradient_checkpointing: {text}\n")
    assert load_config(str(f), []).trainer.gradient_checkpointing == want


@pytest.mark.parametrize("field, section", [("algo.routing_replay", "algo"), ("rollout.speculative", "rollout")])
def test_every_field_with_off_takes_it_unquoted(field, section, tmp_path):
    """`algo.routing_replay=off` was refused ("Input should be 'off' or 'r3' (got False)"): every field whose words
    include off takes YAML's false for it, and true only where on is one of its words."""
    assert getattr(getattr(load_config(None, [f"{field}=off"]), section), field.split(".")[1]) == "off"
    f = tmp_path / "c.yaml"
    f.write_text(f"{section}:\n  {field.split('.')[1]}: off\n")
    assert getattr(getattr(load_config(str(f), []), section), field.split(".")[1]) == "off"
    with pytest.raises(ConfigError, match="routing_replay"):
        load_config(None, ["algo.routing_replay=on"])  # (no `on` among its words: not silently r3)


def test_speculation_in_vllm_is_prompt_lookup_only():
    """vLLM's API takes an n-gram method over the prompt and the request's output: relayrl's prompt source. The
    other sources, the lead and the verification budget are the hf engine's, refused by name with vLLM."""
    ok = load_config(None, ["rollout.engine=vllm", "rollout.speculative=on", "rollout.speculative_sources=[prompt]"])
    assert ok.rollout.speculative == "on"
    with pytest.raises(ConfigError, match=r"drafts from the prompt only.*\['siblings', 'history'\]"):
        load_config(None, ["rollout.engine=vllm", "rollout.speculative=on"])
    with pytest.raises(ConfigError, match="rollout.speculative_batch_tokens is set, but it only applies with "
                                          "rollout.speculative=on and rollout.engine=hf"):
        load_config(None, ["rollout.engine=vllm", "rollout.speculative=on", "rollout.speculative_sources=[prompt]",
                           "rollout.speculative_batch_tokens=128"])


def test_trls_names_are_accepted_with_a_hint_where_the_meaning_is_the_same(tmp_path, capsys):
    cfg = load_config(None, ["learning_rate=1e-6", "num_generations=4", "beta=0", "max_completion_length=64"])
    assert (cfg.trainer.lr, cfg.rollout.group_size, cfg.algo.kl_coef, cfg.rollout.max_new_tokens) == (1e-6, 4, 0.0, 64)
    err = capsys.readouterr().err
    assert "relayrl: learning_rate is TRL's name for trainer.lr: taken as trainer.lr=1e-6 (command line;" in err
    (tmp_path / "trl.yaml").write_text("learning_rate: 2.0e-6\nrun:\n  steps: 3\nepsilon_high: 0.28\n")
    cfg = load_config(tmp_path / "trl.yaml", [])
    assert (cfg.trainer.lr, cfg.run.steps, cfg.algo.clip_high) == (2e-6, 3, 0.28)
    assert f"epsilon_high is TRL's name for algo.clip_high: taken as algo.clip_high=0.28 ({tmp_path / 'trl.yaml'}" \
        in capsys.readouterr().err
    with pytest.raises(ConfigError, match="per_device_train_batch_size"):  # (another meaning here: not an alias)
        load_config(None, ["per_device_train_batch_size=8"])


def test_one_setting_gives_grpo_as_the_paper_defines_it_and_a_field_set_beside_it_wins():
    plain = load_config(None, ["algo.preset=grpo"])
    a, r = plain.algo, plain.rollout
    assert (a.advantage, a.loss, a.clip_low, a.clip_high, a.dual_clip, a.agg, a.kl_coef, a.kl_estimator) == (
        "grpo", "ppo_clip", 0.2, 0.2, None, "seq_mean_token_mean", 0.04, "k3")
    assert (r.budget, r.dynamic_sampling) == ("fixed", False)
    mine = load_config(None, ["algo.preset=grpo", "algo.kl_coef=0", "rollout.dynamic_sampling=true"])
    assert (mine.algo.kl_coef, mine.rollout.dynamic_sampling, mine.algo.clip_high) == (0.0, True, 0.2)
    default = load_config(None, [])  # relayrl's: clip-higher, dual-clip, token mean, β 0.05, adaptive sampling
    a, r = default.algo, default.rollout
    assert (a.preset, a.clip_high, a.dual_clip, a.agg, a.kl_coef, r.budget, r.dynamic_sampling) == (
        "relayrl", None, 3.0, "token_mean", 0.05, "adaptive", True)


def test_relayrl_sft_refuses_what_it_does_not_read():
    from relayrl.config.commands import check_command

    for field in ("trainer.updates_per_step=2", "reward.fn_weights=[1]", "algo.kl_coef=0.1"):
        with pytest.raises(ValueError, match=f"{field.split('=')[0]} is set, but relayrl sft does not read it"):
            check_command(load_config(None, [field, "reward.fn=[math]"] if "fn_weights" in field else [field]), "sft")


def test_a_teacher_with_gspo_is_refused_for_gspo_token():
    """GSPO's sequence-level advantage averaged the teacher's per-token term over each response."""
    with pytest.raises(ConfigError, match=r"teacher with algo.loss=gspo: .*use algo.loss=gspo_token"):
        load_config(None, ["teacher.path=runs/demo", "algo.loss=gspo"])
    assert load_config(None, ["teacher.path=runs/demo", "algo.loss=gspo_token"]).algo.loss == "gspo_token"
