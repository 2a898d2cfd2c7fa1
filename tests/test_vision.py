"""Vision-language policies (relayrl.models.vision) and image data (relayrl.models.images): rows' images read and
checked, prompts encoded through the processor, the engine and the trainer scoring the same tokens under the same
image features, the tower frozen, checkpoints that load with AutoProcessor, and one-line refusals."""

import base64
import io
import json
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw

import relayrl
from relayrl.data.datasets import DataError, load_prompts
from relayrl.demo.vision_model import build_tiny_vlm
from relayrl.models import ModelError, load_policy, load_tokenizer, vision
from relayrl.models.prompts import encode_prompt


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return str(build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "m", seed=1))


def _png(color, size=(30, 20)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def _digits(folder, n=8):
    rows = []
    for i in range(n):
        im = Image.new("RGB", (64, 64), "white")
        ImageDraw.Draw(im).text((25, 25), str(i % 10), fill="black")
        im.save(folder / f"img{i}.png")
        rows.append({"id": f"p{i}", "prompt": "What digit is drawn?", "images": [f"img{i}.png"], "answer": str(i % 10)})
    (folder / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return folder / "train.jsonl"


def test_rows_images_every_form_in_order_and_bad_ones_name_their_row(tmp_path):
    (tmp_path / "red.png").write_bytes(_png((255, 0, 0)))
    url = "data:image/png;base64," + base64.b64encode(_png((0, 0, 255))).decode()
    parts = [{"type": "text", "text": "compare "}, {"type": "image"}, {"type": "text", "text": " and "},
             {"type": "image_url", "image_url": {"url": url}}]
    rows = [{"prompt": "What color?", "images": ["red.png"], "answer": "red"},
            {"prompt": [{"role": "user", "content": parts}], "images": None, "answer": "x"},
            {"prompt": "<image> then <image>", "images": ["red.png", url], "answer": "y"},
            {"prompt": "a text row", "answer": "z"}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:1] + rows[2:]))
    p = load_prompts(str(tmp_path / "d.jsonl"))
    assert p[0].messages[0]["content"] == "<image>What color?" and p[0].images == (str(tmp_path / "red.png"),)
    assert p[1].images == (str(tmp_path / "red.png"), url) and p[2].images == ()
    import pyarrow as pa
    import pyarrow.parquet as pq

    green = _png((0, 255, 0))  # (bytes: Parquet's and datasets' form)
    pq.write_table(pa.Table.from_pylist([{"prompt": "which? <image>", "images": [green], "answer": "g"}]),
                   tmp_path / "d.parquet")
    q = load_prompts(str(tmp_path / "d.parquet"))[0]
    assert q.messages[0]["content"] == "which? <image>" and base64.b64decode(q.images[0].split(",")[1]) == green
    from relayrl.data.datasets import _with_images

    rows[1]["images"] = [green]
    messages, refs = _with_images(rows[1], str(tmp_path / "d.jsonl"), "here", "prompt", "chat", "images")
    assert messages[0]["content"] == "compare <image> and <image>"
    assert refs[0].startswith("data:image/png;base64,") and refs[1] == url
    bad = {"bad.png": "line 1: field 'images' image 1 .*not a readable image",
           "nope.png": "line 1: field 'images' image 1: no such image file",
           "https://example.com/a.png": "remote URL; nothing is fetched from the network",
           "data:image/png;base64,@@": "a data URL whose base64 does not decode"}
    (tmp_path / "bad.png").write_bytes(_png((1, 2, 3))[:30])  # (truncated)
    for image, why in bad.items():
        (tmp_path / "b.jsonl").write_text(json.dumps({"prompt": "x", "images": [image], "answer": "a"}))
        with pytest.raises(DataError, match=why):
            load_prompts(str(tmp_path / "b.jsonl"))
    (tmp_path / "b.jsonl").write_text(json.dumps({"prompt": "<image><image>", "images": ["red.png"], "answer": "a"}))
    with pytest.raises(DataError, match="b.jsonl: line 1: field 'prompt': 2 <image> markers but 1 images"):
        load_prompts(str(tmp_path / "b.jsonl"))


def test_a_prompt_with_images_is_the_processors_tokens_and_its_features_the_models(vlm, tmp_path):
    (tmp_path / "red.png").write_bytes(_png((255, 0, 0)))
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "<image> then <image>?",
                                                  "images": ["red.png", "red.png"], "answer": "y"}))
    p = load_prompts(str(tmp_path / "d.jsonl"))[0]
    tok, model = load_tokenizer(vlm, "chat"), load_policy(vlm)
    ids = encode_prompt(tok, p.messages, "chat", p.images)
    proc = vision.processor_of(tok)
    assert ids.count(model.config.image_token_id) == 8  # (4 an image, the processor's expansion)
    text = proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " then "},
                                     {"type": "image"}, {"type": "text", "text": "?"}]}], add_generation_prompt=True,
                                    tokenize=False)
    images = [Image.open(tmp_path / "red.png").convert("RGB")] * 2
    want = proc(text=[text], images=[images], return_tensors="pt")
    assert ids == want["input_ids"][0].tolist()
    cache = vision.FeatureCache()
    with torch.no_grad():
        got = model(**vision.inputs(model, torch.tensor([ids, ids]), [p.images, p.images], cache)).logits
        assert torch.allclose(got[0], model(**want).logits[0], atol=1e-6)
    assert cache.encoded == 1  # (one image, in two rows and twice in each: encoded once)
    (tmp_path / "blue.png").write_bytes(_png((0, 0, 255)))
    small = vision.FeatureCache(size=1)  # (a batch with more images than the cache keeps gets them all)
    both = small.get(model, [p.images[0], str(tmp_path / "blue.png")])
    assert len(both) == 2 and not torch.equal(both[0], both[1]) and small.encoded == 2
    with pytest.raises(vision.VisionError, match="image 1.s tokens .* are not in its ids"):
        vision.embed(model, torch.tensor([ids[: ids.index(model.config.image_token_id) + 4]]), [p.images])
    sampled = ids + [model.config.image_token_id]  # (the policy sampled an image token: a token, as the engine fed it)
    with torch.no_grad():
        emb = vision.embed(model, torch.tensor([sampled]), [p.images])
        assert torch.equal(emb[0, -1], model.get_input_embeddings().weight[model.config.image_token_id])


def test_a_vlm_trains_two_steps_engine_equal_to_trainer_tower_frozen_checkpoint_a_processor(vlm, tmp_path):
    data = _digits(tmp_path)
    run = relayrl.Run(model={"path": vlm, "lora": {"r": 4}}, data={"path": str(data), "eval_path": None},
                      run={"output_dir": str(tmp_path), "name": "v", "steps": 2, "progress": False},
                      rollout={"max_new_tokens": 6, "prompts_per_step": 2, "group_size": 2})
    assert run.train()["steps"] == 2
    rows = [json.loads(x) for x in (run.dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["logprob_mismatch_max"] < 1e-5 and r["logprob_mismatch_tokens"] > 0 for r in rows)
    ckpt = run.dir / "checkpoints" / "step_000002"
    from transformers import AutoProcessor

    assert type(AutoProcessor.from_pretrained(ckpt)).__name__ == "Idefics3Processor"
    adapter = json.loads((ckpt / "adapter_config.json").read_text())
    assert "vision_model" in adapter["exclude_modules"]  # (the tower frozen: its q_proj gets no adapter)
    from safetensors.torch import load_file

    names = list(load_file(ckpt / "adapter_model.safetensors"))
    assert names and not [n for n in names if "vision_model" in n or "connector" in n]


def test_the_tower_stays_frozen_unless_trained(vlm):
    for train in (False, True):
        model = load_policy(vlm)
        vision.freeze_tower(model, train)
        tower = list(model.model.vision_model.parameters()) + list(model.model.connector.parameters())
        assert all(p.requires_grad == train for p in tower)
        assert all(p.requires_grad for p in model.model.text_model.parameters())


def test_a_text_model_given_images_a_family_not_built_and_no_processor_are_refused_in_one_line(tiny_path, vlm,
                                                                                            tmp_path):
    data = _digits(tmp_path, 2)
    run = relayrl.Run(model={"path": tiny_path}, data={"path": str(data), "eval_path": None},
                      run={"output_dir": str(tmp_path), "name": "t", "steps": 1, "progress": False})
    with pytest.raises(DataError, match=r"train.jsonl: prompt id 'p0': a prompt with 1 image\(s\), but the model "
                                        "is text-only"):
        run.train()
    qwen = tmp_path / "qwen"
    qwen.mkdir()
    (qwen / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": {"depth": 2}}))
    for load in (load_tokenizer, load_policy):  # (the tokenizer first: a run encodes its prompts before the model)
        with pytest.raises(ModelError, match="model.path: a qwen2_5_vl vision-language model is not supported yet: "
                                             r"its image tokens take 3-D \(mRoPE\) positions"):
            load(str(qwen))
    (tmp_path / "sys.jsonl").write_text(json.dumps({"prompt": [{"role": "system", "content": "<image>"},
                                                               {"role": "user", "content": "hi"}],
                                                    "images": ["img0.png"], "answer": "0"}))
    bad_template = tmp_path / "tpl"
    import shutil

    shutil.copytree(vlm, bad_template)
    (bad_template / "chat_template.jinja").write_text(  # (a template that raises on an image in a system message)
        "{% for m in messages %}{% if m['role'] == 'system' and m['content'] is not string %}"
        "{{ raise_exception('images only in user turns') }}{% endif %}{{ m['role'] }}{% endfor %}")
    run = relayrl.Run(model={"path": str(bad_template)}, data={"path": str(tmp_path / "sys.jsonl"), "eval_path": None},
                      run={"output_dir": str(tmp_path), "name": "tpl", "steps": 1, "progress": False})
    with pytest.raises(DataError, match=r"sys.jsonl: prompt id 'row1': the processor cannot encode this prompt with its "
                                        r"1 image\(s\): .*images only in user turns"):
        run.train()

    bare = shutil.copytree(vlm, tmp_path / "bare")
    (bare / "processor_config.json").unlink()  # (AutoProcessor then gives the bare tokenizer)
    with pytest.raises(ModelError, match="bare': cannot load the processor: the folder has no processor_config.json "
                                         "or preprocessor_config.json"):
        load_tokenizer(str(bare))


@pytest.mark.parametrize("setting, within", [({"trainer": {"pack": True}}, 1e-5),
                                             ({"trainer": {"gradient_checkpointing": "on"}}, 1e-5),
                                             ({"model": {"dtype": "bfloat16"}}, 2e-2),
                                             ({"model": {"lora": {"r": 4, "targets": "all-linear"}}}, 1e-5)])
def test_a_vlm_through_packing_checkpointing_and_bfloat16_scores_what_the_engine_sampled(vlm, tmp_path, setting,
                                                                                          within):
    assert all(0 <= m < within for m in mismatches(vlm, tmp_path, setting))


def mismatches(path: str, tmp_path, setting: dict) -> list[float]:
    """Each step's engine-trainer log-prob mismatch in a 2-step run of the model at ``path`` with ``setting``."""
    data = _digits(tmp_path, 4)
    run = relayrl.Run(model={"path": path, **setting.get("model", {})}, trainer=setting.get("trainer", {}),
                      data={"path": str(data), "eval_path": None},
                      run={"output_dir": str(tmp_path), "name": "c", "steps": 2, "progress": False},
                      rollout={"max_new_tokens": 6, "prompts_per_step": 4, "group_size": 2})
    run.train()
    return [json.loads(x)["logprob_mismatch_max"] for x in (run.dir / "metrics.jsonl").read_text().splitlines()]


def test_a_vlm_run_resumes_from_its_checkpoint(vlm, tmp_path):
    data = _digits(tmp_path, 4)

    def run(steps):
        return relayrl.Run(model={"path": vlm}, data={"path": str(data), "eval_path": None},
                           run={"output_dir": str(tmp_path), "name": "r", "steps": steps, "progress": False},
                           rollout={"max_new_tokens": 6, "prompts_per_step": 2, "group_size": 2})

    run(2).train()
    assert run(3).train(resume=True)["steps"] == 3
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["logprob_mismatch_max"] < 1e-5


def test_the_vlm_demo_ships_its_weights_and_its_rows_carry_images(tmp_path):
    from relayrl.demo import vlm_demo

    assert vlm_demo.vlm_demo_model_path() == vlm_demo.SHIPPED  # (its recipe is the shipped one's: nothing built)
    rows = load_prompts("builtin:vlm-demo-eval")
    assert len(rows) == 200 and all(len(p.images) == 1 and p.images[0].startswith("data:image/png") for p in rows)
    assert {p.messages[0]["content"] for p in rows} == {"<image>Which digit is on the left?",
                                                        "<image>Which digit is on the right?"}
    example = Path(__file__).resolve().parent.parent / "examples" / "vlm_demo.yaml"
    run = relayrl.Run(str(example), ["run.steps=2", "eval.size=8", f"run.output_dir={tmp_path}", "run.progress=false",
                                     "rollout.prompts_per_step=4", "rollout.group_size=4"])  # (its config, made small)
    summary = run.train()
    assert summary["steps"] == 2 and 0 <= summary["eval_accuracy_before"] <= 1


def test_sft_refuses_images_and_vision_language_models_instead_of_training_their_text_alone(vlm, tiny_path, tmp_path):
    data = _digits(tmp_path, 2)
    with pytest.raises(ModelError, match="a vision-language model; relayrl sft does not take them yet"):
        relayrl.Run(model={"path": vlm}, data={"path": str(data), "eval_path": None}, sft={"epochs": 1},
                    run={"output_dir": str(tmp_path), "name": "s", "progress": False}, command="sft").train()
    (tmp_path / "s.jsonl").write_text(json.dumps({"prompt": "x", "response": "y", "images": ["img0.png"]}))
    with pytest.raises(DataError, match="s.jsonl: line 1: field 'images': relayrl sft does not take images yet"):
        relayrl.Run(model={"path": tiny_path}, data={"path": str(tmp_path / "s.jsonl"), "eval_path": None},
                    sft={"epochs": 1}, run={"output_dir": str(tmp_path), "name": "s2", "progress": False},
                    command="sft").train()


def test_packed_rows_with_images_give_the_padded_rows_log_probs_even_with_a_sampled_image_token(vlm, tmp_path):
    """Packing placed the micro-batch's features over its packed row in order: a row whose response sampled an
    image token took the next row's first image token's features (0.12 nats off in a run)."""
    from relayrl.config import AlgoCfg, TrainerCfg
    from relayrl.records import Prompt, Trajectory
    from relayrl.train.batch import build_batch
    from relayrl.train.trainer import Trainer

    tok, model = load_tokenizer(vlm, "chat"), load_policy(vlm)
    image_token = model.config.image_token_id
    trajs = []
    for i, color in enumerate(((255, 0, 0), (0, 0, 255))):
        (tmp_path / f"{i}.png").write_bytes(_png(color))
        p = Prompt(f"p{i}", [{"role": "user", "content": "<image>which?"}], images=(str(tmp_path / f"{i}.png"),))
        ids = encode_prompt(tok, p.messages, "chat", p.images)
        response = [5, image_token, 7] if i == 0 else [6, 8, 9, 10]  # (row 0 sampled an image token)
        trajs.append(Trajectory(p, f"g{i}", 0, ids, response, [0.0] * len(response), [0] * len(response)))
    batch = build_batch(trajs, torch.ones(2), tok.pad_token_id)
    out = {}
    for pack in (False, True):
        tr = Trainer(model, TrainerCfg(pack=pack, share_prefix=False), AlgoCfg(kl_coef=0.0), 1.0, 10, 16)
        out[pack] = tr.logprobs(batch)
    assert out[False].abs().sum() > 0
    torch.testing.assert_close(out[True], out[False], atol=2e-6, rtol=1e-5)
