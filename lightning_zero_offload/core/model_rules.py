"""Setup-time checks that turn a model the engine would train wrongly, or a job that would hang, into a
clear error naming the fix.

- A parameter listed twice in the optimizer would get two slots in the flat buffer and stay frozen.
- A trainable parameter the flat, real, single-dtype device buffer cannot hold would be cast or untied
  silently, or fail later inside forward with an unrelated dtype error: a complex parameter (its
  imaginary part dropped), an ``expand()``-ed one (its shared elements untied), an fp64 one (rounded to
  the device dtype, where forward meets fp64 inputs; under "32-true" any dtype but fp32).
- Ranks whose models (or collective-relevant options) differ would issue mismatched collectives: a
  hang, or gloo's raw "collective mismatch". Each rank hashes a description of its model and options;
  the hashes are compared with one fixed-size all-gather, and only on a mismatch are the descriptions
  themselves gathered, to say which rank differs and where.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping, Sequence
from difflib import SequenceMatcher

import torch
import torch.distributed as dist
from torch import nn

from lightning_zero_offload.engine.infra.collectives import all_gather, comm_device
from lightning_zero_offload.engine.optimizer_support import optimizer_params

# Options that change which collectives run, or their sizes and dtypes: they must agree across ranks.
COLLECTIVE_OPTIONS = (
    "bucket_size_mb",
    "cpu_step",
    "delayed",  # dpu_warmup_steps, dpu_weight_prediction
    "speculative",  # speculation_rollback
    "checkpoint_format",
    "max_consecutive_skipped_steps",
    "device_share",  # which units keep their shards on the device: FSDP2's collectives follow it
)


class ModelMismatchError(RuntimeError):
    """The ranks do not hold the same model (or options), so their collectives would not match."""


def check_unique_params(optimizer: torch.optim.Optimizer, names: Mapping[int, str] | None = None) -> None:
    """Refuse a parameter listed twice in one param group (torch itself refuses it across groups)."""
    for group_index, group in enumerate(optimizer.param_groups):
        seen: set[int] = set()
        for p in group["params"]:
            if id(p) in seen:
                name = (names or {}).get(id(p))
                label = repr(name) if name else f"of shape {tuple(p.shape)}"
                raise ValueError(
                    f"The parameter {label} is listed twice in param group {group_index} of the optimizer. torch "
                    "updates such a parameter twice per step (and warns that this will become an error); "
                    "zero_offload refuses it. List each parameter once, e.g. torch.optim.AdamW(self.parameters()) "
                    "or param groups that do not overlap."
                )
            seen.add(id(p))


def check_param_dtypes(
    params: Sequence[torch.Tensor],
    names: Mapping[int, str],
    device_dtype: torch.dtype,
    placeholders: Collection[int] = (),
) -> None:
    """Refuse trainable parameters that the engine's flat device buffer of ``device_dtype`` would silently
    change: complex ones, ``expand()``-ed ones, and dtypes it would cast (the front ends' one call for all).
    ``placeholders``: ids of parameters that stand for a model built on the meta device, expanded zeros that
    hold no memory until the engine gives them their values (not tied elements).

    With bf16/fp16 autocast casts per operation, so fp32 and low-precision parameters work there, but autocast
    leaves fp64 alone: an fp64 submodule fed fp64 inputs trains in fp64 under strategy="auto", and would
    meet its own weights rounded to bf16 here. With "32-true" there is no autocast and any other dtype would
    meet fp32 inputs of its own weights' layer.
    """
    labelled = [(names.get(id(p), f"of shape {tuple(p.shape)}"), p) for p in params]
    found = _first([(name, p) for name, p in labelled if p.is_complex()])
    if found:
        name, p, extra = found
        raise ValueError(
            f"zero_offload trains real parameters only, but {name!r} is {p.dtype}{extra}: the flat device buffer "
            "and the CPU Adam kernel hold real numbers, so its imaginary part would be dropped. Parameterise it "
            "with real tensors, e.g. keep torch.view_as_real(z) (shape (..., 2)) as the nn.Parameter p and use "
            "torch.complex(p[..., 0].float(), p[..., 1].float()) in forward (torch's Adam updates a complex "
            "parameter as exactly that real view, so the update is the same; torch.view_as_complex(p) would need "
            "an even storage offset, which a view into the flat buffer need not have), or freeze it "
            "(requires_grad=False), or train with strategy='auto'."
        )
    expanded = [(name, p) for name, p in labelled if any(n > 1 and s == 0 for n, s in zip(p.shape, p.stride()))]
    found = _first([(name, p) for name, p in expanded if id(p) not in placeholders])
    if found:
        name, p, extra = found
        raise ValueError(
            f"zero_offload cannot train {name!r}{extra}: it is an expand()-ed view (shape {tuple(p.shape)}, "
            f"stride {tuple(p.stride())}) whose elements share memory. zero_offload would give each element its "
            'own slot and silently untie them; plain torch refuses to update it in place ("more than one element '
            'of the written-to tensor refers to a single memory location"). Keep the small tensor as the '
            "parameter and expand() it in forward (the elements stay tied), or materialise it with "
            "nn.Parameter(t.expand(...).clone()) (or .contiguous()) if they should train independently."
        )
    if device_dtype != torch.float32:
        found = _first([(name, p) for name, p in labelled if p.dtype == torch.float64])
        if found:
            name, p, extra = found
            raise ValueError(
                f"zero_offload keeps one {device_dtype} copy of every trainable parameter on the device and fp32 "
                f"master weights on the CPU, but {name!r} is {p.dtype}{extra}: it would be rounded to "
                f"{device_dtype} and its fp64 precision lost (strategy='auto' keeps it fp64: autocast leaves fp64 "
                "alone). Convert that submodule to float32 (submodule.float(), with float32 inputs: autocast then "
                "runs it in low precision and its master stays fp32), freeze it (requires_grad=False: frozen "
                "parameters keep their dtype), or train with strategy='auto'."
            )
        return
    found = _first([(name, p) for name, p in labelled if p.dtype != device_dtype])
    if found:
        name, p, extra = found
        raise ValueError(
            f"zero_offload keeps all trainable parameters in one device dtype, float32 under precision='32-true', "
            f"but {name!r} is {p.dtype}{extra}. Convert the model to float32 (model.float()), or freeze those "
            "parameters (requires_grad=False: frozen parameters keep their dtype)."
        )


def _first(found: list[tuple[str, torch.Tensor]]) -> tuple[str, torch.Tensor, str] | None:
    """The first parameter found, with a note counting the others (None if none was found)."""
    if not found:
        return None
    (name, p), more = found[0], len(found) - 1
    return name, p, f" (and {more} more)" if more else ""


def describe_model(module: nn.Module, optimizer: torch.optim.Optimizer, options: object, precision: str) -> list[str]:
    """What must be identical on every rank: state-dict entries, the optimizer's parameters, the precision
    and the options that shape collectives (``options`` is an ``OffloadOptions``)."""
    names: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    # Which entries wait for their values (on the meta device, or placeholders of a model built there) must
    # agree too: the ranks broadcast the others first, then initialize these.
    lines = [
        f"{name}: shape {tuple(t.shape)}, {t.dtype}" + (", pending" if t.is_meta or _placeholder_like(t) else "")
        for name, t in module.state_dict(keep_vars=True).items()
    ]
    for group_index, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            state = "trainable" if p.requires_grad else "frozen"
            lines.append(f"optimizer param group {group_index}: {names.get(id(p), tuple(p.shape))} ({state})")
    lines.append(f"precision: {precision}")
    return lines + [f"{name}: {getattr(options, name, None)!r}" for name in COLLECTIVE_OPTIONS]


def check_same_on_all_ranks(
    description: list[str], device: torch.device, group: dist.ProcessGroup | None = None
) -> None:
    """Raise :class:`ModelMismatchError` on every rank if any rank's description differs from rank 0's."""
    world = dist.get_world_size(group)
    digest = hashlib.sha256("\n".join(description).encode()).digest()
    target = comm_device(group, device)
    mine = torch.frombuffer(bytearray(digest), dtype=torch.int64).to(target)
    gathered = torch.empty(world * mine.numel(), dtype=torch.int64, device=target)
    all_gather(gathered, mine, group)
    digests = gathered.cpu().view(world, -1)
    if bool((digests == digests[0]).all()):
        return
    descriptions: list[list[str] | None] = [None] * world
    dist.all_gather_object(descriptions, description, group=group)
    raise ModelMismatchError(_difference(descriptions))  # type: ignore[arg-type]


def _difference(descriptions: list[list[str]]) -> str:
    reference = descriptions[0]
    differing = [rank for rank, lines in enumerate(descriptions) if lines != reference]
    rank = differing[0]
    lines = descriptions[rank]
    tag, i1, i2, j1, j2 = next(
        op for op in SequenceMatcher(a=reference, b=lines, autojunk=False).get_opcodes() if op[0] != "equal"
    )
    if tag == "insert":
        first = f"rank {rank} has {lines[j1]!r}, which rank 0 lacks"
    elif tag == "delete":
        first = f"rank 0 has {reference[i1]!r}, which rank {rank} lacks"
    else:
        first = f"rank 0 has {reference[i1]!r}, rank {rank} has {lines[j1]!r}"
    return (
        f"The model differs between ranks (rank{'s' if len(differing) > 1 else ''} "
        f"{', '.join(map(str, differing))} vs rank 0), so their collectives would not match. First difference: "
        f"{first}. Build the same model with the same strategy options on every rank (look for code that depends "
        "on the rank, the host or files that differ between machines)."
    )


def check_model(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    param_dtype: torch.dtype,
    precision: str,
    options: object,
    device: torch.device,
    distributed: bool,
    placeholders: Collection[int] = (),
) -> None:
    """Refuse what the engine would train wrongly, and models or options that differ between ranks
    (before the first collective that depends on them). ``options``: the ``OffloadOptions``;
    ``placeholders``: see :func:`check_param_dtypes`."""
    names: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    check_unique_params(optimizer, names)
    trainable = [p for p in optimizer_params(optimizer) if p.requires_grad]
    check_param_dtypes(trainable, names, param_dtype, placeholders)
    if distributed:
        check_same_on_all_ranks(describe_model(module, optimizer, options, precision), device)


def _placeholder_like(tensor: torch.Tensor) -> bool:
    """An expanded zero standing for a parameter of a model built on the meta device (engine/meta_init/blockwise.py)."""
    return tensor.numel() > 1 and 0 in tensor.stride()
