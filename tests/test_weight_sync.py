"""Weight updates through a collective (engine.weight_sync): buckets planned and packed by hand-checked rules, a
gloo group between two processes that carries a state dict exactly, and an update that fails — never hangs —
when the receiving side dies or stalls."""

import multiprocessing as mp
import time

import pytest
import torch

from relayrl.engine.weight_sync import (
    MB,
    Channel,
    Meta,
    SyncError,
    metas,
    pack,
    plan_buckets,
    unpack,
)


def test_buckets_by_hand():
    ms = [Meta("a", "float32", (4,)), Meta("b", "bfloat16", (2, 3)), Meta("c", "int64", (1,)), Meta("d", "float32", (5,))]
    assert [m.nbytes for m in ms] == [16, 12, 8, 20]
    assert [m.span for m in ms] == [16, 16, 16, 32]  # (each starts at a multiple of 16 bytes)
    # 16 + 16 + 16 = 48 ≤ 48, + 32 > 48: a new bucket
    assert [[m.name for m in b] for b in plan_buckets(ms, 48)] == [["a", "b", "c"], ["d"]]
    assert [[m.name for m in b] for b in plan_buckets(ms, 32)] == [["a", "b"], ["c"], ["d"]]
    with pytest.raises(SyncError, match=r"cannot hold d \(0.0 MB, float32 \[5\]\): set rollout.sync_bucket_mb ≥ 1"):
        plan_buckets(ms, 31)
    assert plan_buckets([], 10) == []


def test_pack_and_unpack_carry_every_dtype_exactly():
    sd = {"w": torch.randn(3, 5, dtype=torch.bfloat16), "b": torch.randn(7), "i": torch.arange(4),
          "t": torch.randn(6, 4).t()}  # (not contiguous)
    plan = plan_buckets(metas(sd), MB)
    assert len(plan) == 1
    buffer = pack([sd[m.name] for m in plan[0]])
    assert buffer.dtype == torch.uint8 and buffer.numel() == sum(m.span for m in plan[0]) == 32 + 32 + 32 + 96
    got = dict(unpack(buffer, plan[0]))
    assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) and got[k].dtype == sd[k].dtype for k in sd)


def _receiver(address, plan, world, out, behaviour):
    ch = Channel.join(address, 1, world, timeout_s=20)
    if behaviour == "stall":  # joined, never receives
        time.sleep(30)
    got = {}
    for i, (name, t) in enumerate(ch.receive(plan)):
        got[name] = t.clone()
        if behaviour == "die" and i == 0:
            import os

            os._exit(3)
    out.put({k: v.tolist() for k, v in got.items()})


def _run(behaviour, timeout_s=20.0):
    sd = {f"layer{i}.weight": torch.randn(64, 64) * i for i in range(6)}
    plan = plan_buckets(metas(sd), 3 * 64 * 64 * 4)  # three tensors a bucket: two buckets
    ctx = mp.get_context("spawn")
    store = Channel.store(2, timeout_s)
    out = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=((store.host, store.port), plan, 2, out, behaviour))
    proc.start()
    try:
        sender = Channel.host(store, 2, timeout_s)
        t0 = time.monotonic()
        try:
            sender.send(sd, plan)
            return sd, out.get(timeout=60), time.monotonic() - t0
        finally:
            sender.close()
    finally:
        proc.kill()
        proc.join()


def test_a_state_dict_crosses_the_group_exactly():
    sd, got, _ = _run("receive")
    assert got.keys() == sd.keys() and all(torch.equal(torch.tensor(got[k]), sd[k]) for k in sd)


def test_a_receiver_that_dies_mid_update_fails_the_send_and_names_the_bucket():
    with pytest.raises(SyncError, match=r"weight sync: bucket 2/2 failed on rank 0 of 2 \("):
        _run("die")


def test_a_receiver_that_stalls_fails_the_send_at_its_deadline():
    t0 = time.monotonic()
    with pytest.raises(SyncError, match=r"weight sync: bucket 1/2 failed on rank 0 of 2 \("):
        _run("stall", timeout_s=3.0)
    assert time.monotonic() - t0 < 25  # (the deadline, with the receiver's start; never the 30 s it sleeps)
