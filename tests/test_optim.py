"""CPUAdam against torch.optim.AdamW/Adam: same updates, same param_groups semantics, same state_dict.

Tolerance (as in tests/kernel_helpers.py): the kernel performs torch's fp32 operations in torch's order;
only the rounding of the square root differs (plus separate multiply and add roundings on the
portable backend without FMA). After S steps: |dp| <= S * (ulp(p) + 2^-21 lr), i.e. rtol = S * 2^-23
and atol = S * lr * 2^-21; moments get atol = S * 2^-23 * |g|max (exp_avg) or its square (exp_avg_sq).
"""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_zero_offload import kernels
from lightning_zero_offload.optim import CPUAdam

# fixtures in tests/conftest.py
pytestmark = pytest.mark.usefixtures("one_torch_thread", "torch_seed")

BACKENDS = kernels.available_backends()
GMAX = 6.0  # |grad| bound: standard normal gradients, seeded; a few million samples per test


GROUPS = [  # several groups with their own hyperparameters; sizes cover vector tails
    {"shapes": [(1,), (7,), (64, 65)], "lr": 1e-2},
    {"shapes": [(17,), (1023,)], "lr": 3e-3, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.0},
    {"shapes": [(31, 3), (2,)], "lr": 5e-2, "betas": (0.3, 0.5), "weight_decay": 0.05, "maximize": True},
]


def make_groups(clone_from=None) -> list[dict]:
    groups = []
    for i, spec in enumerate(GROUPS):
        params = [
            torch.nn.Parameter(clone_from[i][j].detach().clone() if clone_from else torch.randn(shape))
            for j, shape in enumerate(spec["shapes"])
        ]
        groups.append({"params": params, **{k: v for k, v in spec.items() if k != "shapes"}})
    return groups


def torch_class(adamw_mode: bool) -> type[torch.optim.Optimizer]:
    return torch.optim.AdamW if adamw_mode else torch.optim.Adam


def has_grad(step: int, index: int) -> bool:
    """Every param misses its gradient on some steps, at its own rate (3, 4 or 5)."""
    return (step + index) % (3 + index % 3) != 0


def set_grads(opt_a: torch.optim.Optimizer, opt_b: torch.optim.Optimizer, step: int) -> None:
    """The same gradients for both optimizers."""
    pairs = zip(
        (p for g in opt_a.param_groups for p in g["params"]),
        (p for g in opt_b.param_groups for p in g["params"]),
    )
    for index, (a, b) in enumerate(pairs):
        if not has_grad(step, index):
            a.grad = b.grad = None
        else:
            grad = torch.randn_like(a)
            a.grad, b.grad = grad.clone(), grad.clone()


def assert_same(ours: torch.optim.Optimizer, ref: torch.optim.Optimizer, steps: int) -> None:
    for group, ref_group in zip(ours.param_groups, ref.param_groups):
        rtol, lr = steps * 2**-23, ref_group["lr"]
        for p, q in zip(group["params"], ref_group["params"]):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=rtol, atol=steps * lr * 2**-21)
            state, ref_state = ours.state[p], ref.state[q]
            assert state.keys() == ref_state.keys()
            if not state:  # never had a gradient: no state, like torch
                continue
            assert torch.equal(state["step"], ref_state["step"])
            torch.testing.assert_close(state["exp_avg"], ref_state["exp_avg"], rtol=rtol, atol=steps * 2**-23 * GMAX)
            torch.testing.assert_close(
                state["exp_avg_sq"], ref_state["exp_avg_sq"], rtol=rtol, atol=steps * 2**-23 * GMAX**2
            )


@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam"])
def test_matches_torch_with_groups_skipped_grads_and_scheduler(backend: str, adamw_mode: bool) -> None:
    groups = make_groups()
    ours = CPUAdam(groups, weight_decay=0.01, adamw_mode=adamw_mode)
    ref = torch_class(adamw_mode)(
        make_groups(clone_from=[g["params"] for g in groups]), weight_decay=0.01, foreach=False
    )
    # LR schedulers change param_groups between steps; both optimizers must read them live
    schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9**s) for opt in (ours, ref)]
    steps = 25
    for step in range(steps):
        set_grads(ours, ref, step)
        ours.step()
        ref.step()
        for scheduler in schedulers:
            scheduler.step()
    assert_same(ours, ref, steps)
    counts = {float(s["step"]) for s in ours.state.values()}
    assert len(counts) > 1  # skipped grads left the params with different step counts


def test_many_small_tensors_one_native_call_per_group(monkeypatch: pytest.MonkeyPatch) -> None:
    sizes = torch.randint(1, 3000, (200,)).tolist()
    params = [torch.nn.Parameter(torch.randn(s)) for s in sizes]
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours = CPUAdam([{"params": params[:150]}, {"params": params[150:], "lr": 1e-2}], lr=1e-3, weight_decay=0.1)
    ref = torch.optim.AdamW(
        [{"params": ref_params[:150]}, {"params": ref_params[150:], "lr": 1e-2}],
        lr=1e-3,
        weight_decay=0.1,
        foreach=False,
    )
    calls = []
    real = kernels.adam_step_multi
    monkeypatch.setattr(kernels, "adam_step_multi", lambda *a, **k: calls.append(len(a[0])) or real(*a, **k))
    for step in range(20):
        set_grads(ours, ref, step)
        ours.step()
        ref.step()
    # one call per param group and step, over the params that had a gradient
    expected = [sum(has_grad(step, i) for i in group) for step in range(20) for group in (range(150), range(150, 200))]
    assert calls == expected
    assert_same(ours, ref, 20)


def test_closure_runs_with_grad_enabled_and_returns_loss() -> None:
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    opt = CPUAdam([w], lr=0.1)
    seen = []

    def closure() -> torch.Tensor:
        seen.append(torch.is_grad_enabled())
        opt.zero_grad()
        loss = (w**2).sum()
        loss.backward()
        return loss

    with torch.no_grad():
        loss = opt.step(closure)
    assert seen == [True] and loss.item() == 14.0
    assert torch.allclose(w.detach(), torch.tensor([0.9, -1.9, 2.9]))  # first Adam step: lr * sign(grad)


def test_state_dict_is_torch_format_and_loads_both_ways() -> None:
    groups = make_groups()
    ours = CPUAdam(groups, weight_decay=0.01)
    ref = torch.optim.AdamW(make_groups(clone_from=[g["params"] for g in groups]), weight_decay=0.01, foreach=False)
    for step in range(10):
        set_grads(ours, ref, step)
        ours.step()
        ref.step()
    state = copy.deepcopy(ours.state_dict())  # what a checkpoint holds: not the live tensors
    for param_state in state["state"].values():
        assert param_state.keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert param_state["step"].dtype == torch.float32 and param_state["step"].dim() == 0
    assert [len(g["params"]) for g in state["param_groups"]] == [3, 2, 2]

    # ours -> torch AdamW, torch AdamW -> ours: both continue exactly as the uninterrupted pair would
    torch_from_ours = torch.optim.AdamW(make_groups(clone_from=[g["params"] for g in ours.param_groups]), foreach=False)
    torch_from_ours.load_state_dict(state)
    ours_from_torch = CPUAdam(make_groups(clone_from=[g["params"] for g in ref.param_groups]), lr=123.0)
    ours_from_torch.load_state_dict(copy.deepcopy(ref.state_dict()))
    assert ours_from_torch.param_groups[2]["lr"] == GROUPS[2]["lr"]  # hyperparameters come from the state
    assert all(g["adamw_mode"] for g in ours_from_torch.param_groups)
    for step in range(10, 20):
        set_grads(ours, ref, step)
        for a, b in ((torch_from_ours, ours), (ours_from_torch, ref)):
            for p, q in zip(
                (p for g in a.param_groups for p in g["params"]),
                (q for g in b.param_groups for q in g["params"]),
            ):
                p.grad = None if q.grad is None else q.grad.clone()
        for opt in (ours, ref, torch_from_ours, ours_from_torch):
            opt.step()
    assert_same(torch_from_ours, ref, 20)
    assert_same(ours_from_torch, ref, 20)


def test_loading_torch_adam_state_selects_l2_mode() -> None:
    w = torch.nn.Parameter(torch.randn(5))
    ref = torch.optim.Adam([w], weight_decay=0.1)
    w.grad = torch.randn(5)
    ref.step()
    ours = CPUAdam([torch.nn.Parameter(w.detach().clone())])
    ours.load_state_dict(ref.state_dict())
    assert ours.param_groups[0]["adamw_mode"] is False


def test_params_without_grad_get_no_state_and_version_bumps() -> None:
    a, b = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))
    opt = CPUAdam([a, b])
    a.grad = torch.ones(4)
    version = a._version
    opt.step()
    assert b not in opt.state and float(opt.state[a]["step"]) == 1.0
    assert a._version > version  # autograd sees the in-place update, as with torch optimizers
    opt.zero_grad()
    before = a.detach().clone()
    opt.step()  # no grads at all: nothing changes
    assert torch.equal(a.detach(), before) and float(opt.state[a]["step"]) == 1.0


def test_rejects_what_it_cannot_do() -> None:
    w = torch.nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match="CPUAdam does not implement AMSGrad"):
        CPUAdam([w], amsgrad=True)
    for kwargs, match in [  # checked at construction by kernels.AdamArgs, not at the first step
        ({"lr": -1.0}, "lr must be >= 0"),
        ({"eps": 0.0}, "eps must be > 0"),
        ({"betas": (0.9, 1.0)}, r"beta2 must be in \[0, 1\)"),
        ({"weight_decay": -1.0}, "weight_decay must be >= 0"),
        ({"lr": float("inf")}, "lr must be finite"),
    ]:
        with pytest.raises(ValueError, match=match):
            CPUAdam([w], **kwargs)

    half = torch.nn.Parameter(torch.randn(4, dtype=torch.bfloat16))
    half.grad = torch.randn(4, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="CPUAdam updates float32 params with float32 gradients"):
        CPUAdam([half]).step()
    sparse = torch.nn.Parameter(torch.randn(4))
    sparse.grad = torch.randn(4).to_sparse()
    with pytest.raises(ValueError, match=r"grads\[0\] is a torch.sparse_coo tensor"):
        CPUAdam([sparse]).step()
    strided = torch.nn.Parameter(torch.randn(3, 4).t())
    strided.grad = torch.randn(4, 3)
    with pytest.raises(ValueError, match=r"params\[0\] is not contiguous"):
        CPUAdam([strided]).step()

    amsgrad_state = torch.optim.AdamW([w], amsgrad=True).state_dict()
    with pytest.raises(ValueError, match="saved with amsgrad=True"):
        CPUAdam([w]).load_state_dict(amsgrad_state)
