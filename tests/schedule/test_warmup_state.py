"""``lancet_rt.warmup`` leaves no trace: parameters, gradients (whatever ``.grad`` holds), optimizer
state, the RNG, the modules' train/eval state and their buffers (a BatchNorm's running statistics and
step counter, the router's expert bias and the layer's expert load) are bitwise what they were, and
the next training step's gradients and update equal those of a run without warm-up.

``.grad`` in the three states a training loop leaves it in: None (``zero_grad()``), zeros
(``zero_grad(set_to_none=False)``) and a partial sum between accumulated microbatches. Warm-up's
backward once added into allocated gradients (the next step's gradients were off by up to ~10).
The 2-rank gloo case is in tests/distributed/test_warmup.py (it uses :func:`warmup_case`).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lancet_rt

D, F, E, K = 8, 12, 4, 2
GRAD_STATES = ("none", "zeros", "partial")


class Net(nn.Module):
    """Dense layers with state a forward changes (dropout's RNG, a BatchNorm's statistics and
    counter, a step counter) around an MoE with an expert bias (its expert load grows per forward)."""

    def __init__(self, ep_group=None):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.norm = nn.BatchNorm1d(D)
        self.drop = nn.Dropout(0.25)
        self.moe = lancet_rt.MoE(
            D, F, E, K, score_fn="sigmoid", expert_bias=True, aux_loss_coef=0.01, ep_group=ep_group
        )
        self.head = nn.Linear(D, D)
        self.head.eval()  # a submodule in eval mode: warm-up must not flip it
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.steps += 1
        h = self.norm(self.inp(x_BSD).flatten(0, 1)).view_as(x_BSD)
        return self.head(self.moe(self.drop(h)))


def _build(ep_group, seed: int):
    torch.manual_seed(seed)
    model = Net(ep_group)
    with torch.no_grad():  # a non-zero expert bias, as after some update_expert_bias steps
        model.moe.router.e_score_correction_bias.copy_(torch.randn(E) * 0.1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt


def _loss(runner, x):
    return runner(x).square().mean()


def _prepare(model, opt, runner, xs, grads: str):
    """A first optimizer step (so Adam has state), then ``.grad`` left in state ``grads``."""
    _loss(runner, xs[0]).backward()
    opt.step()
    opt.zero_grad(set_to_none=grads == "none")
    if grads == "partial":
        _loss(runner, xs[1]).backward()  # the first of two accumulated microbatches


def snapshot(model: nn.Module, opt) -> dict:
    """Everything warm-up must leave as it found it, copied."""
    moe = model.moe
    return dict(
        params={n: p.detach().clone() for n, p in model.named_parameters()},
        grads={n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        buffers={n: b.clone() for n, b in model.named_buffers()},
        training={n: m.training for n, m in model.named_modules()},
        opt=copy.deepcopy(opt.state_dict()),
        rng=torch.get_rng_state(),
        layer={
            k: (None if v is None else v.clone())
            for k, v in dict(expert_load=moe.expert_load, aux_loss=moe.aux_loss, tokens=moe.tokens_per_expert).items()
        },
    )


def differences(before, after, path="") -> list:
    """Where two snapshots differ (bitwise: values, dtypes, None vs a tensor)."""
    if isinstance(before, torch.Tensor) or isinstance(after, torch.Tensor):
        same = (
            isinstance(before, torch.Tensor)
            and isinstance(after, torch.Tensor)
            and before.dtype == after.dtype
            and before.shape == after.shape
            and torch.equal(before, after)
        )
        return [] if same else [path]
    if isinstance(before, dict) and isinstance(after, dict):
        if before.keys() != after.keys():
            return [f"{path} keys"]
        return [d for k in before for d in differences(before[k], after[k], f"{path}.{k}")]
    if isinstance(before, (list, tuple)) and isinstance(after, (list, tuple)):
        if len(before) != len(after):
            return [f"{path} length"]
        return [d for i, (a, b) in enumerate(zip(before, after)) for d in differences(a, b, f"{path}[{i}]")]
    return [] if before == after else [path]


def warmup_case(grads: str, ep_group=None, rank: int = 0) -> list:
    """Warm-up between two steps, against the same run without it: the differences found (empty: none).

    Two identical models and optimizers; both take a step and leave ``.grad`` in state ``grads``; one
    is warmed (with the Overlapped it runs under, at 2 chunks). Then: warm-up changed nothing in it
    (bitwise), and the next backward and optimizer step give both the same gradients and parameters.
    """
    xs = [torch.randn(4, 3, D, generator=torch.Generator().manual_seed(10 * rank + i)) for i in range(3)]
    found = []
    runs = {}
    for warm in (False, True):
        model, opt = _build(ep_group, seed=1)
        runner = lancet_rt.Overlapped(model, chunks=2)
        torch.manual_seed(100 + rank)  # the same RNG stream in both runs
        _prepare(model, opt, runner, xs, grads)
        if warm:
            example = torch.randn(4, 3, D, generator=torch.Generator().manual_seed(7))
            before, held = snapshot(model, opt), [p.grad for p in model.parameters()]
            lancet_rt.warmup(runner, example)
            found += [f"warmup changed {d}" for d in differences(before, snapshot(model, opt))]
            found += [
                f"warmup replaced .grad of {n}" for (n, p), g in zip(model.named_parameters(), held) if p.grad is not g
            ]  # (the caller's tensors, not copies)
        _loss(runner, xs[2]).backward()
        runs[warm] = dict(grads={n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        runs[warm]["after"] = snapshot(model, opt)
    found += [f"next step differs at {d}" for d in differences(runs[False], runs[True])]
    return found


@pytest.mark.parametrize("grads", GRAD_STATES)
def test_warmup_leaves_state_and_the_next_step_unchanged(grads):
    found = warmup_case(grads)
    assert not found, "\n".join(found)


def test_warmup_does_not_consume_the_overlapped_check():
    """``Overlapped(check=True)``: the separability check is the real step's, not warm-up's."""
    model, _ = _build(None, seed=2)
    model.eval()  # (dropout and batch statistics are not separable along dim 0)
    runner = lancet_rt.Overlapped(model, chunks=2, check=True)
    lancet_rt.warmup(runner, torch.randn(4, 3, D))
    assert not runner._checked
