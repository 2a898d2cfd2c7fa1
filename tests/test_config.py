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
        ("algo.advantage=grpoo", "grpo, rloo"),
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

    for sec, info in Config.model_fields.items():
        for name in info.annotation.model_fields:
            assert f"{sec}.{name} " in text
