"""The forward pass of ``bf16-mixed`` / ``16-mixed`` when the device holds low-precision weights.

Under torch AMP (``strategy="auto"``) the module stays fp32 and ``torch.autocast`` casts the inputs of
matmul-like ops to bf16/fp16; every other op computes with the fp32 parameters. Under ``zero_offload``
the trainable parameters themselves are bf16/fp16 (the fp32 masters live on the CPU), while buffers and
tensors the model creates during forward stay fp32, exactly as under AMP. Left alone, every op other
than a matmul would then meet a low-precision weight where AMP has an fp32 one: norms and ops that
require one dtype fail (``index_add``, ``lerp``, ``nn.Bilinear``, ``spectral_norm``'s ``mv`` on the
CPU, ...), parametrizations compute in bf16, and the gradients of a parameter used many times are
summed in bf16.

The rule here: *every op sees what it sees under AMP on the fp32 model, with the weights rounded to the
low-precision dtype; the gradients of each parameter's uses are summed in fp32.* A ``TorchFunctionMode``
active during forward looks at each torch call's arguments for parameters of the device dtype (also one
level inside lists and tuples, and views of them made during the forward):

- ops that autocast runs in low precision on that device type (linear, matmul, conv, bmm, attention;
  :data:`.rules.AUTOCAST_LOW_PRECISION`) and functions that feed the weights only to such ops
  (``multi_head_attention_forward``, the RNNs) get the parameter as it is: no copy. Its first such use in a
  forward is the parameter itself; later uses reach it through a zero-memory fp32 stand-in
  (:class:`.functions.FloatGradientSum`) where autograd sums their gradients in fp32 before one rounding;
- ``embedding`` looks its rows up in low precision and returns them as fp32, as AMP's fp32 table does
  (exact; no fp32 copy of the table). On the CPU its backward sums repeated rows in fp32
  (torch's CPU kernel sums them in the table's dtype; the CUDA kernel already sums in fp32);
- view and selection ops (``.T``, ``view``, ``__getitem__``, ``chunk``, ``index_select``, ...) pass the
  parameter through; a view of a parameter then counts as that parameter for the ops that consume it,
  and a selection that copies returns its (exact) elements as fp32;
- ``zeros_like``/``new_zeros``-style factories without a dtype make fp32 tensors, as from AMP's fp32 weight;
- in-place ops leave their destination alone (a write to a parameter reaches the parameter);
- metadata and identity calls (``.shape``, ``.dtype``, ``.grad``, ``register_hook``, ...) see the parameter;
- every other op (elementwise, norms, reductions, ``lerp``, ``index_add``, ``dot`` on the CPU,
  parametrizations) gets an fp32 copy of the parameter, made once per parameter and forward and dropped
  when the forward ends, like autocast's cast cache: it computes in fp32 as under AMP, and autograd sums
  the gradients of all its uses in fp32 before the one cast back to bf16. (Without grad, each use makes
  its own copy, freed with it.)

The table of autocast ops only saves memory: an autocast op missing from it would get the fp32 copy and
autocast would round it back, to the same bf16 values. The fp32 copies cost 4 bytes per element of
every parameter used by such ops, from its first use to the end of the forward (longer where an op saves
it for backward); under AMP those parameters are fp32 all the time.

Activation checkpointing (``torch.utils.checkpoint``) recomputes a region during backward, outside this
context; torch restores autocast there but not torch function modes, so each checkpointed region the rule
touches recomputes under a rule of its own (non-reentrant: through the region's ``_CheckpointFrame``;
reentrant: through the ``run_function`` its ``CheckpointFunction`` keeps).

Plain torch: no Lightning imports; the Trainer and the Fabric precision plugins both use
:func:`forward_context`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, nullcontext

import torch

from lightning_zero_offload.mixed_precision.mode import RoundedWeights, rule_active
from lightning_zero_offload.mixed_precision.rules import LOW_PRECISION

__all__ = ["LOW_PRECISION", "forward_context"]


def forward_context(device_type: str, dtype: torch.dtype) -> AbstractContextManager:
    """The context a training/evaluation forward runs in for device parameters of ``dtype``.

    fp32 parameters need nothing; bf16/fp16 parameters get autocast plus the rule of the module docstring
    (a forward_context entered inside another adds autocast only).
    """
    if dtype not in LOW_PRECISION:
        return nullcontext()
    stack = ExitStack()
    stack.enter_context(torch.autocast(device_type, dtype=dtype))
    if not rule_active():
        stack.enter_context(RoundedWeights(device_type, dtype))
    return stack
