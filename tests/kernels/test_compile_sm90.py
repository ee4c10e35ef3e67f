"""Every Triton kernel in kernels/ compiles for Hopper (sm_90) with its default config, on the CPU.

The CPU lane runs the kernels in Triton's interpreter, which never lowers them; this builds them for
sm_90 with the ptxas bundled in the Triton wheel (``python -m bench.kernels.compile_check``, no GPU needed), so
a kernel that does not compile for Hopper, spills registers or overflows shared memory fails here
instead of on the GPU machine. The check runs in a subprocess: this session imported kernels/ under
TRITON_INTERPRET=1, which makes every ``@triton.jit`` an interpreter stand-in that cannot compile.
About 30 s on two idle cores, minutes on a loaded one (its timeouts are hang guards);
``--all-configs`` (every config of every pruned autotune space, several minutes) is a command, not a test.
"""

import ast
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
from lancet_rt.kernels.reference import ACTIVATIONS

from bench.kernels import compile_check

ROOT = pathlib.Path(__file__).resolve().parents[2]
_MISSING = compile_check.toolchain_missing()
# A hang guard, not a speed limit: the cold compiles take ~30 s on two idle cores and took 204 s on a
# loaded machine; a test must not fail because the machine is busy.
HANG_GUARD_S = 1800
pytestmark = pytest.mark.timeout(HANG_GUARD_S + 120)  # (the module fixture's subprocess counts in the first test)


def _jit_kernels():
    """Names of the launchable @triton.jit kernels in kernels/ (helpers called from them are not launched
    on their own and compile inside them)."""
    names = set()
    for path in (ROOT / "kernels").glob("*.py"):
        names |= set(re.findall(r"@triton\.jit\s*\ndef (\w+_kernel)\(", path.read_text()))
    return names


# The expert variants' constexprs and the values each must be compiled with (kernels declaring them).
_VARIANT_VALUES = {
    "HAS_BIAS": {False, True},
    "INTERLEAVED": {False, True},
    "ACTIVATION": set(ACTIVATIONS),
    # the grouped GEMMs' row maps and dH's fused activation gradient
    "GATHER_X": {False, True},
    "SCATTER_Y": {False, True},
    "GATHER_DY": {False, True},
    "GLU_GRAD": {False, True},
}


def _variant_constexprs():
    """{kernel name: {constexpr: default}} for the launchable kernels declaring a _VARIANT_VALUES name."""
    out = {}
    for path in (ROOT / "kernels").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel"):
                args = node.args.args
                defaults = dict(zip([a.arg for a in args[len(args) - len(node.args.defaults) :]], node.args.defaults))
                # (constexprs with a default: the expert kernels'; the gating kernels' HAS_BIAS has none
                # and its biased build is a case of its own in bench.kernels.compile_check)
                found = {
                    a.arg: ast.literal_eval(defaults[a.arg])
                    for a in args
                    if a.arg in _VARIANT_VALUES and a.arg in defaults
                }
                if found:
                    out[node.name] = found
    return out


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile_check") / "sm90.json"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.kernels.compile_check", "--jobs", "2", "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    if not out.exists():
        pytest.fail(
            f"bench.kernels.compile_check wrote no report (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        )
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")
def test_every_kernel_is_checked(report):
    data, _ = report
    missing = _jit_kernels() - {r["fn"] for r in data["rows"]}
    assert not missing, f"@triton.jit kernels that bench.kernels.compile_check does not compile: {sorted(missing)}"


@pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")
def test_every_expert_variant_is_checked(report):
    """Each value of the expert kernels' variant constexprs (bias, interleaved gate/up, activation, row
    maps, the fused activation gradient) is
    compiled at least once: a branch the CPU lane interprets but that does not build for sm_90 fails here."""
    data, _ = report
    declared = _variant_constexprs()
    assert {
        "_grouped_gemm_fwd_kernel",
        "_gate_up_swiglu_fwd_kernel",
        "_swiglu_fwd_kernel",
        "_swiglu_bwd_kernel",
    } <= declared.keys()
    for fn, defaults in declared.items():
        rows = [r for r in data["rows"] if r["fn"] == fn]
        for name, default in defaults.items():
            seen = {r["constexprs"].get(name, default) for r in rows}
            assert seen >= _VARIANT_VALUES[name], f"{fn}: {name} compiled only with {seen}"


@pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")
def test_default_configs_compile_for_sm90(report):
    data, table = report
    rows = data["rows"]
    failed = [f"{r['kernel']} [{r['variant']}] {r['config']}: {r['error']}" for r in rows if r["error"]]
    assert not failed, "\n".join(failed) + "\n" + table
    for r in rows:
        name = f"{r['kernel']} [{r['variant']}] {r['config']}"
        assert r["regs"] is not None and r["regs"] <= 255, f"{name}: registers {r['regs']}"
        assert r["smem"] <= compile_check.SMEM_LIMIT, f"{name}: {r['smem']} bytes of shared memory"
        # The default config of every kernel and dtype is spill-free on Triton 3.6 and 3.9 alike (the
        # fp32 GEMM space is pruned to 64 accumulator registers for that); a spill is a regression.
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (
            f"{name}: spills {r['spill_stores']}/{r['spill_loads']} bytes (stores/loads)\n{table}"
        )
