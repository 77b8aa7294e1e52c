"""core.model_rules.check_param_dtypes: trainable parameters the flat, real, single-dtype device buffer
would silently change are refused at setup, naming the parameter and the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zero_offload.core.model_rules import check_param_dtypes

DEVICE_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("device_dtype", DEVICE_DTYPES)
def test_a_complex_parameter_is_refused_in_every_precision_naming_it_and_the_real_parameterisation(device_dtype):
    params = [nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(4, dtype=torch.cfloat))]
    with pytest.raises(ValueError) as info:
        check_param_dtypes(params, {id(params[1]): "rotary.z"}, device_dtype)
    message = str(info.value)
    assert "'rotary.z' is torch.complex64" in message and "imaginary part would be dropped" in message
    assert "torch.view_as_real" in message and "strategy='auto'" in message


@pytest.mark.parametrize("device_dtype", DEVICE_DTYPES)
def test_an_expanded_parameter_is_refused_naming_it_and_how_to_materialise_it(device_dtype):
    expanded = nn.Parameter(torch.randn(1, 4).expand(3, 4))
    with pytest.raises(ValueError) as info:
        check_param_dtypes([expanded], {id(expanded): "bias_rows"}, device_dtype)
    message = str(info.value)
    assert "cannot train 'bias_rows'" in message and "shape (3, 4), stride (0, 1)" in message
    assert ".clone()" in message and "expand() it in forward" in message


def test_strides_that_share_no_memory_are_accepted():
    """Only a stride of 0 in a dimension of size > 1 shares elements (torch's own in-place rule): a
    transposed parameter, or a size-1 dimension with stride 0, is accepted."""
    transposed = nn.Parameter(torch.randn(4, 3).t())
    size_one = nn.Parameter(torch.randn(4).as_strided((1, 4), (0, 1)))
    assert size_one.stride()[0] == 0
    check_param_dtypes([transposed, size_one], {}, torch.float32)


@pytest.mark.parametrize("device_dtype", [torch.bfloat16, torch.float16])
def test_float64_under_mixed_precision_is_refused_naming_it_and_the_fix(device_dtype):
    head = nn.Linear(4, 2).double()
    params = [nn.Parameter(torch.randn(3)), head.weight, head.bias]
    names = {id(head.weight): "head.weight", id(head.bias): "head.bias"}
    with pytest.raises(ValueError) as info:
        check_param_dtypes(params, names, device_dtype)
    message = str(info.value)
    assert f"'head.weight' is torch.float64 (and 1 more): it would be rounded to {device_dtype}" in message
    assert "submodule.float()" in message and "requires_grad=False" in message and "strategy='auto'" in message


def test_mixed_precision_accepts_fp32_and_low_precision_parameters():
    """Autocast casts fp32, bf16 and fp16 per operation alike; the engine keeps an fp32 master for each."""
    params = [nn.Parameter(torch.randn(3, dtype=dtype)) for dtype in DEVICE_DTYPES]
    check_param_dtypes(params, {}, torch.bfloat16)
    check_param_dtypes(params, {}, torch.float16)


def test_32_true_still_refuses_any_other_dtype_naming_model_float():
    p = nn.Parameter(torch.randn(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"'w' is torch.bfloat16\. Convert the model to float32 \(model.float\(\)\)"):
        check_param_dtypes([p], {id(p): "w"}, torch.float32)
