"""The dispatchers as objects (lancet_rt.moe.dispatch): one lookup picks a layer's from its options, read at
each forward; the stages are seen through trace spans (how the autotuner's profiler times them)."""

from __future__ import annotations

import pytest
import torch

import lancet_rt
from lancet_rt import trace
from lancet_rt.moe.dispatch.allreduce import AllReduce
from lancet_rt.moe.dispatch.alltoall import AllToAll
from lancet_rt.moe.dispatch.base import Dispatcher
from lancet_rt.moe.dispatch.pipelined import Pipelined
from lancet_rt.moe.dispatch.registry import REGISTRY, kind
from lancet_rt.moe.dispatch.shadow import Shadow

MOE = dict(d_model=8, d_ffn=12, num_experts=4, top_k=2)


@pytest.mark.parametrize(
    "options, expected",
    [
        (dict(), AllToAll),
        (dict(ep_group=2), AllToAll),
        (dict(pipeline_chunks=2), Pipelined),
        (dict(ep_group=2, pipeline_chunks=2), Pipelined),
        (dict(shadow_experts=1), AllToAll),  # (no group: nothing to shadow)
        (dict(ep_group=2, shadow_experts=1), Shadow),
        (dict(dispatcher="allreduce"), AllToAll),  # (no group: the local path)
        (dict(ep_group=2, dispatcher="allreduce"), AllReduce),
    ],
)
def test_one_lookup_picks_the_dispatcher_from_the_options(options, expected):
    if "ep_group" in options:
        options = dict(options, ep_group=lancet_rt.EmulatedGroup(options["ep_group"]))
    moe = lancet_rt.MoE(**MOE, **options)
    d = moe.dispatcher
    assert type(d) is expected and d.moe is moe and REGISTRY[kind(moe)] is expected
    assert isinstance(d, Dispatcher)
    assert moe.config.dispatcher == options.get("dispatcher", "alltoall")


def test_the_dispatcher_follows_a_later_change_of_the_options():
    moe = lancet_rt.MoE(**MOE, ep_group=lancet_rt.EmulatedGroup(2))
    moe.pipeline_chunks = 2
    assert type(moe.dispatcher) is Pipelined


class _Stages(trace.Trace):
    """A recording that keeps the stages' names as they begin and end."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def begin(self, name, track, cuda=False, **args):
        self.seen.append(("begin", name, args.get("off_rank_bytes")))
        span = super().begin(name, track, cuda, **args)
        seen = self.seen

        class End:
            def end(self):
                span.end()
                seen.append(("end", name, None))

        return End()


def test_a_trace_subclass_sees_each_stage_begin_and_end():
    torch.manual_seed(0)
    moe = lancet_rt.MoE(**MOE, ep_group=lancet_rt.EmulatedGroup(2))
    x = torch.randn(6, 8)
    with trace.tracing(_Stages()) as t:
        moe(x)
    names = [n for phase, n, _ in t.seen if phase == "begin" and n in ("dispatch", "experts", "combine")]
    assert names == ["dispatch", "experts", "combine"]
    assert [n for phase, n, _ in t.seen if phase == "end" and n != "tracing"][-1] == "unpermute"
    sent = [b for phase, n, b in t.seen if phase == "begin" and n == "dispatch"][0]
    assert isinstance(sent, int) and sent >= 0  # the dispatch's off-rank bytes
