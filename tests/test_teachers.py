"""On-policy distillation: teachers' log-probs of the student's tokens (local, and over HTTP from a real server
on loopback), the per-token advantage in the trainer (hand-computed), tokenizers refused, failures counted,
and a pure-distillation run moving the student toward its teacher."""

import copy
import dataclasses

import pytest
import torch

from relayrl.config import AlgoCfg, TeacherCfg, TrainerCfg
from relayrl.models import ModelError, load_policy, load_tokenizer
from relayrl.rewards.teachers import LocalTeacher, RemoteTeacher, TeacherError, Teachers
from relayrl.train.trainer import Trainer
from tests.openai_server import Server
from tests.test_shared_prefix import _groups


def _plain(model, items):
    """log π of each item's response tokens from the model's whole logits (the reference)."""
    out = []
    for p, r in items:
        ids = torch.tensor([p + r])
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        out.append([lp[len(p) - 1 + j, r[j]].item() for j in range(len(r))])
    return out


ITEMS = [([5, 6, 7], [8, 9, 10, 11]), ([12], [13]), ([1, 2, 3, 4, 5, 6], [7, 8])]


def test_a_local_teacher_gives_the_log_probs_of_the_response_tokens(tiny_path):
    t = LocalTeacher(tiny_path, "teacher.path", "cpu", batch_tokens=12)  # (several forwards: the budget splits them)
    got = t.score(ITEMS)
    want = _plain(load_policy(tiny_path), ITEMS)
    assert [len(x) for x in got] == [4, 1, 2]
    for a, b in zip(got, want):
        assert a == pytest.approx(b, abs=1e-5)


def test_a_teacher_over_http_gives_the_same_log_probs(tiny_path):
    model, tok = load_policy(tiny_path), load_tokenizer(tiny_path)
    with Server(model, tok, key="s3cret") as url:
        import os

        os.environ["RELAYRL_TEST_KEY"] = "s3cret"
        t = RemoteTeacher(url, "teacher.url", key_env="RELAYRL_TEST_KEY")
        assert t.model == "test-model"
        got = t.score(ITEMS)
    for a, b in zip(got, _plain(model, ITEMS)):
        assert a == pytest.approx(b, abs=1e-5)


def test_a_server_that_echoes_too_few_log_probs_is_an_error_not_a_shorter_list(tiny_path):
    with Server(load_policy(tiny_path), load_tokenizer(tiny_path), bad_echo=True) as url:
        with pytest.raises(TeacherError, match="log-probs for 3 of the response's 4 tokens"):
            RemoteTeacher(url, "teacher.url").score(ITEMS[:1])


def test_transient_errors_are_retried_then_answered(tiny_path):
    with Server(load_policy(tiny_path), load_tokenizer(tiny_path), fail_first=2) as url:
        t = RemoteTeacher(url, "teacher.url", retries=3)
        assert len(t.score(ITEMS[:1])[0]) == 4
    with Server(load_policy(tiny_path), load_tokenizer(tiny_path), fail_first=5) as url:
        with pytest.raises(TeacherError, match="HTTP 503 .* \\(after 2 tries\\)"):
            RemoteTeacher(url, "teacher.url", retries=1).score(ITEMS[:1])


def test_a_url_that_does_not_answer_is_one_line_at_start():
    with pytest.raises(ModelError, match="teacher.url='http://127.0.0.1:9/v1': the server does not answer"):
        RemoteTeacher("http://127.0.0.1:9/v1", "teacher.url")


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(tiny_path, tmp_path):
    from relayrl.demo import model as demo_model

    other = demo_model.build_tokenizer(7, 270)  # (another vocabulary)
    demo_model.build_model(other, {**demo_model.RECIPE, "hidden_size": 16, "layers": 1, "heads": 2,
                                   "intermediate_size": 32}).save_pretrained(tmp_path)
    other.save_pretrained(tmp_path)
    with pytest.raises(ModelError, match=r"teacher.path=.*its tokenizer \(\d+ tokens\) is not the student's "
                                         r"\(model.path=.*cross-tokenizer distillation is not supported"):
        Teachers(TeacherCfg(path=str(tmp_path)), load_tokenizer(tiny_path))


def test_each_prompt_gets_its_teacher_by_name(tiny_path):
    from relayrl.records import Prompt

    cfg = TeacherCfg(teachers={"a": tiny_path, "b": tiny_path}, device="cpu")
    p = [Prompt("x", [], None, {"teacher": "b"}), Prompt("y", [], None, {"teacher": "a"})]
    ts = Teachers(cfg, load_tokenizer(tiny_path), prompts=p)
    assert ts.for_prompt(p[0]) is ts.by_name["b"] and ts.for_prompt(p[1]) is ts.by_name["a"]
    with pytest.raises(ValueError, match="teacher 'c' .* is not one of teacher.teachers: a, b"):
        Teachers(cfg, load_tokenizer(tiny_path), prompts=[Prompt("z", [], None, {"teacher": "c"})])
    with pytest.raises(ValueError, match="has no metadata field 'teacher'.*no default teacher"):
        ts.for_prompt(Prompt("w", [], None, {}))


# -- the trainer's term ----------------------------------------------------------------------------------

def test_the_distillation_term_by_hand(tiny):
    """A = reward_coef · A_task + λ (log π_T − log π_old) on trained tokens; the reverse KL Σ(log π_old − log π_T)."""
    model, tok = tiny
    tr = Trainer(model, TrainerCfg(), AlgoCfg(kl_coef=0), 1.0, 10, 16, teacher_coef=0.5)
    batch = _groups(tok)
    mb = batch.select([0, 1])
    mask = mb.loss_mask
    old = torch.full_like(mask, -2.0) * mask
    mb = dataclasses.replace(mb, advantages=torch.ones_like(mask) * mask, teacher_logp=torch.full_like(mask, -1.0) * mask)
    out, rkl = tr._distilled(mb, old)
    # 1 + 0.5 · (−1 − (−2)) = 1.5 on every trained token, 0 elsewhere
    assert torch.equal(out.advantages, 1.5 * mask)
    assert rkl == pytest.approx(-1.0 * mask.sum().item())  # Σ (−2 − (−1))


def test_a_student_equal_to_its_teacher_has_no_reverse_kl_and_reward_coef_scales_the_task(tiny, tiny_path):
    """verl's sanity check: the student scoring its own tokens as its teacher gives KL ≈ 0 and no teacher term;
    algo.reward_coef multiplies the verifier's advantage."""
    model, tok = tiny
    batch = _groups(tok)
    t = LocalTeacher(tiny_path, "teacher.path", "cpu")
    lps = t.score([(batch.input_ids[i, : int(batch.attention_mask[i].sum())].tolist()[: int(batch.loss_mask[i].nonzero()[0]) + 1],
                    batch.input_ids[i, int(batch.loss_mask[i].nonzero()[0]) + 1 : int(batch.attention_mask[i].sum())].tolist())
                   for i in range(batch.size)])
    teacher = torch.zeros_like(batch.loss_mask)
    for i, lp in enumerate(lps):
        s = int(batch.loss_mask[i].nonzero()[0])
        teacher[i, s : s + len(lp)] = torch.tensor(lp)
    batch = dataclasses.replace(batch, teacher_logp=teacher * batch.loss_mask, rewards=batch.advantages.clone(),
                                group=torch.arange(batch.size) // 4)
    norms = []
    for coef in (0.0, 1.0):
        tr = Trainer(copy.deepcopy(model), TrainerCfg(lr=1e-2, warmup_steps=0), AlgoCfg(kl_coef=0, reward_coef=coef),
                     1.0, 10, 16, teacher_coef=1.0)
        metrics = tr.step(batch)
        assert abs(metrics["teacher/reverse_kl"]) < 1e-5
        norms.append(metrics["grad_norm"])
    assert norms[0] < 1e-4 < norms[1]  # (the teacher's term alone: nothing to learn from a teacher that is oneself)
    # and the term is there: a teacher that disagrees on every other token moves the student with reward_coef=0
    # (the test passed with the teacher's term removed from the loss: both cases above give 0 without it)
    shifted = dataclasses.replace(batch, teacher_logp=(teacher - 0.7 * (torch.arange(teacher.shape[1]) % 2)) *
                                  batch.loss_mask)
    tr = Trainer(copy.deepcopy(model), TrainerCfg(lr=1e-2, warmup_steps=0), AlgoCfg(kl_coef=0, reward_coef=0.0),
                 1.0, 10, 16, teacher_coef=1.0)
    metrics = tr.step(shifted)
    assert metrics["teacher/reverse_kl"] > 0.1 and metrics["grad_norm"] > 1e-3


def test_repeated_distillation_steps_on_one_batch_close_the_gap(tiny, tiny_path, tmp_path):
    """The teacher's term alone (algo.reward_coef=0), on a fixed batch: the reverse KL on its tokens falls to
    nearly nothing (the direction and the size of the term: a sign error would raise it)."""
    model, tok = tiny
    batch = _groups(tok)
    teacher = LocalTeacher(_other_tiny(tiny_path, tmp_path / "teacher"), "teacher.path", "cpu")
    starts = [int(batch.loss_mask[i].nonzero()[0]) for i in range(batch.size)]
    rows = [batch.input_ids[i, : int(batch.attention_mask[i].sum())].tolist() for i in range(batch.size)]
    lps = teacher.score([(r[: s + 1], r[s + 1 :]) for r, s in zip(rows, starts)])
    tl = torch.zeros_like(batch.loss_mask)
    for i, (lp, s) in enumerate(zip(lps, starts)):
        tl[i, s : s + len(lp)] = torch.tensor(lp)
    batch = dataclasses.replace(batch, teacher_logp=tl * batch.loss_mask, rewards=torch.zeros_like(batch.loss_mask),
                                group=torch.arange(batch.size) // 4)
    tr = Trainer(model, TrainerCfg(lr=1e-2, warmup_steps=0), AlgoCfg(kl_coef=0, reward_coef=0), 1.0, 100, 16,
                 teacher_coef=1.0)
    rkl = [tr.step(batch)["teacher/reverse_kl"] for _ in range(16)]
    assert rkl[0] > 0.5 and rkl[-1] < 0.1 * rkl[0], rkl


# -- end to end ------------------------------------------------------------------------------------------

def _other_tiny(tiny_path, folder, sharpen=10.0):
    """A teacher with the student's tokenizer that disagrees with it in a way a few steps can learn: the student
    sharpened (its logits × ``sharpen``, through the head)."""
    tok = load_tokenizer(tiny_path)
    m = load_policy(tiny_path)
    m.config.tie_word_embeddings = False
    m.lm_head.weight = torch.nn.Parameter(m.model.embed_tokens.weight.detach().clone() * sharpen)
    m.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


OPD = ["data.eval_path=null", "rollout.max_new_tokens=12", "rollout.prompts_per_step=4", "rollout.group_size=4",
       "trainer.lr=1e-2", "trainer.warmup_steps=0", "run.progress=false", "run.threads=1", "algo.kl_coef=0"]


@pytest.mark.slow
def test_pure_distillation_moves_the_student_to_its_teacher(tiny_path, tmp_path):
    from relayrl.config import load_config
    from relayrl.run.loop import train
    from tests.test_e2e import _metrics

    teacher = _other_tiny(tiny_path, tmp_path / "teacher")
    cfg = load_config(None, OPD + [f"model.path={tiny_path}", f"teacher.path={teacher}", "algo.reward_coef=0",
                                   "reward.fn=none", "run.steps=60", f"run.output_dir={tmp_path}"])
    train(cfg)
    m = _metrics(cfg.run_dir)
    rkl = [r["teacher/reverse_kl"] for r in m]  # (on the student's own samples: noisy, so ten steps' means)
    assert sum(rkl[:10]) / 10 > 0.5 and sum(rkl[-10:]) / 10 < 0.85 * sum(rkl[:10]) / 10, rkl
    assert all(r["failures/teacher"] == 0 for r in m)


@pytest.mark.slow
def test_a_teacher_that_fails_mid_run_fails_its_episodes_and_stops_the_run_naming_it(tiny_path, tmp_path):
    from relayrl.config import load_config
    from relayrl.failures import UserCodeError
    from relayrl.run.loop import train

    # (its first request, the vocabulary check at start, answered; every one after it fails)
    with Server(load_policy(tiny_path), load_tokenizer(tiny_path), fail_after=1, fail_status=500) as url:
        cfg = load_config(None, OPD + [f"model.path={tiny_path}", f"teacher.url={url}", "teacher.timeout_s=30",
                                       "reward.fn=tests.rewards_for_tests:digit_fraction", "run.steps=2",
                                       f"run.output_dir={tmp_path}"])
        with pytest.raises(UserCodeError, match=r"step 1: teacher.url=http://127.0.0.1:\d+/v1 failed in \d+ of \d+ "
                                                r"episodes: TeacherError: HTTP 500"):
            train(cfg)


def test_a_teacher_over_http_with_another_vocabulary_is_refused_at_start(tiny_path):
    """A remote teacher was never checked against the student's tokenizer: a renumbered vocabulary was accepted
    (up to 1.26 nats off). The server's text of probe token ids is compared with the student's."""
    model, tok = load_policy(tiny_path), load_tokenizer(tiny_path)
    with Server(model, tok) as url:  # the same vocabulary: accepted
        Teachers(TeacherCfg(url=url), tok).close()

    class Renumbered:  # the same tokens, each id one further on
        def decode(self, ids):
            return tok.decode([(i + 1) % len(tok) for i in ids])

    with Server(model, Renumbered()) as url:
        with pytest.raises(ModelError, match=r"teacher.url=.*: its tokenizer is not the student's \(model.path=.*\): "
                                             r"\d+ of 48 token ids checked are other text there"):
            Teachers(TeacherCfg(url=url), tok)


def test_a_local_teacher_is_read_under_the_students_sampling(tiny_path):
    """The student samples at T=0.7 with top-p 0.9 and its log-probs are read so: the teacher's were read at T=1
    over the whole vocabulary, so a student equal to its teacher was still pushed. Now both under one transform."""
    from relayrl.train.logprobs import sampled_logprobs

    model = load_policy(tiny_path)
    t = LocalTeacher(tiny_path, "teacher.path", "cpu", sampling=(0.7, 0, 0.9))
    got = t.score(ITEMS)
    for (p, r), lps in zip(ITEMS, got):
        ids = torch.tensor([p + r])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(p) - 1: len(p) - 1 + len(r)].float()
        want = sampled_logprobs(logits, torch.tensor(r), 0.7, 0, 0.9)  # (the student's, as the trainer reads them)
        assert lps == pytest.approx(want.tolist(), abs=1e-5)
    assert any(abs(a - b) > 1e-3 for x, y in zip(got, _plain(model, ITEMS)) for a, b in zip(x, y))  # (T=1's differ)


def test_a_teacher_over_http_scores_a_batch_at_once(tiny_path):
    """A remote teacher scored a batch one HTTP call after the other (the batch's episodes waiting, their deadline
    counting the wait): a batch's calls now go at once, seen by the server as requests in flight together."""
    model, tok = load_policy(tiny_path), load_tokenizer(tiny_path)
    server = Server(model, tok, delay_s=0.3)
    with server as url:
        t = RemoteTeacher(url, "teacher.url")
        items = ITEMS * 3  # (9 calls)
        got = t.score(items)
    assert [len(x) for x in got] == [len(r) for _, r in items]
    assert server.max_waiting >= 2  # (one after the other: 1)


def test_a_teacher_server_failing_its_vocabulary_check_is_one_line_at_start(tiny_path):
    model, tok = load_policy(tiny_path), load_tokenizer(tiny_path)
    with Server(model, tok, fail_first=10**6, fail_status=500) as url:
        with pytest.raises(ModelError, match=r"teacher.url=.*: the request that checks its vocabulary failed: HTTP 500"):
            Teachers(TeacherCfg(url=url), tok)
