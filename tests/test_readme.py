"""The examples of the README and of every reference page run, in order, as a user would paste them.

A page's ```python blocks run in order in a fresh directory, each alone (a namespace of its own, as a
block pasted into a new interpreter or saved as a script): every block carries its imports and builds
what it uses; only files carry over (a checkpoint one block saves and a later one loads). A block whose first line is a
comment holding ``torchrun --nproc-per-node N`` is a script for N ranks: after its run in this
process (no ``RANK`` in the environment: one process, every expert local), it runs again as that
script on N processes (forked by tests/dist.py) in torchrun's environment (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ...: the script calls ``dist.init_process_group()`` itself), in the same directory,
so the blocks after it see what the ranks wrote (a checkpoint saved at EP=2 and loaded in one
process, say). Other fences (```bash: commands, GPU and multi-node runs) do not run, but for the CPU
``lancet-autotune`` command of docs/autotuning.md, run as written in a fresh directory.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist import assert_all_ok, run_ranks

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "design.md")]
# Pages whose examples include scripts for several ranks: at least this many must run on ranks.
RANK_SCRIPTS = {"README.md": 1, "hf.md": 1, "scaling.md": 1, "checkpoints.md": 1}


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), re.S)


def torchrun_ranks(block: str):
    """N when the block's first line is a comment running it with ``torchrun --nproc-per-node N``."""
    first = block.splitlines()[0]
    m = re.search(r"torchrun --nproc-per-node (\d+)", first)
    return int(m.group(1)) if first.startswith("#") and m else None


def _script(rank, world, source, name, directory):
    """One rank of a block run as a script in torchrun's environment (module-level: tests/dist.py forks
    it). Rank 0 hosts the rendezvous store on a port the OS picks, as torchrun's agent does
    (``TORCHELASTIC_USE_AGENT_STORE``: no port is chosen first and bound later); the harness's group
    hands its port over and is destroyed, and the script makes its own."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False) if rank == 0 else None
    port = [store.port if store else None]
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port[0]),
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    os.chdir(directory)
    exec(compile(source, name, "exec"), {"__name__": "__main__"})
    return rank


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_examples_run(page, tmp_path, monkeypatch):
    blocks = python_blocks(page)
    if page.name not in ("setup.md", "benchmarks.md"):  # command pages: their examples are ```bash
        assert blocks, f"{page.name} has no Python example"
    monkeypatch.chdir(tmp_path)
    environ = dict(os.environ)
    on_ranks = 0
    try:
        for i, block in enumerate(blocks):
            name = f"{page.name}, example {i + 1}"
            exec(compile(block, name, "exec"), {"__name__": "__main__"})
            world = torchrun_ranks(block)
            if world:
                ranks = assert_all_ok(run_ranks(_script, world, block, name, str(tmp_path), timeout=600))
                assert ranks == list(range(world))
                on_ranks += 1
    finally:  # an example may set environment variables (the autotuner's cache path)
        os.environ.clear()
        os.environ.update(environ)
    assert on_ranks >= RANK_SCRIPTS.get(page.name, 0)
    if page in (README, ROOT / "docs" / "overlap.md"):
        assert (tmp_path / "trace.json").stat().st_size > 0
    if page == README:
        assert len(blocks) >= 3 and (tmp_path / "ckpt").is_dir()


def test_autotune_cpu_command_runs_as_written(tmp_path):
    """The CPU ``lancet-autotune`` command of docs/autotuning.md tunes, prints its choice and caches it,
    in a fresh directory (its ``--cache`` relative to it; ``LANCET_AUTOTUNE_CACHE`` points there too)."""
    page = (ROOT / "docs" / "autotuning.md").read_text()
    commands = [
        c
        for b in re.findall(r"```bash\n(.*?)```", page, re.S)
        for c in b.replace("\\\n", " ").splitlines()
        if c.startswith("lancet-autotune --device cpu")
    ]
    assert len(commands) == 1, "autotuning.md has one CPU lancet-autotune command"
    argv = shlex.split(commands[0].split("#")[0])
    script = Path(sys.executable).with_name("lancet-autotune")
    argv[:1] = [str(script)] if script.exists() else [sys.executable, "-m", "lancet_rt.autotune"]
    env = dict(os.environ, LANCET_AUTOTUNE_CACHE=str(tmp_path / "env-cache.json"))
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "choice:" in done.stdout and "stored in" in done.stdout, done.stdout
    cache = tmp_path / argv[argv.index("--cache") + 1] if "--cache" in argv else tmp_path / "env-cache.json"
    (entry,) = json.loads(cache.read_text())["entries"].values()
    if "--candidates" in argv:
        assert entry["value"]["chunks"] in {int(n) for n in argv[argv.index("--candidates") + 1].split(",")}
