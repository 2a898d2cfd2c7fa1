"""The workspace demo's policy (relayrl.demo.swe_model, built by relayrl.run.swe_demo): scripted episodes that are what env.name=workspace
gives and takes, none on a held-out repository, and shipped weights that match their recipe."""

import asyncio
import json
import random
import re
import shutil

import pytest

from relayrl.demo import swe_task
from relayrl.demo.swe_model import RECIPE, SHIPPED
from relayrl.run import swe_demo


def test_a_scripted_episode_is_what_the_workspace_environment_gives_and_takes():
    """The corpus's tool results are the real tools' outputs on the same repository (row 0 of builtin:swe-demo is
    the first draw of its seed); only pytest's timing differs."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed")
    from relayrl.data.datasets import load_prompts
    from relayrl.envs.tools import parse_tool_calls
    from relayrl.envs.workspace import WorkspaceEnv

    scripted = swe_demo.episode(swe_task.content(random.Random(1)), fix=True, rng=random.Random(0))
    prompt = load_prompts("builtin:swe-demo")[0]

    async def play():
        env = WorkspaceEnv()
        seen = [(await env.reset(prompt))[-1]]
        try:
            for m in scripted[1:]:
                if m["role"] == "assistant":
                    seen.append({"role": "assistant", "content": m["content"]})
                    r = await env.step(m["content"])
                    seen += [{"role": "tool", "content": x["content"]} for x in r.messages]
                    if r.done:
                        return seen, r.reward
        finally:
            await env.close()

    seen, reward = asyncio.run(play())
    timing = re.compile(r"passed in \d+\.\d+s")
    assert [(m["role"], timing.sub("", m["content"])) for m in seen] == [
        (m["role"], timing.sub("", m["content"])) for m in scripted]
    assert reward == 1.0 and [c.name for m in scripted if m["role"] == "assistant"
                              for c in parse_tool_calls(m["content"])] == ["view", "str_replace", "bash", "submit"]


def test_the_corpus_leaves_the_held_out_repositories_out_and_fixes_at_its_rate():
    held_out = {r["problem_statement"] for r in swe_task.make_rows(32, seed=2, split="eval")}
    episodes = swe_demo.corpus(600, seed=5, fix_rate=0.3)
    assert not {e[0]["content"].split("\n\n")[0] for e in episodes} & held_out
    fixed = sum(any('"str_replace"' in m["content"] for m in e) for e in episodes) / len(episodes)
    assert 0.25 < fixed < 0.35
    lazy = next(e for e in episodes if len(e) == 6)  # look, run the visible tests, submit as it was
    assert ['"view"' in lazy[1]["content"], '"bash"' in lazy[3]["content"], '"submit"' in lazy[5]["content"]] == \
        [True] * 3


def test_shipped_weights_load_and_match_the_recipe():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relayrl.models import resolve_model_path

    assert resolve_model_path("builtin:swe-demo", log=lambda *_: None) == str(SHIPPED)
    assert json.loads((SHIPPED / "relayrl_recipe.json").read_text()) == RECIPE
    model = AutoModelForCausalLM.from_pretrained(SHIPPED)
    assert model.config.max_position_embeddings == RECIPE["max_positions"]
    tok = AutoTokenizer.from_pretrained(SHIPPED)
    episode = swe_demo.corpus(1, seed=9, fix_rate=1.0)[0]
    assert len(tok.apply_chat_template(episode, tokenize=True)["input_ids"]) < RECIPE["max_positions"] // 4


@pytest.mark.slow
def test_a_recipe_of_its_own_is_built_by_relayrl_sft_in_a_process_of_its_own(tmp_path):
    from transformers import AutoModelForCausalLM

    from relayrl.demo.swe_model import build_swe_demo_model

    tiny = {"episodes": 64, "sft_epochs": 1, "sft_batch": 16, "hidden_size": 32, "layers": 1, "heads": 2,
            "intermediate_size": 64, "vocab_size": 400}
    out = build_swe_demo_model(tmp_path / "model", tiny, log=lambda *_: None)
    assert json.loads((out / "relayrl_recipe.json").read_text()) == {**RECIPE, **tiny}
    assert AutoModelForCausalLM.from_pretrained(out).config.hidden_size == 32
