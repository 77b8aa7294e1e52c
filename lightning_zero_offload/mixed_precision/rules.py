"""Which ops get a low-precision parameter as it is, and which an fp32 copy: the tables of the rule
(see the package docstring), by device type, and the kind of every torch function."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

LOW_PRECISION = (torch.bfloat16, torch.float16)

# Ops that autocast runs in low precision, by device type, as torch's Python API names them: torch 2.13's
# aten/src/ATen/autocast_mode.{cpp,h} (AutocastCPU's lower_precision_fp list; AT_FORALL_LOWER_PRECISION_FP for
# CUDA and XPU; AutocastMPS's list), plus the ``@`` operator. A device type not listed gets fp32 copies for
# every op: correct, at 4 bytes per element of each parameter used.
_MATMULS = frozenset({"linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "addbmm", "baddbmm"})
_CONVS = frozenset(
    {"conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"}
)
_RNN_CELLS = frozenset({"lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell"})
_AUTOCAST_OPS: dict[str, frozenset[str]] = {
    "cpu": _MATMULS
    | _CONVS
    | {"_addmm_activation", "linalg_vecdot", "prelu", "scaled_dot_product_attention", "_native_multi_head_attention"},
    "cuda": _MATMULS
    | _CONVS
    | _RNN_CELLS
    | {"convolution", "prelu", "addmv", "addr", "einsum", "mv", "linalg_vecdot", "chain_matmul", "linalg_multi_dot"}
    | {"scaled_dot_product_attention"},
    "mps": _MATMULS
    | (_CONVS - {"conv3d", "conv_transpose3d"})
    | {"convolution", "prelu", "addmv", "addr", "einsum", "mv", "chain_matmul", "linalg_multi_dot", "lstm_cell"},
}
_AUTOCAST_OPS["xpu"] = _AUTOCAST_OPS["cuda"]
# Plus the functions that feed the weights they are given to such ops only (inside a torch function's own
# implementation the mode is not active; autocast is): attention's input and output projections (linear), and
# the RNNs but on MPS (their cells' linear, cuDNN's autocast-wrapped kernel, oneDNN's RNN layer, autocast on the
# CPU). An RNN would otherwise copy its weights to fp32, and autocast round that copy back at every time step.
_RNNS = _RNN_CELLS | {"lstm", "gru", "rnn_tanh", "rnn_relu"}
AUTOCAST_LOW_PRECISION: dict[str, frozenset[str]] = {
    device_type: ops | {"multi_head_attention_forward"} | (_RNNS if device_type != "mps" else frozenset())
    for device_type, ops in _AUTOCAST_OPS.items()
}
# Ops whose result is a view of their first argument: a parameter passes through them unchanged. The selections
# (advanced indexing, index_select, ...) copy; their elements are the parameter's, returned as fp32.
_VIEWS = frozenset(
    {"T", "mT", "H", "mH", "data", "real", "detach", "t", "transpose", "swapaxes", "swapdims", "permute", "movedim"}
    | {"moveaxis", "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "ravel", "contiguous"}
    | {"expand", "expand_as", "broadcast_to", "unsqueeze", "squeeze", "atleast_1d", "atleast_2d", "atleast_3d"}
    | {"narrow", "select", "__getitem__", "diagonal", "unfold", "chunk", "split", "split_with_sizes", "tensor_split"}
    | {"hsplit", "vsplit", "dsplit", "unbind", "index_select", "gather", "take", "take_along_dim", "masked_select"}
)
# Factories that take the dtype of their first argument unless given one.
_FACTORIES = frozenset(
    {"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like"}
    | {"new_zeros", "new_ones", "new_empty", "new_full", "new_tensor"}
)
# Calls that read a tensor's metadata or act on the tensor object itself (plus every property but the views'
# and every ``is_*``/``register_*`` method).
_METADATA = frozenset(
    {"size", "dim", "ndimension", "numel", "nelement", "stride", "storage_offset", "element_size", "data_ptr"}
    | {"untyped_storage", "storage", "_typed_storage", "get_device", "__len__", "__format__", "__repr__", "tolist"}
    | {"item", "__bool__", "__int__", "__float__", "__index__", "__complex__", "__reduce_ex__", "__deepcopy__"}
    | {"__setstate__", "__array__", "__dlpack__", "__dlpack_device__", "numpy", "requires_grad_", "retain_grad"}
    | {"backward", "share_memory_", "_is_view"}
)
_IN_PLACE_OPERATORS = frozenset(
    {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__idiv__", "__ifloordiv__", "__imod__"}
    | {"__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}
)

# Norm functions and the names of their weight/bias arguments (positional index, keyword): the CPU kernels take
# fp32 activations only with fp32 weights.
NORMS: dict[Callable[..., Any], tuple[tuple[int, str], ...]] = {
    F.layer_norm: ((2, "weight"), (3, "bias")),
    F.group_norm: ((2, "weight"), (3, "bias")),
    F.batch_norm: ((3, "weight"), (4, "bias")),
    F.instance_norm: ((3, "weight"), (4, "bias")),
    F.rms_norm: ((2, "weight"),),
}

# How the mode treats a torch function (see the module docstring).
PASS, VIEW, FACTORY, EMBEDDING, AUTOCAST, IN_PLACE, FP32 = range(7)

KINDS: dict[str, dict[Callable, int]] = {}  # device type -> torch function -> its kind


def kind_of(func: Callable, autocast_ops: frozenset[str]) -> int:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):  # a property: ``Tensor.T.__get__``, ``Tensor.grad.__set__``
        prop = getattr(getattr(func, "__self__", None), "__name__", "")
        return VIEW if name == "__get__" and prop in _VIEWS else PASS
    if name in _VIEWS:
        return VIEW
    if name in _METADATA or name.startswith(("is_", "register_")) or func is torch.autograd.grad:
        return PASS  # torch.autograd.grad(loss, params): the parameters themselves, not copies outside the graph
    if name in _FACTORIES:
        return FACTORY
    if func is F.embedding:
        return EMBEDDING
    if name in autocast_ops:
        return AUTOCAST
    if name in _IN_PLACE_OPERATORS or (name.endswith("_") and not name.startswith("__")):
        return IN_PLACE
    return FP32
