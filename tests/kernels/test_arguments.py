"""Argument checks of the kernels (every message names the argument and the fix) and the AdamArgs record."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_helpers import HP, adam_args

from lightning_zero_offload import kernels
from lightning_zero_offload.kernels import _native


def call_args(n: int = 8, **overrides):
    args = {
        "param": torch.zeros(n),
        "grad": torch.zeros(n),
        "exp_avg": torch.zeros(n),
        "exp_avg_sq": torch.zeros(n),
    }
    kwargs = {"hparams": adam_args(adamw_mode=True), "step": 1}
    for key, value in overrides.items():
        (args if key in args else kwargs)[key] = value
    return args, kwargs


@pytest.mark.parametrize(
    "overrides,error,match",
    [
        (
            {"param": torch.zeros(8, device="meta")},
            ValueError,
            "param is a torch.strided tensor on meta; .*CPU",
        ),
        ({"grad": torch.zeros(16)[::2]}, ValueError, "grad is not contiguous"),
        ({"exp_avg": torch.zeros(9)}, ValueError, "exp_avg has 9 elements but param has 8"),
        (
            {"param": torch.zeros(8, dtype=torch.float64)},
            TypeError,
            "param has dtype torch.float64; expected torch.float32",
        ),
        (
            {"grad": torch.zeros(8, dtype=torch.int32)},
            TypeError,
            "grad has dtype torch.int32; expected torch.float32 or",
        ),
        ({"exp_avg_sq": torch.zeros(8).to_sparse()}, ValueError, "exp_avg_sq is a torch.sparse_coo tensor"),
        (
            {"param_out": torch.zeros(8)},
            TypeError,
            "param_out has dtype torch.float32; expected torch.bfloat16 or",
        ),
        ({"param": [0.0] * 8}, TypeError, "param must be a torch.Tensor, got list"),
        ({"step": 0}, ValueError, r"step must be >= 1 \(the first update is step 1\)"),
        ({"step": 1.0}, TypeError, "step must be an int"),
        ({"grad_scale": float("inf")}, ValueError, "grad_scale must be finite"),
        ({"num_threads": 0}, ValueError, "num_threads must be >= 1"),
        ({"hparams": dict(HP, adamw_mode=True)}, TypeError, "hparams must be a kernels.AdamArgs .*, got dict"),
    ],
)
def test_adam_step_rejects_bad_arguments(overrides, error, match) -> None:
    args, kwargs = call_args(**overrides)
    before = args["param"].clone() if isinstance(args["param"], torch.Tensor) else None
    with pytest.raises(error, match=match):
        kernels.adam_step(*args.values(), **kwargs)
    if before is not None and before.device.type == "cpu":
        assert torch.equal(args["param"], before)  # nothing was touched


@pytest.mark.parametrize(
    "overrides,error,match",
    [
        ({"lr": -1.0}, ValueError, "lr must be >= 0"),
        ({"lr": float("nan")}, ValueError, "lr must be finite"),
        ({"beta1": 1.0}, ValueError, r"beta1 must be in \[0, 1\)"),
        ({"beta2": -0.1}, ValueError, r"beta2 must be in \[0, 1\)"),
        ({"eps": 0.0}, ValueError, "eps must be > 0"),
        ({"weight_decay": -0.1}, ValueError, "weight_decay must be >= 0"),
        ({"lr": "0.1"}, TypeError, "lr must be a real number, got str"),
        ({"eps": torch.tensor(1e-8)}, TypeError, "eps must be a real number, got Tensor"),
    ],
)
def test_the_record_refuses_bad_hyperparameters_when_built(overrides, error, match) -> None:
    with pytest.raises(error, match=match):
        adam_args(adamw_mode=True, **overrides)


def test_the_record_converts_once_and_holds_the_c_struct() -> None:
    hp = kernels.AdamArgs(lr=1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0, adamw_mode=1)
    assert (type(hp.lr), type(hp.weight_decay), hp.adamw_mode, hp.maximize) == (float, float, True, False)
    assert hp == kernels.AdamArgs(1.0, 0.9, 0.99, 1e-8, 0.0, True, False)  # the C struct is not compared
    with pytest.raises(dataclasses.FrozenInstanceError):
        hp.lr = 2.0
    if _native.ffi is None:
        assert hp.c_struct is None
    else:  # built with the record, passed as it is to every call
        c = hp.c_struct
        fields = (c.lr, c.beta1, c.beta2, c.eps, c.weight_decay, c.adamw_mode, c.maximize)
        assert fields == (1.0, 0.9, 0.99, 1e-8, 0.0, 1, 0)


def test_every_adam_kernel_takes_the_record_only() -> None:
    """One calling convention: the record, not the separate keywords, and not a look-alike."""
    t = [torch.zeros(4) for _ in range(4)]
    bf16 = [torch.zeros(4, dtype=torch.bfloat16) for _ in range(3)]
    lookalike = dict(HP, adamw_mode=True)
    calls = [
        lambda hp: kernels.adam_step(*t, hparams=hp, step=1),
        lambda hp: kernels.adam_step_multi([t[0]], [t[1]], [t[2]], [t[3]], [1], hparams=hp),
        lambda hp: kernels.adam_step_multi_if_finite([t[0]], [t[1]], [t[2]], [t[3]], [1], hparams=hp),
        lambda hp: kernels.adam_undo(*t, hparams=hp, step=1),
        lambda hp: kernels.adam_step_bf16_state(bf16[0], t[1], bf16[1], bf16[2], hparams=hp, step=1, seed=0),
    ]
    for call in calls:
        with pytest.raises(TypeError, match="hparams must be a kernels.AdamArgs"):
            call(lookalike)
    with pytest.raises(TypeError, match="unexpected keyword argument 'lr'"):
        kernels.adam_step(*t, step=1, lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, adamw_mode=True)


def test_multi_rejects_bad_arguments() -> None:
    p = [torch.zeros(4), torch.zeros(5)]
    hp = adam_args(adamw_mode=True)
    with pytest.raises(ValueError, match="grads has 1 tensors but params has 2"):
        kernels.adam_step_multi(p, [torch.zeros(4)], p, p, [1, 1], hparams=hp)
    with pytest.raises(ValueError, match="steps has 1 entries but params has 2"):
        kernels.adam_step_multi(p, p, p, p, [1], hparams=hp)
    with pytest.raises(ValueError, match=r"steps\[1\] must be >= 1"):
        kernels.adam_step_multi(p, p, p, p, [1, 0], hparams=hp)
    with pytest.raises(ValueError, match=r"exp_avgs\[1\] has 4 elements but params\[1\] has 5"):
        kernels.adam_step_multi(p, p, [torch.zeros(4), torch.zeros(4)], p, [1, 1], hparams=hp)
    mixed = [torch.zeros(4, dtype=torch.bfloat16), torch.zeros(5, dtype=torch.float16)]
    with pytest.raises(TypeError, match="all grads of one call must share a dtype"):
        kernels.adam_step_multi(
            p, mixed, [torch.zeros(4), torch.zeros(5)], [torch.zeros(4), torch.zeros(5)], [1, 1], hparams=hp
        )
    kernels.adam_step_multi([], [], [], [], [], hparams=hp)  # nothing to do is fine
