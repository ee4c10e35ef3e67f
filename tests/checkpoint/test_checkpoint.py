"""Checkpoints across expert-parallel sizes: saved at EP=2, loaded at EP=1 and EP=4, same logits.

One gloo run of 4 processes does every distributed check: ranks 0 and 1 form an EP=2 group, train
one step and save (DCP with the optimizer, and the Hugging Face layout), for a model of lancet
blocks and for a transformers Mixtral under ``lancet_rt.from_hf``; then all four load at EP=4 (also
the directory transformers' own ``save_pretrained`` wrote), and try checkpoints that do not fit. The
EP=1 loads, and ``AutoModelForCausalLM.from_pretrained`` of what EP=2 wrote, run in this process.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tests.dist import assert_all_ok, run_ranks
from tests.helpers import assert_close

D, HEADS, F, E = 8, 2, 6, 4
EXPERT_KEY = "blocks.0.moe.experts.gate_up_proj"


def _blocks(ep_group=None, *, num_experts=E, seed=0):
    """Two attention + MoE blocks made from ``seed`` on every rank; with ``ep_group`` each rank keeps its experts."""
    import torch.distributed as dist

    from lancet_rt.models.blocks import MoEBlocks

    kw = dict(d_ffn=F, num_experts=num_experts, top_k=2)
    torch.manual_seed(seed)
    full = MoEBlocks(2, D, HEADS, kw)
    if ep_group is None:
        return full
    model = MoEBlocks(2, D, HEADS, dict(kw, ep_group=ep_group))
    L = num_experts // dist.get_world_size(ep_group)
    r = dist.get_rank(ep_group)
    weights = full.state_dict()
    with torch.no_grad():
        for k, v in model.state_dict().items():
            v.copy_(weights[k][r * L : (r + 1) * L] if ".experts." in k else weights[k])
    return model


def _logits(model) -> np.ndarray:
    x = torch.randn(3, 5, D, generator=torch.Generator().manual_seed(7))  # the same rows on every rank
    with torch.no_grad():
        return model(x).numpy()


def _train_one_step(model, group, rank):
    import lancet_rt.parallel

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(100 + rank))
    model(x).square().mean().backward()
    lancet_rt.parallel.sync_gradients(model, group)
    opt.step()
    return opt


def _error(fn) -> str:
    try:
        fn()
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


class _RecordingFile:
    """A safetensors file handle recording what is read: (key, None) whole, (key, (start, stop)) rows."""

    def __init__(self, f, reads):
        self.f, self.reads = f, reads

    def get_tensor(self, key):
        self.reads.append((key, None))
        return self.f.get_tensor(key)

    def get_slice(self, key):
        return _RecordingSlice(key, self.f.get_slice(key), self.reads)


class _RecordingSlice:
    def __init__(self, key, inner, reads):
        self.key, self.inner, self.reads = key, inner, reads

    def get_shape(self):
        return self.inner.get_shape()

    def __getitem__(self, rows):
        self.reads.append((self.key, (rows.start, rows.stop)))
        return self.inner[rows]


def _mixtral(ep_group=None, seed=0):
    import lancet_rt
    from lancet_rt.models.hf_models import build

    return lancet_rt.from_hf(build("mixtral", seed=seed), ep_group)  # 8 experts


def _lm_logits(model) -> np.ndarray:
    from lancet_rt.models.hf_models import batch

    ids, mask, _ = batch(model.config.vocab_size, 2, 6, seed=3)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits.numpy()


def _recording_reads(fn) -> list:
    """Run ``fn`` with load_hf's files recording what it reads; returns [(key, rows or None)]."""
    from lancet_rt.checkpoint import hf as ep_checkpoint_hf

    reads, original = [], ep_checkpoint_hf._Headers.file
    ep_checkpoint_hf._Headers.file = lambda self, key: _RecordingFile(original(self, key), reads)
    try:
        fn()
    finally:
        ep_checkpoint_hf._Headers.file = original
    return reads


def _mixtral_across_ep_sizes(rank, root, ep2, out):
    import torch.distributed as dist

    import lancet_rt.parallel
    from lancet_rt import load_checkpoint, load_hf, save_checkpoint, save_hf
    from lancet_rt.models.hf_models import batch, build

    if rank < 2:
        model = _mixtral(ep2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids, mask, labels = batch(model.config.vocab_size, 3, 7, seed=20 + rank)
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        lancet_rt.parallel.sync_gradients(model, ep2)
        opt.step()
        save_checkpoint(model, f"{root}/mixtral_dcp", opt, process_group=ep2)
        save_hf(model, f"{root}/mixtral_hf", max_shard_bytes=40_000, process_group=ep2)
        out["mixtral_ep2"] = _lm_logits(model)
        # Another conversion (per-expert gate_proj/up_proj/down_proj) and a shared expert, untrained.
        qwen = lancet_rt.from_hf(build("qwen2_moe"), ep2)
        save_hf(qwen, f"{root}/qwen2_moe_hf", process_group=ep2)
        out["qwen2_moe_ep2"] = _lm_logits(qwen)
    dist.barrier()
    model = _mixtral(dist.group.WORLD, seed=1)
    load_checkpoint(model, f"{root}/mixtral_dcp", torch.optim.AdamW(model.parameters()))
    out["mixtral_ep4_dcp"] = _lm_logits(model)
    model = _mixtral(dist.group.WORLD, seed=2)
    out["mixtral_hf_reads"] = _recording_reads(lambda: load_hf(model, f"{root}/mixtral_hf"))
    out["mixtral_ep4_hf"] = _lm_logits(model)
    model = _mixtral(dist.group.WORLD, seed=3)
    load_hf(model, f"{root}/transformers_saved")
    out["transformers_saved_ep4"] = _lm_logits(model)


def _across_ep_sizes(rank, world, root):
    import torch.distributed as dist

    from lancet_rt import load_checkpoint, load_hf, save_checkpoint, save_hf

    out = {}
    ep2 = dist.new_group([0, 1])  # every rank takes part in creating each group
    replica_ep2 = dist.new_group([2, 3])
    if rank < 2:
        model = _blocks(ep2)
        opt = _train_one_step(model, ep2, rank)
        # Ranks disagreeing on what they save (one passes the optimizer): both raise, nothing written.
        out["disagree"] = _error(
            lambda: save_checkpoint(model, f"{root}/bad", opt if rank else None, process_group=ep2)
        )
        out["bad_written"] = os.path.exists(f"{root}/bad/.metadata")
        save_checkpoint(model, f"{root}/dcp", opt, process_group=ep2)
        save_hf(model, f"{root}/hf", max_shard_bytes=1500, process_group=ep2)  # several files per rank
        out["ep2"] = _logits(model)
        out["ep2_exp_avg"] = opt.state[model.blocks[0].moe.experts.gate_up_proj]["exp_avg"].numpy()
    dist.barrier()

    world_group = dist.group.WORLD
    model = _blocks(world_group, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    load_checkpoint(model, f"{root}/dcp", opt)
    out["ep4_dcp"] = _logits(model)
    out["ep4_exp_avg"] = opt.state[model.blocks[0].moe.experts.gate_up_proj]["exp_avg"].numpy()
    out["ep4_lr_step"] = (opt.param_groups[0]["lr"], float(opt.state[model.blocks[0].moe.experts.gate_up_proj]["step"]))

    model = _blocks(world_group, seed=2)
    out["hf_reads"] = _recording_reads(lambda: load_hf(model, f"{root}/hf"))
    out["ep4_hf"] = _logits(model)

    # A checkpoint that does not fit (E=4 saved, E=8 here): every rank raises before reading anything.
    wrong = _blocks(world_group, num_experts=8, seed=3)
    before = {k: v.clone() for k, v in wrong.state_dict().items()}
    out["wrong_E_dcp"] = _error(lambda: load_checkpoint(wrong, f"{root}/dcp"))
    out["wrong_E_hf"] = _error(lambda: load_hf(wrong, f"{root}/hf"))
    out["wrong_untouched"] = all(torch.equal(v, before[k]) for k, v in wrong.state_dict().items())
    if rank < 2:  # a saving group that does not hold the model's EP group
        out["group_too_small"] = _error(lambda: save_checkpoint(model, f"{root}/never", process_group=ep2))
    # One rank's bad path: every rank raises, the others naming that rank.
    out["one_bad_path"] = _error(
        lambda: load_checkpoint(_blocks(world_group), f"{root}/dcp" if rank != 3 else f"{root}/nowhere")
    )
    # Data parallel replicas saving together over the world: of EP=2 (ranks 0-1 and 2-3), and of the
    # unsharded model on every rank. One copy of each tensor is written.
    replicated = _blocks(ep2 if rank < 2 else replica_ep2, seed=10)
    save_checkpoint(replicated, f"{root}/dp_ep2_dcp")
    save_hf(replicated, f"{root}/dp_ep2_hf", max_shard_bytes=1500)
    save_hf(_blocks(seed=11), f"{root}/dp_hf", max_shard_bytes=1500)
    _mixtral_across_ep_sizes(rank, root, ep2, out)
    return out


@pytest.fixture(scope="module")
def across(tmp_path_factory):
    """The 4-rank run's results per rank; first, transformers saves an unsharded Mixtral for it to load."""
    root = tmp_path_factory.mktemp("ckpt")
    reference = _mixtral(seed=6)
    reference.save_pretrained(root / "transformers_saved")  # transformers' own layout: per-expert keys
    root_out = assert_all_ok(run_ranks(_across_ep_sizes, 4, str(root), timeout=240))
    return root, root_out, _lm_logits(reference)


def test_dcp_saved_at_ep2_loads_at_ep4(across):
    _, out, _ = across
    ep2 = torch.from_numpy(out[0]["ep2"])
    assert_close("EP=2 logits, ranks 0 and 1", torch.from_numpy(out[1]["ep2"]), ep2)
    full_exp_avg = torch.from_numpy(np.concatenate([out[0]["ep2_exp_avg"], out[1]["ep2_exp_avg"]]))
    for r in range(4):
        assert_close(f"EP=4 rank {r} logits (DCP)", torch.from_numpy(out[r]["ep4_dcp"]), ep2)
        # The optimizer: rank r holds expert r's Adam moment, the saved step and learning rate.
        assert torch.equal(torch.from_numpy(out[r]["ep4_exp_avg"]), full_exp_avg[r : r + 1])
        assert out[r]["ep4_lr_step"] == (1e-2, 1.0)


def test_dcp_saved_at_ep2_loads_at_ep1_in_one_process(across):
    from lancet_rt import load_checkpoint

    root, out, _ = across
    model = _blocks(seed=4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    load_checkpoint(model, root / "dcp", opt)
    assert_close("EP=1 logits (DCP)", torch.from_numpy(_logits(model)), torch.from_numpy(out[0]["ep2"]))
    full_exp_avg = np.concatenate([out[0]["ep2_exp_avg"], out[1]["ep2_exp_avg"]])
    assert torch.equal(opt.state[model.blocks[0].moe.experts.gate_up_proj]["exp_avg"], torch.from_numpy(full_exp_avg))
    assert opt.param_groups[0]["lr"] == 1e-2


def test_dcp_stores_each_expert_as_its_own_chunk(across):
    # DCP reads whole chunks, so one chunk per expert is what lets any EP size read only its experts.
    from torch.distributed.checkpoint import FileSystemReader

    root, _, _ = across
    md = FileSystemReader(str(root / "dcp")).read_metadata().state_dict_metadata
    for key in (f"model.{EXPERT_KEY}", f"optim.state.{EXPERT_KEY}.exp_avg"):
        assert tuple(md[key].size) == (E, 2 * F, D)
        assert sorted(tuple(c.offsets) for c in md[key].chunks) == [(e, 0, 0) for e in range(E)]
        assert {tuple(c.sizes) for c in md[key].chunks} == {(1, 2 * F, D)}
    assert [tuple(c.sizes) for c in md["model.blocks.0.norm1.weight"].chunks] == [(D,)]  # replicated: once


def test_hf_layout_saved_at_ep2_loads_at_ep4_and_ep1(across):
    from safetensors import safe_open

    from lancet_rt import load_hf

    root, out, _ = across
    ep2 = torch.from_numpy(out[0]["ep2"])
    for r in range(4):
        assert_close(f"EP=4 rank {r} logits (HF layout)", torch.from_numpy(out[r]["ep4_hf"]), ep2)
        expert_reads = [(k, rows) for k, rows in out[r]["hf_reads"] if ".experts." in k]
        assert expert_reads and all(rows == (r, r + 1) for _, rows in expert_reads), expert_reads
    model = _blocks(seed=5)
    load_hf(model, root / "hf")
    assert_close("EP=1 logits (HF layout)", torch.from_numpy(_logits(model)), ep2)
    # Several files (max_shard_bytes), an index naming each, a non-HF model's experts stored fused [E, ...].
    import json

    index = json.loads((root / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and sorted(f for f in os.listdir(root / "hf") if f.endswith(".safetensors")) == files
    with safe_open(str(root / "hf" / index["weight_map"][EXPERT_KEY]), framework="pt") as f:
        assert f.get_slice(EXPERT_KEY).get_shape() == [E, 2 * F, D]


def test_data_parallel_replicas_write_one_copy(across):
    import json

    from lancet_rt import load_checkpoint, load_hf

    root, _, _ = across
    for saved, seed in (("dp_ep2_dcp", 10), ("dp_ep2_hf", 10), ("dp_hf", 11)):
        model = _blocks(seed=12)
        (load_checkpoint if saved.endswith("dcp") else load_hf)(model, root / saved)
        expected = torch.from_numpy(_logits(_blocks(seed=seed)))
        assert_close(f"EP=1 logits of {saved}", torch.from_numpy(_logits(model)), expected)
    for saved in ("dp_ep2_hf", "dp_hf"):  # each key in one file, the files those the index names
        index = json.loads((root / saved / "model.safetensors.index.json").read_text())["weight_map"]
        files = sorted(f for f in os.listdir(root / saved) if f.endswith(".safetensors"))
        assert sorted(set(index.values())) == files and len(index) == len(_blocks().state_dict())


def test_checkpoint_that_does_not_fit_raises_on_every_rank(across):
    root, out, _ = across
    for r in range(4):
        assert (
            out[r]["wrong_E_dcp"].startswith("ValueError")
            and "E=4" in out[r]["wrong_E_dcp"]
            and "E=8" in out[r]["wrong_E_dcp"]
        ), out[r]["wrong_E_dcp"]
        assert out[r]["wrong_E_hf"].startswith("ValueError") and "E=8" in out[r]["wrong_E_hf"], out[r]["wrong_E_hf"]
        assert out[r]["wrong_untouched"]
        assert out[r]["one_bad_path"].startswith("ValueError")
    assert "nowhere" in out[3]["one_bad_path"]
    assert all("rank 3" in out[r]["one_bad_path"] for r in range(3))
    for r in range(2):
        assert "differently structured" in out[r]["disagree"] and not out[r]["bad_written"]
        assert "process_group: must hold every rank" in out[r]["group_too_small"]
    assert not (root / "never").exists()
    assert not (root / "bad" / ".metadata").exists()


def test_mixtral_saved_at_ep2_loads_at_ep4_and_ep1(across):
    """The issue's acceptance: a checkpoint saved at EP=2 loads at EP=1 and EP=4 and gives the same logits."""
    import lancet_rt

    root, out, _ = across
    ep2 = torch.from_numpy(out[0]["mixtral_ep2"])
    assert_close("Mixtral EP=2 logits, ranks 0 and 1", torch.from_numpy(out[1]["mixtral_ep2"]), ep2)
    for r in range(4):
        assert_close(f"Mixtral EP=4 rank {r} logits (DCP)", torch.from_numpy(out[r]["mixtral_ep4_dcp"]), ep2)
        assert_close(f"Mixtral EP=4 rank {r} logits (HF layout)", torch.from_numpy(out[r]["mixtral_ep4_hf"]), ep2)
        # Rank r reads experts 2r and 2r+1 (8 experts over 4 ranks), per-expert tensors, nothing else.
        reads = [k for k, _ in out[r]["mixtral_hf_reads"] if ".experts." in k]
        experts = {int(k.split(".experts.")[1].split(".")[0]) for k in reads}
        assert experts == {2 * r, 2 * r + 1}
    model = _mixtral(seed=4)
    opt = torch.optim.AdamW(model.parameters())
    lancet_rt.load_checkpoint(model, root / "mixtral_dcp", opt)
    assert_close("Mixtral EP=1 logits (DCP)", torch.from_numpy(_lm_logits(model)), ep2)
    model = _mixtral(seed=5)
    lancet_rt.load_hf(model, root / "mixtral_hf")
    assert_close("Mixtral EP=1 logits (HF layout)", torch.from_numpy(_lm_logits(model)), ep2)


def test_mixtral_save_pretrained_round_trip(across):
    """What EP=2 wrote is what transformers writes (per-expert keys) and loads as the full model; what
    transformers' own save_pretrained wrote loads at EP=4."""
    import json

    from transformers import AutoModelForCausalLM

    root, out, transformers_logits = across
    index = json.loads((root / "mixtral_hf" / "model.safetensors.index.json").read_text())
    ours = set(index["weight_map"])
    assert ours == set(_weight_map_keys(root / "transformers_saved"))
    assert "model.layers.1.block_sparse_moe.experts.7.w3.weight" in ours
    assert len(set(index["weight_map"].values())) > 2  # files from both ranks
    # Eager attention as lancet_rt.models.hf_models builds it (sdpa differs on the fully masked rows of padding).
    full = AutoModelForCausalLM.from_pretrained(root / "mixtral_hf", attn_implementation="eager")
    assert type(full).__name__ == "MixtralForCausalLM" and full.config.num_local_experts == 8
    assert_close(
        "from_pretrained of the EP=2 save", torch.from_numpy(_lm_logits(full)), torch.from_numpy(out[0]["mixtral_ep2"])
    )
    for r in range(4):
        assert_close(
            f"transformers' save loaded at EP=4, rank {r}",
            torch.from_numpy(out[r]["transformers_saved_ep4"]),
            torch.from_numpy(transformers_logits),
        )
    # Per-expert keys and a model with another E: the error says how many experts each has.
    import lancet_rt
    from lancet_rt.models.hf_models import build

    for experts in (4, 16):
        model = lancet_rt.from_hf(build("mixtral", num_local_experts=experts))
        with pytest.raises(ValueError, match=f"the checkpoint has E=8 experts.*has E={experts}"):
            lancet_rt.load_hf(model, root / "mixtral_hf")


def test_qwen2_moe_saved_at_ep2_loads_with_from_pretrained(across):
    from transformers import AutoModelForCausalLM

    from lancet_rt.models.hf_models import build

    root, out, _ = across
    keys = set(_weight_map_keys(root / "qwen2_moe_hf"))
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in keys and not any(k.endswith("gate_up_proj") for k in keys)
    full = AutoModelForCausalLM.from_pretrained(root / "qwen2_moe_hf", attn_implementation="eager")
    ep2 = torch.from_numpy(out[0]["qwen2_moe_ep2"])
    assert_close("Qwen2-MoE from_pretrained of the EP=2 save", torch.from_numpy(_lm_logits(full)), ep2)
    assert_close("Qwen2-MoE EP=2 vs transformers", ep2, torch.from_numpy(_lm_logits(build("qwen2_moe"))))


def _weight_map_keys(directory):
    import json

    index = directory / "model.safetensors.index.json"
    return json.loads(index.read_text())["weight_map"] if index.exists() else _safetensors_keys(directory)


def _safetensors_keys(directory) -> set:
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def test_emulated_group_is_rejected(tmp_path):
    import lancet_rt
    from lancet_rt import save_checkpoint, save_hf

    link = lancet_rt.EmulatedGroup(2, bandwidth_gbps=1.0, latency_us=0.0)
    model = lancet_rt.MoE(D, F, E, 2, ep_group=link)
    for save in (save_checkpoint, save_hf):
        with pytest.raises(TypeError, match="EmulatedGroup"):
            save(model, tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_mismatches_name_what_differs(tmp_path):
    from lancet_rt import load_checkpoint, load_hf, save_checkpoint, save_hf

    model = _blocks()
    save_checkpoint(model, tmp_path / "dcp")
    save_hf(model, tmp_path / "hf")
    # Saved unsharded, still one chunk per expert: a later EP size reads only its experts.
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(tmp_path / "dcp")).read_metadata().state_dict_metadata[f"model.{EXPERT_KEY}"]
    assert sorted(tuple(c.offsets) for c in md.chunks) == [(e, 0, 0) for e in range(E)]
    assert (tmp_path / "hf" / "model.safetensors").exists()  # one file: no index, as transformers writes it
    assert not (tmp_path / "hf" / "model.safetensors.index.json").exists()
    fresh = _blocks()
    with pytest.raises(ValueError, match="no optimizer state"):
        load_checkpoint(fresh, tmp_path / "dcp", torch.optim.SGD(fresh.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="optimizer: holds parameters that are not model's"):
        load_checkpoint(fresh, tmp_path / "dcp", torch.optim.SGD(model.parameters(), lr=0.1))
    save_checkpoint(model, tmp_path / "with_opt", torch.optim.SGD(model.parameters(), lr=0.1))
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    params = list(fresh.parameters())
    two_groups = torch.optim.SGD([{"params": params[:3]}, {"params": params[3:]}], lr=0.1)
    with pytest.raises(ValueError, match="optimizer: has 2 param groups, the checkpoint's optimizer 1"):
        load_checkpoint(fresh, tmp_path / "with_opt", two_groups)
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())
    wider = torch.nn.ModuleDict({"blocks": _blocks().blocks, "extra": torch.nn.Linear(2, 2)})
    with pytest.raises(ValueError, match=r"missing from the checkpoint: model\.extra\.weight"):
        load_checkpoint(wider, tmp_path / "dcp")
    with pytest.raises(ValueError, match=r"missing from the checkpoint: extra\.weight"):
        load_hf(wider, tmp_path / "hf")
    other_ffn = torch.nn.Module()
    other_ffn.blocks = _blocks().blocks
    other_ffn.blocks[1].moe.experts.down_proj = torch.nn.Parameter(torch.zeros(E, D, F + 1))
    with pytest.raises(ValueError, match=r"blocks\.1\.moe\.experts\.down_proj: shape \(4, 8, 6\) in the checkpoint"):
        load_checkpoint(other_ffn, tmp_path / "dcp")
    with pytest.raises(ValueError, match="max_shard_bytes"):
        save_hf(model, tmp_path / "hf2", max_shard_bytes=0)
    with pytest.raises(ValueError, match="no readable"):
        load_checkpoint(model, tmp_path / "nothing")


def test_hf_layout_that_is_no_slice_goes_through_indices(tmp_path, monkeypatch):
    """An expert conversion that rearranges elements (a transpose, like transformers' Transpose op)
    is saved and loaded through the index probe's gather and scatter, not slices."""
    from safetensors import safe_open

    from lancet_rt import load_hf, save_hf
    from lancet_rt.checkpoint import hf as ep_checkpoint_hf

    identity = ep_checkpoint_hf._revert

    def transposing(model, tensors):
        out = identity(model, tensors)
        return {
            k + ".T" if k.endswith("down_proj") else k: v.transpose(-1, -2).contiguous()
            if k.endswith("down_proj")
            else v
            for k, v in out.items()
        }

    monkeypatch.setattr(ep_checkpoint_hf, "_revert", transposing)
    model = _blocks()
    parts = ep_checkpoint_hf._hf_layout(model, None).experts[1].parts
    assert parts[0].name == "blocks.0.moe.experts.down_proj.T" and parts[0].span is None
    save_hf(model, tmp_path / "hf")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:
        assert torch.equal(
            f.get_tensor("blocks.1.moe.experts.down_proj.T"),
            model.blocks[1].moe.experts.down_proj.detach().transpose(-1, -2),
        )
    fresh = _blocks(seed=9)
    load_hf(fresh, tmp_path / "hf")
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), k
