"""The native backend: the C kernels of one instruction set (native/), called through cffi.

Arguments arrive checked (kernels/checks.py): these methods only translate them into the C API.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_zero_offload.kernels._native import DTYPE_CODES, ISAS, ffi, lib
from lightning_zero_offload.kernels.checks import AdamArgs, bad_counter


class NativeBackend:
    """The kernels of instruction set ``name`` (``"avx512"``, ``"avx2"`` or ``"scalar"``)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.isa = ISAS[name]

    def activate(self) -> None:
        """Point the extension's dispatch at this instruction set (one table of function pointers in C)."""
        lib.lzo_set_isa(self.isa)

    def adam(
        self,
        hparams: AdamArgs,
        table: list[tuple[int, ...]],
        params: Sequence[Tensor],
        grads: Sequence[Tensor],
        exp_avgs: Sequence[Tensor],
        exp_avg_sqs: Sequence[Tensor],
        params_out: Sequence[Tensor] | None,
        steps: Sequence[int] | Sequence[Tensor],
        grad_scale: float,
        extrapolate: float,
        num_threads: int,
    ) -> None:
        bad = lib.lzo_adam_step(
            hparams.c_struct,
            grad_scale,
            extrapolate,
            ffi.new("lzo_adam_tensor[]", table),
            len(table),
            DTYPE_CODES[grads[0].dtype],
            lib.LZO_NONE if params_out is None else DTYPE_CODES[params_out[0].dtype],
            num_threads,
        )
        if bad == -2:
            raise MemoryError("adam_step could not allocate its table of per-tensor constants")
        if bad:
            raise bad_counter(bad - 1, steps[bad - 1])

    def adam_if_finite(
        self,
        hparams: AdamArgs,
        table: list[tuple[int, ...]],
        params: Sequence[Tensor],
        grads: Sequence[Tensor],
        exp_avgs: Sequence[Tensor],
        exp_avg_sqs: Sequence[Tensor],
        steps: Sequence[int],
        grad_scale: float,
        num_threads: int,
    ) -> tuple[float, bool]:
        out = ffi.new("double *")
        status = lib.lzo_adam_step_checked(
            hparams.c_struct, grad_scale, ffi.new("lzo_adam_tensor[]", table), len(table), num_threads, out
        )
        if status == -2:
            raise MemoryError("adam_step_multi_if_finite could not allocate its per-chunk bookkeeping")
        return out[0], status == 0

    def adam_undo(
        self,
        hparams: AdamArgs,
        param: Tensor,
        grad: Tensor,
        exp_avg: Tensor,
        exp_avg_sq: Tensor,
        step: int,
        grad_scale: float,
        num_threads: int,
    ) -> None:
        pointers = (ffi.cast("float *", t.data_ptr()) for t in (param, grad, exp_avg, exp_avg_sq))
        lib.lzo_adam_undo(hparams.c_struct, grad_scale, float(step), *pointers, param.numel(), num_threads)

    def adam_bf16_state(
        self,
        hparams: AdamArgs,
        param: Tensor,
        grad: Tensor,
        exp_avg: Tensor,
        exp_avg_sq: Tensor,
        step: int,
        seed: int,
        offset: int,
        grad_scale: float,
        num_threads: int,
    ) -> None:
        lib.lzo_adam_step_bf16state(
            hparams.c_struct,
            grad_scale,
            seed,
            step,
            offset,
            ffi.cast("uint16_t *", param.data_ptr()),
            ffi.cast("void *", grad.data_ptr()),
            ffi.cast("uint16_t *", exp_avg.data_ptr()),
            ffi.cast("uint16_t *", exp_avg_sq.data_ptr()),
            param.numel(),
            DTYPE_CODES[grad.dtype],
            num_threads,
        )

    def grad_accumulate(self, dst: Tensor, src: Tensor, scale: float, overwrite: bool, num_threads: int) -> float:
        return lib.lzo_grad_accumulate(
            ffi.cast("float *", dst.data_ptr()),
            ffi.cast("void *", src.data_ptr()),
            dst.numel(),
            DTYPE_CODES[src.dtype],
            scale,
            overwrite,
            num_threads,
        )

    def sum_of_squares(self, src: Tensor, num_threads: int) -> float:
        return lib.lzo_sum_squares(ffi.cast("void *", src.data_ptr()), src.numel(), DTYPE_CODES[src.dtype], num_threads)

    def fingerprint16(self, words: Tensor, num_threads: int) -> Tensor:
        value = lib.lzo_fingerprint16(ffi.cast("void *", words.data_ptr()), words.numel(), num_threads)
        return torch.tensor(value - (1 << 64) if value >= 1 << 63 else value, dtype=torch.int64)
