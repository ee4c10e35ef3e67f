"""The checkpoint functions' directory argument: anything but a str or an os.PathLike of one is a
TypeError naming the argument (``path`` / ``directory``), an empty one a ValueError (it was the
current directory), on every rank before anything is written (``path=None`` once gave
os.fspath's TypeError, which names no argument)."""

from __future__ import annotations

import pytest
import torch

import lancet_rt
from tests.dist import assert_all_ok, run_ranks

D, E = 8, 4


def _model(ep_group=None):
    torch.manual_seed(0)
    return torch.nn.Sequential(lancet_rt.MoE(D, 6, E, 2, ep_group=ep_group))


CALLS = {"save_checkpoint": "path", "load_checkpoint": "path", "save_hf": "directory", "load_hf": "directory"}


@pytest.mark.parametrize("fn", sorted(CALLS))
@pytest.mark.parametrize("bad", [None, 3, b"x", ["dir"]], ids=["None", "int", "bytes", "list"])
def test_a_path_that_is_not_a_path_is_a_type_error_naming_it(tmp_path, monkeypatch, fn, bad):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TypeError, match=rf"^{CALLS[fn]} must be a directory path \(a str or os.PathLike\), got "):
        getattr(lancet_rt, fn)(_model(), bad)
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("fn", sorted(CALLS))
def test_an_empty_path_is_refused_not_the_current_directory(tmp_path, monkeypatch, fn):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=rf"^{CALLS[fn]} must not be empty"):
        getattr(lancet_rt, fn)(_model(), "")
    assert list(tmp_path.iterdir()) == []


def test_a_pathlike_still_works(tmp_path):
    model = _model()
    lancet_rt.save_checkpoint(model, tmp_path / "ckpt")
    lancet_rt.load_checkpoint(model, tmp_path / "ckpt")
    lancet_rt.save_hf(model, tmp_path / "hf")
    lancet_rt.load_hf(model, tmp_path / "hf")


def _one_rank_passes_none(rank, world, base):
    import torch.distributed as dist

    from tests.dist import outcome

    model = _model(dist.group.WORLD)
    path = None if rank == 1 else f"{base}/ckpt"
    return [
        outcome(lambda: lancet_rt.save_checkpoint(model, path)),
        outcome(lambda: lancet_rt.save_hf(model, None if rank == 1 else f"{base}/hf")),
    ]


def test_a_rank_passing_none_is_refused_on_every_rank(tmp_path):
    results = assert_all_ok(run_ranks(_one_rank_passes_none, 2, str(tmp_path), timeout=200))
    for r, out in enumerate(results):
        for (kind, msg, _), name in zip(out, ("path", "directory")):
            assert kind == "TypeError" and msg.startswith(f"rank 1: {name} must be a directory path"), (r, kind, msg)
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "hf").exists()
