"""Adversarial cases, part A: data loss, crashes and hangs, silent mismatches (README,
"Reliability", second table). Each asserts that the last good checkpoint and the model in memory
survive, or that every rank raises a named error (type, the rank, the file or the option) instead of
dying in the backend, hanging, or going on with mismatched state.

Checkpoint faults run in one process where one suffices; the distributed cases run on 2 real gloo
ranks, many per spawn, each fault that breaks a group on a group of its own, under a hard timeout
(a hang fails). The kill test SIGKILLs a rank in the middle of ``save_checkpoint``.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

import lancet_rt
from lancet_rt.checkpoint import _atomic
from lancet_rt.checkpoint._common import CheckpointError
from lancet_rt.checkpoint.dcp import load_checkpoint, save_checkpoint
from lancet_rt.checkpoint.hf import load_hf, save_hf
from tests.dist import assert_raised, outcome, run_ranks

D, F, E = 8, 6, 4


def _model(ep_group=None, seed=0, **moe):
    from lancet_rt.models.blocks import MoEBlocks

    torch.manual_seed(seed)
    return MoEBlocks(2, D, 2, dict(d_ffn=F, num_experts=E, top_k=2, ep_group=ep_group, **moe))


def _snapshot(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _perturb(model) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))


def _distcp(path) -> list:
    return sorted(f for f in os.listdir(path) if f.endswith(".distcp"))


# ====================================================================================== data loss, one process
@pytest.fixture
def saved(tmp_path):
    """A model saved at ``tmp_path/ckpt``, then changed in memory: (model, path, what was saved)."""
    model = _model()
    path = tmp_path / "ckpt"
    save_checkpoint(model, path)
    old = _snapshot(model)
    _perturb(model)
    return model, path, old


def _loads_as(path, expected: dict) -> bool:
    fresh = _model(seed=1)
    load_checkpoint(fresh, path)
    return _same(_snapshot(fresh), expected)


def test_save_interrupted_over_a_checkpoint_keeps_the_last_good_one(saved, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    model, path, old = saved
    real = FileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        real(self, plan, planner).wait()  # the new data is on disk, the new .metadata not yet
        raise KeyboardInterrupt

    monkeypatch.setattr(FileSystemWriter, "write_data", write_then_die)
    with pytest.raises(CheckpointError, match="KeyboardInterrupt"):  # DCP gathers it into one error
        save_checkpoint(model, path)
    monkeypatch.undo()
    assert _loads_as(path, old)
    save_checkpoint(model, path)  # the next save clears the leftover staging directory and succeeds
    assert _loads_as(path, _snapshot(model)) and not os.path.exists(_atomic.staging(str(path)))


def test_the_staging_directory_of_an_unfinished_save_is_refused(saved, monkeypatch):
    model, path, old = saved
    monkeypatch.setattr(_atomic, "commit", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(model, path)  # everything written, killed before the swap
    monkeypatch.undo()
    before = _snapshot(model)
    with pytest.raises(ValueError, match="did not finish"):
        load_checkpoint(model, _atomic.staging(str(path)))
    assert _same(_snapshot(model), before) and _loads_as(path, old)


def test_save_killed_between_the_two_fallback_renames_loads_the_previous(saved, monkeypatch):
    model, path, old = saved
    monkeypatch.setattr(_atomic, "_exchange", lambda a, b: False)  # a file system without renameat2
    real = os.rename

    def die_on_second(src, dst):
        if src == _atomic.staging(str(path)):
            raise KeyboardInterrupt  # killed with the old checkpoint moved aside, the new one not yet in place
        real(src, dst)

    monkeypatch.setattr(os, "rename", die_on_second)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(model, path)
    monkeypatch.undo()
    assert not path.exists()
    with pytest.warns(UserWarning, match="previous complete checkpoint"):
        assert _loads_as(path, old)
    save_checkpoint(model, path)  # puts the previous back first, then swaps the new one in
    assert _loads_as(path, _snapshot(model))


def test_save_over_a_directory_keeps_files_the_save_does_not_write(saved):
    model, path, _ = saved
    (path / "notes.txt").write_text("mine")
    save_checkpoint(model, path)
    assert (path / "notes.txt").read_text() == "mine" and _loads_as(path, _snapshot(model))


def test_save_to_a_path_that_is_a_file_raises_before_writing(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        save_checkpoint(_model(), target)
    assert target.read_text() == "x"


@pytest.mark.parametrize("damage", ["truncated", "corrupted", "missing"])
def test_damaged_distcp_raises_a_named_error_and_changes_nothing(saved, damage):
    model, path, _ = saved
    before = _snapshot(model)
    name = _distcp(path)[0]
    file = path / name
    data = file.read_bytes()
    if damage == "truncated":
        file.write_bytes(data[: len(data) // 2])
    elif damage == "corrupted":  # same size, the bytes after DCP's header scrambled
        file.write_bytes(data[:64] + bytes(b ^ 0x5A for b in data[64:]))
    else:
        file.unlink()
    with pytest.raises(ValueError) as info:  # an Exception (DCP's own CheckpointException is a BaseException)
        load_checkpoint(model, path)
    msg = str(info.value)
    assert name in msg and ("truncated" in msg if damage == "truncated" else True), msg
    if damage == "corrupted":
        assert "key model." in msg and "rank 0" in msg, msg
    assert _same(_snapshot(model), before)


def test_damaged_checkpoint_leaves_the_optimizer_state_unchanged(tmp_path):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(2, 3, D)).sum().backward()
    opt.step()
    save_checkpoint(model, tmp_path / "c", opt)
    _perturb(model)
    before = {k: v.clone() for s in opt.state.values() for k, v in s.items() if torch.is_tensor(v)}
    file = tmp_path / "c" / _distcp(tmp_path / "c")[0]
    data = file.read_bytes()
    file.write_bytes(data[:64] + bytes(b ^ 0x5A for b in data[64:]))
    params = _snapshot(model)
    with pytest.raises(ValueError):
        load_checkpoint(model, tmp_path / "c", opt)
    after = {k: v for s in opt.state.values() for k, v in s.items() if torch.is_tensor(v)}
    assert _same(_snapshot(model), params) and all(torch.equal(before[k], after[k]) for k in before)


def _hf_file(path):
    return sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[0]


@pytest.mark.parametrize("damage", ["truncated", "corrupted"])
def test_damaged_safetensors_raises_a_named_error_and_changes_nothing(tmp_path, damage):
    model = _model()
    save_hf(model, tmp_path / "hf")
    _perturb(model)
    before = _snapshot(model)
    name = _hf_file(tmp_path / "hf")
    file = tmp_path / "hf" / name
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 16] if damage == "truncated" else b"\xff" * 8 + data[8:])
    with pytest.raises(ValueError, match=name):
        load_hf(model, tmp_path / "hf")
    assert _same(_snapshot(model), before)


def test_save_hf_interrupted_keeps_the_last_good_one_and_other_files(tmp_path, monkeypatch):
    import safetensors.torch

    model = _model()
    save_hf(model, tmp_path / "hf")
    old = _snapshot(model)
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    _perturb(model)
    monkeypatch.setattr(safetensors.torch, "save_file", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(RuntimeError, match="disk full"):
        save_hf(model, tmp_path / "hf")
    monkeypatch.undo()
    fresh = _model(seed=1)
    load_hf(fresh, tmp_path / "hf")
    assert _same(_snapshot(fresh), old)
    save_hf(model, tmp_path / "hf")
    load_hf(fresh, tmp_path / "hf")
    assert _same(_snapshot(fresh), _snapshot(model)) and (tmp_path / "hf" / "tokenizer.json").exists()


# ====================================================================================== two ranks
def _new_group(timeout_s=None, split=False):
    """A new process group; ``split``: its TorchGroup (``as_group``) a split one (TorchGroup.split)."""
    import torch.distributed as dist

    g = dist.new_group()
    if split:
        lancet_rt.TorchGroup.split(g)
    if timeout_s is not None:
        lancet_rt.comm.group.as_group(g).set_timeout(timeout_s)
    return g


def _until_given_up(group, ranks):
    """Stop answering until ``ranks`` wrote their failure records (bounded: 60 s)."""
    import time

    import torch.distributed as dist

    store = dist.distributed_c10d._get_process_group_store(group)
    deadline = time.monotonic() + 60
    while not store.check([f"lancet_rt/fail/{r}" for r in ranks]) and time.monotonic() < deadline:
        time.sleep(0.05)


def _collective_cases(rank, world, root, split=False):
    """The crash, hang and mismatch cases in sequence; returns {case: outcome on this rank}. ``split``:
    every group's TorchGroup a split one (its checks on a thread of its own must detect the same); else every
    group as it is (``LANCET_EP_TRANSPORT=plain``: not the default split at the first collective)."""
    import functools
    import os

    if not split:
        os.environ[lancet_rt.env.EP_TRANSPORT] = "plain"

    _new_group_ = functools.partial(_new_group, split=split)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(rank)
    x, gy = torch.randn(2, 3, D, generator=gen), torch.randn(2, 3, D, generator=gen)
    res = {}

    def skipped_backward():
        m = _model(_new_group_())
        y = m(x)
        if rank == 0:
            y.backward(gy)
        m(x)

    res["a rank skips a backward"] = outcome(skipped_backward)

    def extra_forward():
        g = _new_group_()
        m = _model(g, expert_bias=True)
        m(x)
        if rank == 0:
            lancet_rt.update_expert_bias(m, group=g)
        m(x)

    res["a rank runs an extra forward"] = outcome(extra_forward)

    def other_sizes():
        tg = lancet_rt.comm.group.as_group(_new_group_())
        splits = [2, 2] if rank == 0 else [3, 2]
        out = torch.empty(4, D)
        tg.all_to_all(out, torch.randn(sum(splits), D), [2, 2], splits).wait()

    res["all-to-all sizes differ"] = outcome(other_sizes)

    g = _new_group_(timeout_s=2.0)
    m = _model(g, expert_bias=True)
    m(x)
    if rank == 1:
        _until_given_up(g, [0])
        res["update_expert_bias, a peer absent"] = ["absent", None, None]
    else:
        res["update_expert_bias, a peer absent"] = outcome(lambda: lancet_rt.update_expert_bias(m, group=g))

    g = _new_group_(timeout_s=2.0)
    path = os.path.join(root, "absent")
    if rank == 1:
        _until_given_up(g, [0])
        res["checkpoint agreement, a peer absent"] = ["absent", None, None]
    else:
        res["checkpoint agreement, a peer absent"] = outcome(lambda: save_checkpoint(_model(), path, process_group=g))
        res["nothing written"] = ["ok", not os.path.exists(os.path.join(path, ".metadata")), None]

    healthy = _new_group_()

    def one_layer(**kw):
        torch.manual_seed(0)
        layer = lancet_rt.MoE(D, F, E, 2, ep_group=healthy, **kw)
        return layer(torch.randn(5, D, dtype=kw.get("dtype", torch.float32)))

    res["router_bias differs"] = outcome(lambda: one_layer(router_bias=rank == 1))
    res["routed_scaling_factor differs by 1 ulp"] = outcome(
        lambda: one_layer(routed_scaling_factor=1.0 + (2**-52 if rank == 1 else 0))
    )
    res["capacity_factor differs by 1e-9"] = outcome(lambda: one_layer(capacity_factor=0.75 + rank * 1e-9))
    res["dtype differs"] = outcome(lambda: one_layer(dtype=torch.float64 if rank == 1 else torch.float32))
    res["shared expert shapes differ"] = outcome(
        lambda: one_layer(shared_experts=torch.nn.Linear(D, D, bias=rank == 0))
    )
    res["same configuration still runs"] = outcome(lambda: list(one_layer(router_bias=True).shape))
    return res


@pytest.fixture(scope="module", params=["plain", "split"])
def collective_cases(tmp_path_factory, request):
    root = tmp_path_factory.mktemp("collectives")
    results = run_ranks(_collective_cases, 2, str(root), request.param == "split", timeout=180)
    for r in (0, 1):
        assert results[r][0] == "ok", results[r][1]
    return [results[r][1] for r in (0, 1)]


def test_a_skipped_backward_raises_collective_mismatch_on_every_rank(collective_cases):
    for res in collective_cases:  # (gloo would abort the process: "Received data size doesn't match")
        assert_raised(
            res["a rank skips a backward"],
            "CollectiveMismatch",
            "does not match across expert-parallel ranks",
            "counts exchange",
            "all-to-all",
            "nothing was sent",
            ranks=[0, 1],
        )


def test_an_extra_forward_against_update_expert_bias_raises_on_every_rank(collective_cases):
    for res in collective_cases:
        assert_raised(
            res["a rank runs an extra forward"], "CollectiveMismatch", "expert-bias all-reduce", "counts exchange"
        )


def test_mismatched_all_to_all_sizes_are_named_before_the_backend(collective_cases):
    for res in collective_cases:
        assert_raised(
            res["all-to-all sizes differ"],
            "CollectiveMismatch",
            f"rank 1 sends {3 * D} elements to rank 0, which expects {2 * D}",
        )


def test_update_expert_bias_is_bounded_and_names_the_absent_rank(collective_cases):
    assert_raised(
        collective_cases[0]["update_expert_bias, a peer absent"],
        "PeerTimeout",
        "expert-bias all-reduce",
        "timeout 2 s",
        "rank 1",
        ranks=[1],
    )


def test_checkpoint_agreement_is_bounded_and_names_the_absent_rank(collective_cases):
    assert_raised(
        collective_cases[0]["checkpoint agreement, a peer absent"],
        "PeerTimeout",
        "checkpoint agreement",
        "timeout 2 s",
        "rank 1",
        ranks=[1],
    )
    assert collective_cases[0]["nothing written"][1] is True


@pytest.mark.parametrize(
    "case, field",
    [
        ("router_bias differs", "router_bias"),
        ("routed_scaling_factor differs by 1 ulp", "routed_scaling_factor"),
        ("capacity_factor differs by 1e-9", "capacity_factor"),
        ("dtype differs", "dtype"),
        ("shared expert shapes differ", "parameters and buffers"),
    ],
)
def test_every_layer_option_is_in_the_cross_rank_check(collective_cases, case, field):
    for r, res in enumerate(collective_cases):
        assert_raised(res[case], "ValueError", "MoE configuration differs", field, f"rank {r}")


def test_the_group_stays_usable_after_a_configuration_mismatch(collective_cases):
    for res in collective_cases:
        assert res["same configuration still runs"] == ["ok", [5, D], None]


def _checkpoint_cases(rank, world, root):
    import torch.distributed as dist

    torch.set_num_threads(1)
    res = {}
    mine = os.path.join(root, f"rank{rank}")
    res["different paths"] = outcome(lambda: save_checkpoint(_model(), mine))
    res["nothing written"] = ["ok", not os.path.exists(mine), None]

    res["different directories for save_hf"] = outcome(lambda: save_hf(_model(), mine + "_hf"))
    res["nothing written by save_hf"] = ["ok", not os.path.exists(mine + "_hf"), None]
    os.makedirs(os.path.join(root, f"cwd{rank}"), exist_ok=True)
    cwd = os.getcwd()
    os.chdir(os.path.join(root, f"cwd{rank}"))  # the same relative path names two directories
    res["same relative path, different cwd"] = outcome(lambda: save_checkpoint(_model(), "rel"))
    os.chdir(cwd)

    model = _model(dist.group.WORLD)
    path = os.path.join(root, "ep2")
    save_checkpoint(model, path)
    _perturb(model)
    before = _snapshot(model)
    if rank == 1:  # damage the file this rank wrote (its experts)
        file = os.path.join(path, "__1_0.distcp")
        data = open(file, "rb").read()
        open(file, "wb").write(data[:64] + bytes(b ^ 0x5A for b in data[64:]))
    dist.barrier()
    res["a path missing on one rank"] = outcome(lambda: load_checkpoint(model, path if rank == 0 else path + "x"))
    res["model unchanged after it"] = ["ok", _same(_snapshot(model), before), None]
    res["one rank's file corrupted"] = outcome(lambda: load_checkpoint(model, path))
    res["model unchanged"] = ["ok", _same(_snapshot(model), before), None]
    return res


@pytest.fixture(scope="module")
def checkpoint_cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt2")
    results = run_ranks(_checkpoint_cases, 2, str(root), timeout=180)
    for r in (0, 1):
        assert results[r][0] == "ok", results[r][1]
    return [results[r][1] for r in (0, 1)]


def test_ranks_passing_different_paths_raise_before_writing(checkpoint_cases):
    for res in checkpoint_cases:
        assert_raised(
            res["different paths"], "ValueError", "path: the ranks passed different values", "rank0'", "rank1'"
        )
        assert res["nothing written"][1] is True


def test_save_hf_with_different_directories_raises_before_writing(checkpoint_cases):
    for res in checkpoint_cases:
        assert_raised(
            res["different directories for save_hf"], "ValueError", "directory: the ranks passed different values"
        )
        assert res["nothing written by save_hf"][1] is True


def test_a_relative_path_naming_two_directories_is_caught(checkpoint_cases):
    for res in checkpoint_cases:
        assert_raised(res["same relative path, different cwd"], "ValueError", "cwd0", "cwd1")


def test_a_checkpoint_missing_on_one_rank_raises_on_every_rank_and_changes_nothing(checkpoint_cases):
    for res in checkpoint_cases:
        assert_raised(res["a path missing on one rank"], "ValueError", "rank 1", "no readable")
        assert res["model unchanged after it"][1] is True


def test_a_corrupted_file_of_one_rank_changes_no_rank(checkpoint_cases):
    for res in checkpoint_cases:
        assert_raised(res["one rank's file corrupted"], "ValueError", "__1_0.distcp", "rank 1")
        assert res["model unchanged"][1] is True


def _killed_in_save(rank, world, root, victim):
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    torch.set_num_threads(1)
    model = _model(dist.group.WORLD)
    path, ref = os.path.join(root, "ckpt"), os.path.join(root, "ref")
    save_checkpoint(model, path)
    save_checkpoint(model, ref)  # the same state, to compare with after the kill
    _perturb(model)
    if rank == victim:
        real = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            real(self, plan, planner).wait()  # this rank's new data is on disk
            os.kill(os.getpid(), signal.SIGKILL)

        FileSystemWriter.write_data = write_then_die
    out = outcome(lambda: save_checkpoint(model, path))
    with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    return out


@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_killed_during_save_leaves_the_previous_checkpoint(tmp_path, victim):
    results = run_ranks(_killed_in_save, 2, str(tmp_path), victim, timeout=180, may_die=(victim,))
    survivor = 1 - victim
    assert victim not in results, f"rank {victim} killed itself"
    assert results[survivor][0] == "ok"
    assert_raised(results[survivor][1], "PeerError", f"rank {victim}", "its process has exited", ranks=[victim])
    got, want = _model(seed=1), _model(seed=2)
    load_checkpoint(got, tmp_path / "ckpt")
    load_checkpoint(want, tmp_path / "ref")
    assert _same(_snapshot(got), _snapshot(want))
