"""Where the trainer runs (``distributed.py``): FSDP2 data parallelism and device placement.

On the CPU, two gloo processes train the tiny Llama with ``trainer.fsdp=true`` and must give what
one unsharded ``Trainer`` gives on the same batches: loss and every metric, the gradient, the
updated weights (gathered by ``full_state_dict``) and the optimiser state. An end-to-end
``torchrun`` run ends with a checkpoint equal to a single-process run's. A missing GPU or
launcher is a clear input error. The ``gpu`` tests run where CUDA is available.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from relayrl.train import distributed
from relayrl.algos import NEEDS_CRITIC
from relayrl.config import AlgoCfg, CriticCfg, TrainerCfg
from relayrl.train.critic import Critic, load_value_model
from relayrl.models import load_policy, load_tokenizer
from relayrl.train.trainer import Trainer, build_batch
from tests.test_trainer import _stale_batch, _trajs

ROOT = Path(__file__).parent.parent
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainer(path: str, tkw: dict, akw: dict, dtype: str = "float32", weights: dict | None = None,
             **placement) -> Trainer:
    policy = load_policy(path, dtype)
    tkw = dict(tkw)
    if r := tkw.pop("lora", 0):  # model.lora: the policy PEFT-wrapped (the same adapter in every process)
        from peft import set_peft_model_state_dict

        from relayrl.config.sections import LoraCfg
        from relayrl.train import lora

        roles = tkw.pop("roles", ())  # (model.lora.per_role: an adapter per role)
        torch.manual_seed(1234)
        policy, _ = lora.wrap(policy, LoraCfg(r=r, per_role=bool(roles)), roles)
        if weights:  # (full_state_dict: the adapter's tensors)
            set_peft_model_state_dict(policy, weights)
    elif weights:
        policy.load_state_dict(weights)
    tcfg, critic = TrainerCfg(**tkw, **placement), None
    if akw.get("advantage") in NEEDS_CRITIC:  # the critic, placed and sharded as the policy is
        device = distributed.resolve_device(tcfg.device)
        critic = Critic(load_value_model(path, dtype), CriticCfg(lr=1e-2, updates_per_step=2), tcfg, 10, device,
                        distributed.setup(device) if tcfg.fsdp else None)
    return Trainer(policy, tcfg, AlgoCfg(**akw), 1.0, 10, 16, critic=critic)


def _capture_grads(tr: Trainer, grads: list) -> None:
    """The whole gradient of every optimiser step, by name, into ``grads`` (a collective under FSDP).
    Not of the step at lr 0 by which loading an FSDP optimiser state creates it."""
    real_step = tr.opt.step

    def step(*a, **k):
        if tr.opt.param_groups[0]["lr"] == 0:
            return real_step(*a, **k)
        grads.append({n: (p.grad.full_tensor() if tr.dp else p.grad).detach().cpu().clone()
                      for n, p in tr.model.named_parameters() if p.requires_grad and p.grad is not None})
        return real_step(*a, **k)

    tr.opt.step = step


def _run(make, steps: list, resume_after: int = 0) -> dict:
    """The steps, then what the comparison needs (all on the CPU). With ``resume_after``: that many
    steps, then a new trainer from the weights and trainer state saved, as ``--resume`` does."""
    tr, grads, metrics = make(), [], []
    _capture_grads(tr, grads)
    torch.manual_seed(0)  # the mini-batch permutation (rank 0's, under FSDP)
    for i, (batch, version) in enumerate(steps):
        if i and i == resume_after:
            weights, state, rng = tr.full_state_dict(), tr.state_dict(), torch.get_rng_state()
            tr.close()
            tr = make(weights)  # (FSDP: the other ranks load the initial weights; rank 0's are sharded)
            _capture_grads(tr, grads)
            tr.load_state_dict(state)
            torch.set_rng_state(rng)
        metrics.append({k: v for k, v in tr.step(batch, version=version).items()
                        if not k.startswith("time/")})  # (wall-clock times differ run to run)
    weights = {k: v.detach().cpu().clone() for k, v in tr.full_state_dict().items()}
    state = tr.state_dict()
    out = {"metrics": metrics, "grads": grads, "weights": weights, "optim": _by_name(tr, tr.model, state)}
    if tr.critic is not None:
        out["critic"] = {k: v.detach().cpu().clone() for k, v in state["critic"]["weights"].items()}
        out["critic_optim"] = _by_name(tr, tr.critic.model, state["critic"])
    tr.close()
    return out


def _by_name(tr: Trainer, model, state: dict) -> dict:
    """The optimiser state by parameter name (as FSDP's full optimiser state is), without step counts."""
    optim = state["optimizer"]["state"]
    if tr.dp is None:
        names = [n for n, p in model.named_parameters() if p.requires_grad]  # (the optimiser's, in order)
        optim = {names[i]: s for i, s in optim.items()}
    return {n: {k: v.cpu() for k, v in s.items() if k != "step"} for n, s in optim.items()}


def _worker(rank: int, world: int, port: int, path: str, scenarios: dict, out: str, device: str) -> None:
    """One torchrun-like rank: rank 0 leads every scenario's trainers, the others follow them."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    results = {}
    for name, (tkw, akw, dtype, steps, resume_after) in scenarios.items():
        def make(weights=None, tkw=tkw, akw=akw, dtype=dtype):
            return _trainer(path, tkw, akw, dtype, weights, device=device, fsdp=True)

        if rank == 0:
            results[name] = _run(make, steps, resume_after)
            continue
        for _ in range(2 if resume_after else 1):
            tr = make()
            _capture_grads(tr, [])  # the same collectives as rank 0
            distributed.follow(tr)
    if rank == 0:
        torch.save(results, out)
    torch.distributed.destroy_process_group()


def _sharded(path: str, scenarios: dict, tmp_path: Path, world: int = 2, device: str = "cpu") -> dict:
    out = tmp_path / "sharded.pt"
    torch.multiprocessing.spawn(_worker, args=(world, _free_port(), path, scenarios, str(out), device), nprocs=world)
    return torch.load(out, weights_only=False)


def _close(a, b, what: str, rtol: float, atol: float, scale: float = 0.0) -> None:
    """``a`` and ``b`` within rtol·|b| + atol, each tensor's atol raised to ``scale`` times its largest value where
    that is more (an optimiser's moments: a sum in another order with cancellation leaves an element near 0 a few
    1e-7 of the tensor's scale apart, 6.9e-7 measured on one machine's critic scenario, 2026-11-29)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            _close(a[k], b[k], f"{what}.{k}", rtol, atol, scale)
    elif isinstance(a, list):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{what}[{i}]", rtol, atol, scale)
    elif isinstance(a, torch.Tensor):
        a, b = a.float(), b.float()
        atol = max(atol, scale * b.abs().max().item()) if b.numel() else atol
        assert torch.allclose(a, b, rtol=rtol, atol=atol), (what, (a - b).abs().max())
    elif isinstance(a, float):
        assert a == pytest.approx(b, rel=rtol, abs=atol), what
    else:
        assert a == b, what


def _scenarios(tok, model) -> dict:
    """Name -> (TrainerCfg fields, AlgoCfg fields, dtype, [(batch, version), ...], resume after). A
    small token budget gives an odd number of micro-batches, so one rank runs a padding pass."""
    a = build_batch(_trajs(tok, seed=1), torch.linspace(-1, 1, 8), tok.pad_token_id)
    b = build_batch(_trajs(tok, seed=2), torch.linspace(1, -1, 8), tok.pad_token_id)
    stale = _stale_batch(tok, model)
    later = _stale_batch(tok, model)  # its tokens one version later: v1 and v2
    later.versions = torch.where(later.loss_mask.bool(), later.versions + 1, -1)
    # (whole logits: the sharded steps are then bit for bit the unsharded ones, weights checked to 1e-6; the
    # chunked head sums its weight's gradient in another order, 3e-8 apart, which two Adam steps of lr 1e-2 grow
    # to a few 1e-6 in the weights: the last scenario)
    base = {"lr": 1e-2, "warmup_steps": 0, "micro_batch_tokens": 60, "logprob_chunk_tokens": 0}
    return {
        "on-policy, two steps, resumed between them": (base, {}, "float32", [(a, None), (b, None)], 1),
        "two updates, KL, ESS, stale tokens": (
            {**base, "updates_per_step": 2}, {"kl_coef": 0.1, "ess_lr_scale": True, "agg": "seq_mean_token_mean"},
            "float32", [(stale, 1)], 0),
        "m2po, mismatch under the previous weights": (
            base, {"offpolicy": "m2po"}, "float32", [(stale, 1), (later, 2)], 0),
        "bf16": (base, {}, "bfloat16", [(a, None)], 0),
        "critic (gae, two updates each), resumed between the steps": (
            {**base, "updates_per_step": 2}, {"advantage": "gae", "kl_coef": 0.1, "kl_mode": "reward"}, "float32",
            [(_with_rewards(tok, 1), None), (_with_rewards(tok, 2), None)], 1),
        "checkpointed layers, the LM head in chunks of 7 tokens, packed rows, entropy, KL reward, critic, resumed": (
            {**base, "gradient_checkpointing": "on", "logprob_chunk_tokens": 7, "pack": True},
            {"advantage": "gae", "kl_coef": 0.1, "kl_mode": "reward", "entropy_coef": 0.01}, "float32",
            [(_with_rewards(tok, 1), None), (_with_rewards(tok, 2), None)], 1),
    }


def _with_rewards(tok, seed: int):
    from tests.test_critic import reward_batch

    return reward_batch(tok, seed)


def test_share_deals_micro_batches_round_robin_padded():
    groups = [[0], [1, 2], [3], [4], [5, 6]]
    shares = [distributed.Group(r, 2, torch.device("cpu")).share(groups) for r in range(2)]
    assert shares == [[[0], [3], [5, 6]], [[1, 2], [4], None]]
    assert distributed.Group(2, 4, torch.device("cpu")).share([[0]]) == [None]


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")  # (_capture_grads)
@pytest.mark.slow
def test_two_gloo_ranks_give_the_unsharded_step(tiny_path, tmp_path):
    """Loss, metrics, gradient, weights and optimiser state of two sharded ranks = one process's."""
    tok = load_tokenizer(tiny_path)
    scenarios = _scenarios(tok, load_policy(tiny_path))
    torch.manual_seed(0)
    ref = {}
    for name, (tkw, akw, dtype, steps, resume) in scenarios.items():
        def make(weights=None, tkw=tkw, akw=akw, dtype=dtype):  # (the ranks forward plainly: no shared prefixes)
            return _trainer(tiny_path, {**tkw, "share_prefix": False}, akw, dtype, weights, device="cpu")

        ref[name] = _run(make, steps, resume)
    got = _sharded(tiny_path, scenarios, tmp_path)
    for name in scenarios:
        r, g = ref[name], got[name]
        assert r["grads"][0]["model.embed_tokens.weight"].abs().sum() > 0
        bf16 = name == "bf16"  # bf16 sums in another order (and FSDP reduces in fp32): bf16 rounding apart
        _close(g["metrics"], r["metrics"], f"{name}: metrics", 1e-2 if bf16 else 1e-4, 1e-3 if bf16 else 1e-6)
        _close(g["grads"], r["grads"], f"{name}: grads", 5e-2 if bf16 else 1e-4, 1e-3 if bf16 else 1e-6)
        chunked = "chunks" in name  # (its gradients to 1e-6 all the same)
        _close(g["weights"], r["weights"], f"{name}: weights", 0, 2e-2 if bf16 else 2e-5 if chunked else 1e-6)
        if not bf16:
            _close(g["optim"], r["optim"], f"{name}: optimiser", 1e-4, 1e-7 if chunked else 1e-9, scale=1e-5)
        if "critic" in r:  # sharded the same way: its weights and optimiser state are the unsharded ones
            _close(g["critic"], r["critic"], f"{name}: critic", 0, 1e-6)
            _close(g["critic_optim"], r["critic_optim"], f"{name}: critic optimiser", 1e-4, 1e-9, scale=1e-5)
            assert r["metrics"][1]["critic/loss"] > 0 and "kl_reward" in r["metrics"][1]
    mismatch = got["m2po, mismatch under the previous weights"]["metrics"][1]
    assert mismatch["logprob_mismatch_tokens"] > 0  # tokens one version old, checked under the kept weights


def test_trainer_device_cuda_without_a_gpu_is_an_input_error(tiny_path, tmp_path, capsys, monkeypatch):
    """As is trainer.fsdp=true outside torchrun, and several torchrun processes without it."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from relayrl.cli import main

    with pytest.raises(ValueError, match=r"trainer.device='cuda', but CUDA is not available"):
        _trainer(tiny_path, {}, {}, device="cuda")
    no_cuda = "relayrl: input error: trainer.device='cuda', but CUDA is not available here"
    no_torchrun = "relayrl: input error: trainer.fsdp=true needs a torchrun launch (torchrun --nproc-per-node N"
    no_cuda_engine = "relayrl: input error: rollout.device='cuda', but CUDA is not available here"
    for override, message in (("trainer.device=cuda", no_cuda), ("trainer.fsdp=true", no_torchrun),
                              ("rollout.device=cuda", no_cuda_engine)):
        capsys.readouterr()
        assert main(["train", f"model.path={tiny_path}", f"run.output_dir={tmp_path}", override]) == 2
        assert capsys.readouterr().err.startswith(message)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", f"model.path={tiny_path}", f"run.output_dir={tmp_path}"]) == 2
    assert "but trainer.fsdp=false: each would run the whole run" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # each failed before its run directory


E2E = ["data.eval_path=null", "reward.fn=tests.rewards_for_tests:digit_fraction", "rollout.max_new_tokens=8",
       "rollout.prompts_per_step=4", "rollout.group_size=4", "trainer.lr=2e-2", "trainer.warmup_steps=0",
       "trainer.micro_batch_tokens=64", "run.progress=false", "run.steps=2", "run.threads=1", "reward.workers=1",
       # (adaptive budgets with dynamic sampling are not bit-reproducible: when a group's second stage starts
       # changes which requests share a decode batch, and so the draws of the engine's one random stream)
       "rollout.budget=fixed", "rollout.dynamic_sampling=false"]


@pytest.mark.slow
@pytest.mark.parametrize("algo", [[], ["algo.advantage=gae"]], ids=["grpo", "gae-critic"])
def test_torchrun_fsdp_run_ends_with_the_single_process_checkpoint(tiny_path, tmp_path, algo):
    """``torchrun --nproc-per-node 2 -m relayrl.cli train ... trainer.fsdp=true`` on gloo: two
    steps, a checkpoint that loads, and the weights a single-process run of the same config ends
    with (sync mode is deterministic; the sharded step equals the unsharded one). With a critic, its
    weights (sharded as the policy's, gathered into the checkpoint) are the single process's too."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from relayrl.config import load_config
    from relayrl.run.loop import train

    args = E2E + algo + [f"model.path={tiny_path}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "relayrl.cli", "train", *args, f"run.output_dir={tmp_path / 'fsdp'}", "trainer.fsdp=true",
           "run.name=demo"]  # (named: left unnamed, the command line's overrides would name it)
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sharded = tmp_path / "fsdp" / "demo" / "checkpoints" / "step_000002"
    AutoModelForCausalLM.from_pretrained(sharded)
    assert torch.load(sharded / "trainer.pt", weights_only=False)["fsdp"]

    # (the sharded ranks forward plainly, trainer.share_prefix being off with fsdp: so does the single process)
    cfg = load_config(None, args + [f"run.output_dir={tmp_path / 'single'}", "trainer.share_prefix=false"])
    threads = torch.get_num_threads()
    try:
        train(cfg)
    finally:
        torch.set_num_threads(threads)  # (run.threads=1 would stay for the tests after this one)
    single = cfg.run_dir / "checkpoints" / "step_000002"
    a, b = load_file(sharded / "model.safetensors"), load_file(single / "model.safetensors")
    initial = load_file(Path(tiny_path) / "model.safetensors")
    assert a.keys() == b.keys()
    assert any(not torch.equal(a[k], initial[k]) for k in initial)  # it trained
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5), k
    if algo:
        ca, cb = (torch.load(d / "trainer.pt", weights_only=False)["critic"]["weights"] for d in (sharded, single))
        assert ca.keys() == cb.keys() and all(torch.allclose(ca[k], cb[k], atol=1e-5) for k in ca)
        assert not torch.equal(ca["head.weight"], load_value_model(tiny_path).head.weight)  # it trained


# -- on a GPU (skipped here) -----------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
def test_cuda_trainer_step_matches_the_cpu_step(tiny_path):
    """The trainer on CUDA: the batch moves per micro-batch, metrics and ``full_state_dict`` come
    back on the CPU, and the step is the CPU step's up to kernel rounding."""
    tok = load_tokenizer(tiny_path)
    batch = build_batch(_trajs(tok), torch.linspace(-1, 1, 8), tok.pad_token_id)
    out = {}
    for device in ("cpu", "cuda"):
        tr = _trainer(tiny_path, {"lr": 1e-2, "warmup_steps": 0, "micro_batch_tokens": 60}, {"kl_coef": 0.1},
                      device=device)
        assert next(tr.model.parameters()).device.type == device and next(tr.ref.parameters()).device.type == device
        torch.manual_seed(0)
        out[device] = (tr.step(batch), tr.full_state_dict())
    (m_cpu, w_cpu), (m_gpu, w_gpu) = out["cpu"], out["cuda"]
    assert all(v.device.type == "cpu" for v in w_gpu.values())
    for k in ("loss", "grad_norm", "kl", "entropy"):
        assert m_gpu[k] == pytest.approx(m_cpu[k], rel=1e-3, abs=1e-5), k
    for k in w_cpu:
        assert torch.allclose(w_gpu[k], w_cpu[k], atol=5e-4), k


@pytest.mark.gpu
@needs_cuda
def test_bf16_fsdp_step_on_gpus(tiny_path, tmp_path):
    """FSDP2 over NCCL (two GPUs where there are two, else one rank) with bf16 weights and fp32
    gradient reduction: the step is the unsharded bf16 CUDA step's, up to bf16 rounding."""
    tok = load_tokenizer(tiny_path)
    # (whole logits: the sharded steps are then bit for bit the unsharded ones, weights checked to 1e-6; the
    # chunked head sums its weight's gradient in another order, 3e-8 apart, which two Adam steps of lr 1e-2 grow
    # to a few 1e-6 in the weights: the last scenario)
    base = {"lr": 1e-2, "warmup_steps": 0, "micro_batch_tokens": 60, "logprob_chunk_tokens": 0}
    steps = [(build_batch(_trajs(tok, seed=1), torch.linspace(-1, 1, 8), tok.pad_token_id), None)]
    scenarios = {"bf16": (base, {}, "bfloat16", steps, 0)}
    ref = _run(lambda weights=None: _trainer(tiny_path, base, {}, "bfloat16", weights, device="cuda"), steps)
    got = _sharded(tiny_path, scenarios, tmp_path, world=min(2, torch.cuda.device_count()), device="cuda")["bf16"]
    assert all(v.dtype == torch.bfloat16 and v.device.type == "cpu" for v in got["weights"].values())
    _close(got["metrics"][0]["loss"], ref["metrics"][0]["loss"], "loss", 1e-2, 1e-3)
    before = {k: v.float() for k, v in load_policy(tiny_path, "bfloat16").state_dict().items()}
    moved = torch.cat([(got["weights"][k].float() - before[k]).flatten() for k in before])
    moved_ref = torch.cat([(ref["weights"][k].float() - before[k]).flatten() for k in before])
    assert torch.nn.functional.cosine_similarity(moved, moved_ref, dim=0) > 0.99


@pytest.mark.gpu
@needs_cuda
def test_cuda_critic_step_matches_the_cpu_step(tiny_path):
    """The critic on CUDA (``trainer.device=cuda``): values, GAE and its update, the CPU step's up to
    kernel rounding; its weights come back on the CPU."""
    from tests.test_critic import reward_batch

    batch = reward_batch(load_tokenizer(tiny_path))
    out = {}
    for device in ("cpu", "cuda"):
        tr = _trainer(tiny_path, {"lr": 1e-2, "warmup_steps": 0, "micro_batch_tokens": 60}, {"advantage": "gae"},
                      device=device)
        assert next(tr.critic.model.parameters()).device.type == device
        torch.manual_seed(0)
        out[device] = (tr.step(batch), tr.critic.full_state_dict())
    (m_cpu, w_cpu), (m_gpu, w_gpu) = out["cpu"], out["cuda"]
    assert all(v.device.type == "cpu" for v in w_gpu.values())
    for k in ("loss", "critic/loss", "critic/ev", "critic/grad_norm"):
        assert m_gpu[k] == pytest.approx(m_cpu[k], rel=1e-3, abs=1e-5), k
    for k in w_cpu:
        assert torch.allclose(w_gpu[k], w_cpu[k], atol=5e-4), k


@pytest.mark.gpu
@needs_cuda
def test_critic_fsdp_on_gpus(tiny_path, tmp_path):
    """The critic sharded over NCCL (two GPUs where there are two, else one rank), resumed between two
    steps: its weights and optimiser state are the unsharded CUDA critic's."""
    tok = load_tokenizer(tiny_path)
    # (whole logits: the sharded steps are then bit for bit the unsharded ones, weights checked to 1e-6; the
    # chunked head sums its weight's gradient in another order, 3e-8 apart, which two Adam steps of lr 1e-2 grow
    # to a few 1e-6 in the weights: the last scenario)
    base = {"lr": 1e-2, "warmup_steps": 0, "micro_batch_tokens": 60, "logprob_chunk_tokens": 0}
    steps = [(_with_rewards(tok, 1), None), (_with_rewards(tok, 2), None)]
    scenarios = {"critic": (base, {"advantage": "gae"}, "float32", steps, 1)}
    ref = _run(lambda weights=None: _trainer(tiny_path, base, {"advantage": "gae"}, "float32", weights, device="cuda"),
               steps, 1)
    got = _sharded(tiny_path, scenarios, tmp_path, world=min(2, torch.cuda.device_count()), device="cuda")["critic"]
    _close(got["critic"], ref["critic"], "critic", 1e-3, 1e-5)
    _close(got["critic_optim"], ref["critic_optim"], "critic optimiser", 1e-3, 1e-7)


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")  # (_capture_grads)
def test_two_gloo_ranks_give_the_unsharded_step_with_a_lora_adapter(tiny_path, tmp_path):
    """model.lora under trainer.fsdp: the adapter's gradient, its weights as published (PEFT's names, gathered on
    rank 0) and its optimiser state on two sharded ranks = one process's; the KL reference (the adapter off) and
    the mismatch check under the previous version's adapter run sharded too; resumed between the steps."""
    tok = load_tokenizer(tiny_path)
    stale = _stale_batch(tok, load_policy(tiny_path))
    later = _stale_batch(tok, load_policy(tiny_path))
    later.versions = torch.where(later.loss_mask.bool(), later.versions + 1, -1)
    base = {"lr": 1e-2, "warmup_steps": 0, "micro_batch_tokens": 60, "logprob_chunk_tokens": 0, "lora": 4}
    scenarios = {"lora r=4, KL, stale tokens, resumed": (base, {"kl_coef": 0.1}, "float32", [(stale, 1), (later, 2)],
                                                         1)}
    tkw, akw, dtype, steps, resume = scenarios["lora r=4, KL, stale tokens, resumed"]

    def make(weights=None):
        return _trainer(tiny_path, {**tkw, "share_prefix": False}, akw, dtype, weights, device="cpu")

    torch.manual_seed(0)
    r = _run(make, steps, resume)
    g = _sharded(tiny_path, scenarios, tmp_path)["lora r=4, KL, stale tokens, resumed"]
    assert r["grads"] and all("lora_" in k for k in r["grads"][0])
    assert set(r["weights"]) == set(g["weights"]) and all(".lora_A.weight" in k or ".lora_B.weight" in k
                                                          for k in g["weights"])
    assert r["metrics"][1]["kl"] > 0 and r["metrics"][1]["logprob_mismatch_tokens"] > 0
    _close(g["metrics"], r["metrics"], "metrics", 1e-4, 1e-6)
    _close(g["grads"], r["grads"], "grads", 1e-4, 1e-6)
    _close(g["weights"], r["weights"], "weights", 0, 1e-6)
    _close(g["optim"], r["optim"], "optimiser", 1e-4, 1e-9, scale=1e-5)


def test_two_gloo_ranks_give_the_unsharded_step_with_an_adapter_per_role(tiny_path, tmp_path):
    """model.lora.per_role under trainer.fsdp: each micro-batch runs under its role's adapter, so the two ranks' passes
    use different adapters (their reductions still match: every adapter's gradient reduced, zeros where unused), and
    a step whose rows are all one role's leaves the other adapter and its optimiser moments alone, as one process
    does (its gradient None, not zeros: Adam would move it by its momentum). Gradients, weights as published (every
    role's, "<role>::" names) and optimiser state = one process's."""
    tok = load_tokenizer(tiny_path)
    a = build_batch(_trajs(tok, seed=1), torch.linspace(-1, 1, 8), tok.pad_token_id)
    a.adapter = torch.tensor([0, 1, 1, 0, 0, 1, 0, 1])
    b = build_batch(_trajs(tok, seed=2), torch.linspace(1, -1, 8), tok.pad_token_id)
    b.adapter = torch.zeros(8, dtype=torch.long)  # (the second role idle)
    tkw = {"lr": 1e-2, "warmup_steps": 0, "micro_batch_tokens": 60, "logprob_chunk_tokens": 0, "lora": 4,
           "roles": ("proposer", "solver"), "updates_per_step": 2}
    scenarios = {"per role": (tkw, {}, "float32", [(a, None), (b, None)], 0)}

    def make(weights=None):
        return _trainer(tiny_path, {**tkw, "share_prefix": False}, {}, "float32", weights, device="cpu")

    torch.manual_seed(0)
    r = _run(make, scenarios["per role"][3])
    g = _sharded(tiny_path, scenarios, tmp_path)["per role"]
    assert {k.partition("::")[0] for k in g["weights"]} == {"proposer", "solver"}
    solver = [k for k in r["grads"][0] if ".solver." in k]
    assert solver and any(r["grads"][0][k].abs().sum() > 0 for k in solver)  # (both roles trained at step 1)
    assert not any(".solver." in k for k in [*r["grads"][-1], *g["grads"][-1]])  # (no gradient at step 2, either way)
    _close(g["metrics"], r["metrics"], "metrics", 1e-4, 1e-6)
    _close(g["grads"], r["grads"], "grads", 1e-4, 1e-6)
    _close(g["weights"], r["weights"], "weights", 0, 1e-6)
    _close(g["optim"], r["optim"], "optimiser", 1e-4, 1e-9, scale=1e-5)


@pytest.mark.slow
def test_torchrun_fsdp_run_with_an_adapter_per_role_ends_as_one_process(tmp_path):
    """The self-play example with an adapter per role, two steps under ``torchrun ... trainer.fsdp=true``: each role's
    checkpointed adapter (PEFT's files, adapters/<role>/) is the single process's."""
    from safetensors.torch import load_file

    from relayrl.config import load_config
    from relayrl.run.loop import train

    env_file = ROOT / "tests" / "test_role_adapters.py"
    args = [str(ROOT / "examples" / "self_play.yaml"), "model.path=builtin:agent-demo", "model.lora.r=8",
            f"env.name={env_file}:Exchange", "env.max_turns=1", "rollout.max_new_tokens=8", "model.lora.per_role=true",
            "rollout.prompts_per_step=2", "rollout.group_size=4", "eval.samples=1", "eval.size=4", "eval.every=0",
            "run.save_every=2", "run.steps=2", "algo.entropy_coef=0.01", "run.mode=sync", "run.threads=1",
            "run.name=sp"]  # (no prefix shared either way: two roles see one prompt through two adapters)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "relayrl.cli", "train", *args, f"run.output_dir={tmp_path / 'fsdp'}", "trainer.fsdp=true"]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    threads = torch.get_num_threads()
    try:
        train(load_config(args[0], [*args[1:], f"run.output_dir={tmp_path / 'single'}"]))
    finally:
        torch.set_num_threads(threads)
    for role in ("first", "second"):
        a, b = (load_file(tmp_path / d / "sp" / "checkpoints" / "step_000002" / "adapters" / role /
                          "adapter_model.safetensors") for d in ("fsdp", "single"))
        assert a.keys() == b.keys() and any(v.abs().sum() > 0 for k, v in a.items() if "lora_B" in k), role
        for k in a:
            assert torch.allclose(a[k], b[k], atol=1e-5), (role, k, (a[k] - b[k]).abs().max())


@pytest.mark.slow
def test_torchrun_fsdp_sft_with_epochs_ends_as_one_process(tiny_path, tmp_path):
    """``relayrl sft`` under ``torchrun ... trainer.fsdp=true`` with ``sft.epochs`` and a decaying schedule: the
    follower rank resolves the steps as rank 0 does (it built its schedule from the unresolved run.steps: rank 0
    decayed to 0 while rank 1 stayed near the peak), and the checkpoint equals a single process's."""
    import json as _json

    from safetensors.torch import load_file

    from relayrl.config import load_config
    from relayrl.config.commands import sft_defaults
    from relayrl.run.sft import sft

    data = tmp_path / "d.jsonl"
    data.write_text("".join(_json.dumps({"prompt": f"say {i}", "response": f"{i} {i}"}) + "\n" for i in range(12)))
    args = [f"model.path={tiny_path}", f"data.path={data}", "data.eval_path=null", "sft.epochs=1", "sft.batch_size=4",
            "trainer.schedule=linear", "trainer.warmup_steps=0", "trainer.lr=2e-2", "trainer.micro_batch_tokens=64",
            "run.progress=false", "run.threads=1", "run.name=sft"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "relayrl.cli",
           "sft", *args, f"run.output_dir={tmp_path / 'fsdp'}", "trainer.fsdp=true"]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sharded = tmp_path / "fsdp" / "sft" / "checkpoints" / "step_000003"  # ⌈1 epoch × 12 / 4⌉
    cfg = sft_defaults(load_config(None, args + [f"run.output_dir={tmp_path / 'single'}"]))
    threads = torch.get_num_threads()
    try:
        sft(cfg)
    finally:
        torch.set_num_threads(threads)
    a = load_file(sharded / "model.safetensors")
    b = load_file(cfg.run_dir / "checkpoints" / "step_000003" / "model.safetensors")
    initial = load_file(Path(tiny_path) / "model.safetensors")
    assert any(not torch.equal(a[k], initial[k]) for k in initial)  # it trained
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5), k
