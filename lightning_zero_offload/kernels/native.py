"""The native backend: the C kernels of one instruction set (native/), called through cffi.

Arguments arrive checked (kernels/arguments.py): these methods only translate them into the C API.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_zero_offload.kernels._native import DTYPE_CODES, ISAS, ffi, lib
from lightning_zero_offload.kernels.arguments import AdamCall, FlatAdamCall, bad_counter


class NativeBackend:
    """The kernels of instruction set ``name`` (``"avx512"``, ``"avx2"`` or ``"scalar"``)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.isa = ISAS[name]

    def activate(self) -> None:
        """Point the extension's dispatch at this instruction set (one table of function pointers in C)."""
        lib.lzo_set_isa(self.isa)

    def adam(self, call: AdamCall) -> None:
        table, out = call.table, call.params_out
        bad = lib.lzo_adam_step(
            call.hparams.c_struct,
            call.grad_scale,
            call.extrapolate,
            ffi.new("lzo_adam_tensor[]", table),
            len(table),
            DTYPE_CODES[call.grads[0].dtype],
            lib.LZO_NONE if out is None else DTYPE_CODES[out[0].dtype],
            call.num_threads,
        )
        if bad == -2:
            raise MemoryError("adam_step could not allocate its table of per-tensor constants")
        if bad:
            raise bad_counter(bad - 1, call.steps[bad - 1])

    def adam_if_finite(self, call: AdamCall) -> tuple[float, bool]:
        out = ffi.new("double *")
        table = ffi.new("lzo_adam_tensor[]", call.table)
        status = lib.lzo_adam_step_checked(
            call.hparams.c_struct, call.grad_scale, table, len(call.table), call.num_threads, out
        )
        if status == -2:
            raise MemoryError("adam_step_multi_if_finite could not allocate its per-chunk bookkeeping")
        return out[0], status == 0

    def adam_undo(self, call: FlatAdamCall) -> None:
        pointers = (ffi.cast("float *", t.data_ptr()) for t in (call.param, call.grad, call.exp_avg, call.exp_avg_sq))
        numel = call.param.numel()
        lib.lzo_adam_undo(call.hparams.c_struct, call.grad_scale, float(call.step), *pointers, numel, call.num_threads)

    def adam_bf16_state(self, call: FlatAdamCall) -> None:
        lib.lzo_adam_step_bf16state(
            call.hparams.c_struct,
            call.grad_scale,
            call.seed,
            call.step,
            call.offset,
            ffi.cast("uint16_t *", call.param.data_ptr()),
            ffi.cast("void *", call.grad.data_ptr()),
            ffi.cast("uint16_t *", call.exp_avg.data_ptr()),
            ffi.cast("uint16_t *", call.exp_avg_sq.data_ptr()),
            call.param.numel(),
            DTYPE_CODES[call.grad.dtype],
            call.num_threads,
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
