"""kernels.grad_accumulate and sum_of_squares against exact references, on every backend."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_helpers import LOW

from lightning_zero_offload import kernels

# fixtures in tests/conftest.py
pytestmark = pytest.mark.usefixtures("one_torch_thread", "torch_seed")

SIZES = [0, 1, 7, 15, 16, 17, 31, 63, 64, 65, 1023, 2**20 + 3]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("src_dtype", [torch.float32, *LOW])
def test_grad_accumulate_matches_reference(backend: str, size: int, src_dtype: torch.dtype) -> None:
    dst0 = torch.randn(size)
    src = torch.randn(size).to(src_dtype)
    for overwrite in (False, True):
        dst = torch.empty(size + 1)[1:].copy_(dst0)  # misaligned, for the streaming stores
        sumsq, nonfinite = kernels.grad_accumulate(dst, src, scale=0.75, overwrite=overwrite)
        expected = src.float() * 0.75 if overwrite else dst0 + src.float() * 0.75
        assert torch.equal(dst, expected)  # one rounding each: exact cast, multiply, add
        # squares of floats are exact in double: only the order of the double sum differs
        assert sumsq == pytest.approx(float((expected.double() ** 2).sum()), rel=1e-10, abs=0.0)
        assert nonfinite is False


@pytest.mark.parametrize("src_dtype", [torch.float32, *LOW])
def test_grad_accumulate_converts_every_low_precision_value_exactly(backend: str, src_dtype) -> None:
    if src_dtype == torch.float32:
        src = torch.randint(-(2**31), 2**31 - 1, (1 << 16,), dtype=torch.int64).to(torch.int32).view(torch.float32)
    else:
        src = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(src_dtype)
    dst = torch.empty(src.numel())
    kernels.grad_accumulate(dst, src, overwrite=True)
    expected = src.float()
    nan = expected.isnan()
    assert dst[nan].isnan().all()
    assert torch.equal(dst[~nan].view(torch.int32), expected[~nan].view(torch.int32))


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("src_dtype", [torch.float32, *LOW])
def test_grad_accumulate_flags_nonfinite(backend: str, bad: float, src_dtype: torch.dtype) -> None:
    for position in (0, 16, 1030):  # first vector, a middle one, the tail
        src = torch.ones(1031, dtype=src_dtype)
        src[position] = bad
        for overwrite in (False, True):
            sumsq, nonfinite = kernels.grad_accumulate(torch.zeros(1031), src, overwrite=overwrite)
            assert nonfinite is True and not math.isfinite(sumsq)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("src_dtype", [torch.float32, *LOW])
def test_sum_of_squares_is_an_overwriting_accumulate_without_the_write(
    backend: str, size: int, src_dtype: torch.dtype
) -> None:
    src = torch.empty(size + 1, dtype=src_dtype)[1:]  # misaligned, as a gradient may be
    src.copy_(torch.randn(size) * 3)
    before = src.clone()
    for threads in (1, 2):
        sumsq, nonfinite = kernels.sum_of_squares(src, num_threads=threads)
        expected, _ = kernels.grad_accumulate(torch.empty(size), src, overwrite=True, num_threads=threads)
        assert sumsq == expected and nonfinite is False  # bitwise: same blocks, same order
    assert torch.equal(src, before)
    if size:
        src[size // 2] = float("nan")
        assert kernels.sum_of_squares(src)[1] is True


def test_grad_accumulate_flags_overflow_from_scale_and_existing_inf(backend: str) -> None:
    _, nonfinite = kernels.grad_accumulate(torch.zeros(100), torch.full((100,), 1e30), scale=1e10)
    assert nonfinite
    _, nonfinite = kernels.grad_accumulate(torch.full((100,), 3e38), torch.full((100,), 3e38))  # sum overflows
    assert nonfinite
    dst = torch.ones(100)
    dst[50] = float("inf")
    assert kernels.grad_accumulate(dst, torch.ones(100))[1]  # add mode keeps an inf already there
    assert not kernels.grad_accumulate(dst, torch.ones(100), overwrite=True)[1]  # overwrite replaces it
    big = torch.full((100,), 3e38)  # finite, but its square overflows fp32: the double sum does not
    assert kernels.grad_accumulate(torch.zeros(100), big) == (pytest.approx(100 * 3e38**2), False)


def test_grad_accumulate_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="src has 3 elements but dst has 4"):
        kernels.grad_accumulate(torch.zeros(4), torch.zeros(3))
    with pytest.raises(TypeError, match="dst has dtype torch.bfloat16; expected torch.float32"):
        kernels.grad_accumulate(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4))
    with pytest.raises(ValueError, match="dst is not contiguous"):
        kernels.grad_accumulate(torch.zeros(4, 2).t(), torch.zeros(8))
    with pytest.raises(ValueError, match="src is a torch.strided tensor on meta"):
        kernels.grad_accumulate(torch.zeros(4), torch.zeros(4, device="meta"))
    with pytest.raises(ValueError, match="scale must be finite"):
        kernels.grad_accumulate(torch.zeros(4), torch.zeros(4), scale=float("nan"))
