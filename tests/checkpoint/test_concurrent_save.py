"""Two jobs saving to one path at once (two real processes, a checkpoint already there): they shared one
staging directory with no lock, so one reported "saved" with no ``.metadata`` in the directory, or both
did and the directory was empty, the previous checkpoint destroyed. Now rank 0 holds an exclusive lock
beside the target for the whole save: the second save is refused at once with a CheckpointError saying
another save to that path is in progress, and after every round the target is a complete checkpoint
that loads as one of the two writers' models (many rounds, bounded by a barrier timeout)."""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch

import lancet_rt
from lancet_rt.checkpoint._common import CheckpointError

ROUNDS = 12
FORMATS = {"dcp": (lancet_rt.save_checkpoint, lancet_rt.load_checkpoint), "hf": (lancet_rt.save_hf, lancet_rt.load_hf)}


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(lancet_rt.MoE(16, 12, 4, 2), torch.nn.LayerNorm(16))


def _writer(fmt, path, seed, barrier, results):
    torch.set_num_threads(1)
    save = FORMATS[fmt][0]
    model = _model(seed)
    for _ in range(ROUNDS):
        barrier.wait(timeout=300)  # both start the round together
        try:
            save(model, path)
            results.put((seed, "saved", ""))
        except CheckpointError as exc:
            results.put((seed, "refused", str(exc)))
        except BaseException as exc:  # any other outcome fails the test, reported
            results.put((seed, type(exc).__name__, str(exc)))
        barrier.wait(timeout=300)  # the test checks the target before the next round


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_two_processes_saving_to_one_path_never_lose_the_checkpoint(tmp_path, fmt):
    save, load = FORMATS[fmt]
    path = str(tmp_path / "ckpt")
    save(_model(0), path)
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(fmt, path, seed, barrier, results)) for seed in (1, 2)]
    for p in procs:
        p.start()
    expected = {seed: _model(seed).state_dict() for seed in (0, 1, 2)}
    finished = False
    try:
        for round_ in range(ROUNDS):
            barrier.wait(timeout=300)
            barrier.wait(timeout=300)
            outcomes = sorted(results.get(timeout=60) for _ in range(2))
            for seed, kind, msg in outcomes:
                assert kind == "saved" or (
                    kind == "refused" and "another save to" in msg and "is in progress" in msg
                ), (round_, seed, kind, msg)
            assert any(kind == "saved" for _, kind, _ in outcomes), (round_, outcomes)
            fresh = _model(9)
            load(fresh, path)  # a complete checkpoint, every round
            got = fresh.state_dict()
            match = [s for s, sd in expected.items() if all(torch.equal(got[k], v) for k, v in sd.items())]
            savers = [seed for seed, kind, _ in outcomes if kind == "saved"]
            assert match and match[0] in savers, (round_, match, outcomes)
            assert sorted(os.listdir(tmp_path)) == ["ckpt"], (round_, os.listdir(tmp_path))
        finished = True
    finally:
        # A failed round releases the writers at once; after a passed last round an abort would break the
        # wait of a writer not yet woken from the round's barrier (its BrokenBarrierError, exit code 1).
        if not finished:
            barrier.abort()
        for p in procs:
            p.join(timeout=120)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
