"""What a plan knows about a model: its trainable shapes, its matmuls, and the engine's layout of it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_zero_offload.engine.offload_params.placement import find_units
from lightning_zero_offload.engine.options import OffloadOptions
from lightning_zero_offload.engine.step.layout import Layout, build_layout, count_within_share
from lightning_zero_offload.engine.step.shard_buffer import first_device_bucket


@dataclass
class ModelShape:
    """What the plan needs to know about a model: trainable parameter shapes and matmul FLOPs per token."""

    shapes: list[torch.Size] | None  # None: only the count is known
    matmul_params: int  # weights used in a matmul per token, counted per use (a tied head counts again)
    linear_shapes: dict[tuple[int, int], int]  # (in, out) of the matmuls -> how many
    hidden: int  # the most common matmul input width (the attention term's width)
    count: int = 0
    frozen: int = 0  # parameters without requires_grad: no CPU state, but on the host until setup and on the device
    module_bytes: int = 0  # the module's parameters as built (0: assume fp32, 4 B each)
    blocks: int | None = None  # a built model's longest list of repeated blocks (its layers); None: none found
    # With offload_params: the parameters of each unit FSDP2 shards on its own (each repeated block, each
    # embedding or linear outside them whose weight is not tied), and those the root keeps unsharded; None:
    # a parameter count, whose units are the planner's family's layers (planner/offload_params.py).
    units: tuple[int, ...] | None = None
    root_params: int = 0
    largest_tensor: int = 0  # elements of the largest parameter (a streamed full export holds one at a time)
    largest_unit_tensor: int = 0  # elements of the largest parameter of a unit (gathered one tensor at a time)
    root_tied: int = 0  # elements of the root's parameters that several modules use (tied embedding and head)
    units_refused: str = ""  # why offload_params would refuse the model (no blocks, a weight tied across blocks)
    configure_model: bool = False  # built in configure_model / init_module(empty_init=True): never whole

    @property
    def params(self) -> int:
        return self.count if self.shapes is None else sum(s.numel() for s in self.shapes)

    @classmethod
    def of(cls, model: nn.Module | int | float) -> ModelShape:
        if isinstance(model, float) and model.is_integer():  # 7e9
            model = int(model)
        if not isinstance(model, (nn.Module, Integral)) or isinstance(model, bool):
            raise TypeError(f"the model must be an nn.Module or a whole parameter count, got {model!r}")
        if isinstance(model, Integral):
            model = int(model)
            if model < 1:
                raise ValueError(f"the parameter count must be >= 1, got {model}")
            hidden = max(64, min(8192, 64 * round(math.sqrt(model / 12 / 32) / 64)))  # a 32-layer-ish guess
            return cls(None, model, {(hidden, 4 * hidden): 1}, hidden, count=model)
        seen: set[int] = set()
        shapes = []
        frozen = module_bytes = 0
        for p in model.parameters():  # unique: a tied weight has one optimizer state
            if id(p) in seen:
                continue
            seen.add(id(p))
            module_bytes += p.numel() * p.element_size()
            if p.requires_grad:
                shapes.append(p.shape)
            else:
                frozen += p.numel()
        if not shapes:
            raise ValueError("the model has no parameter with requires_grad=True: nothing to train")
        widths: dict[int, int] = {}
        linear: dict[tuple[int, int], int] = {}
        matmul = 0
        for module in model.modules():
            sizes = _matmul_sizes(module)
            if sizes is not None:
                weight = sizes[0] * sizes[1]
                matmul += weight
                widths[sizes[0]] = widths.get(sizes[0], 0) + weight
                linear[sizes] = linear.get(sizes, 0) + 1
        hidden = max(widths, key=widths.get) if widths else 1024
        matmul = matmul or sum(s.numel() for s in shapes)
        linear = linear or {(hidden, 4 * hidden): 1}
        blocks = _repeated_blocks(model)
        units, root, unit_tensor, root_tied, refused = _fsdp_units(model)
        largest = max(p.numel() for p in model.parameters())
        return cls(
            shapes,
            matmul,
            linear,
            hidden,
            frozen=frozen,
            module_bytes=module_bytes,
            blocks=blocks,
            units=units,
            root_params=root,
            largest_tensor=largest,
            largest_unit_tensor=unit_tensor,
            root_tied=root_tied,
            units_refused=refused,
        )

    @property
    def built_bytes(self) -> int:
        """Host bytes of the module's parameters as built (a parameter count: fp32)."""
        return self.module_bytes or 4 * (self.params + self.frozen)


def _matmul_sizes(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) of a layer that multiplies its input by its weight: ``nn.Linear``, or Hugging Face's ``Conv1D``
    (GPT-2's layers: the weight stored as in x out); None for any other module. Read from the sizes, never
    ``module.weight``: on a parametrized layer that runs the parametrization (spectral_norm's power iteration
    updates its buffers in training mode)."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    weight = module._parameters.get("weight")
    if type(module).__name__ == "Conv1D" and weight is not None and weight.dim() == 2:
        return weight.shape[0], weight.shape[1]
    return None


def _repeated_blocks(model: nn.Module) -> int | None:
    """How many blocks the model's layers are: of its ModuleLists/Sequentials of two or more blocks of one class
    that hold matmuls, the one with the most parameters (a transformer's layers, not a layer's experts); None if
    it has none. Reads the module tree and parameter sizes only."""
    best = None  # (parameters, blocks)
    for module in model.modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.children())
        if len(children) < 2 or len({type(child) for child in children}) > 1 or _matmul_sizes(children[0]):
            continue
        if any(_matmul_sizes(m) for m in children[0].modules()):
            candidate = (sum(p.numel() for p in module.parameters()), len(children))
            best = max(best or candidate, candidate)
    return best[1] if best else None


def _fsdp_units(model: nn.Module) -> tuple[tuple[int, ...], int, int, int, str]:
    """The parameters of each unit ``offload_params`` wraps with ``fully_shard`` (the engine's own choice,
    ``placement.find_units``: the repeated blocks, then big modules outside them), what is left to the root,
    the largest parameter of a unit, what of the root several modules use (tied weights), and why the engine
    would refuse the model ("" where it takes it). Counts every parameter once, frozen ones too (FSDP2 shards
    them all)."""
    refused = ""
    if any(isinstance(m, FSDPModule) for m in model.modules()):  # the user's own fully_shard units, as the engine
        modules = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    else:
        try:
            modules = find_units(model)
        except ValueError as error:
            modules, refused = [], str(error)
    seen: set[int] = set()
    units, unit_tensors = [], []
    for unit in modules:
        own = [p for p in unit.parameters() if id(p) not in seen]
        units.append(sum(p.numel() for p in own))
        unit_tensors += [p.numel() for p in own]
        seen.update(id(p) for p in own)
    total = sum(p.numel() for p in model.parameters())
    holders: dict[int, int] = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                holders[id(p)] = holders.get(id(p), 0) + 1
    tied = sum(p.numel() for p in model.parameters() if id(p) not in seen and holders[id(p)] > 1)
    return tuple(units), total - sum(units), max(unit_tensors, default=0), tied, refused


# Depth of the planner's model family when only a parameter count is known (--largest's default too).
DEFAULT_N_LAYER = 32


def assumed_depth(shape: ModelShape, hidden_given: bool) -> tuple[int, int, str]:
    """The transformer depth and width to estimate activations with when ``n_layer`` is not given, and how they
    were chosen: a built model's own blocks; else, with the width known, the depth at which 12 x hidden^2 per
    layer makes the parameter count; else the planner's family, DEFAULT_N_LAYER layers of :func:`width_for`."""
    if shape.shapes is None and not hidden_given:
        width = width_for(shape.params, DEFAULT_N_LAYER)
        formula = f"sqrt(params / (12 x {DEFAULT_N_LAYER}))"
        why = f"the planner's transformer for a parameter count (width {formula}, as --largest assumes)"
        return DEFAULT_N_LAYER, width, f"{DEFAULT_N_LAYER} layers of width {width}, {why}"
    width = shape.hidden
    why_width = "as given" if hidden_given else "the model's most common matmul input width"
    if shape.blocks:
        depth, why_depth = shape.blocks, "the model's longest list of blocks"
    else:
        depth, why_depth = max(1, round(shape.params / (12 * width**2))), "params / (12 x width^2)"
    return depth, width, f"{depth} layers ({why_depth}) of width {width} ({why_width})"


def width_for(params: int, n_layer: int) -> int:
    """A transformer's hidden size from its parameter count: about 12 x hidden^2 per layer."""
    return max(64, 64 * round(math.sqrt(params / (12 * n_layer)) / 64))


def scaled(shape: ModelShape, params: int, n_layer: int | None) -> ModelShape:
    """A model of ``params`` parameters of ``shape``'s family: the same depth, its width from
    :func:`width_for` (a built model keeps its width), the same matmul shapes, nothing frozen."""
    width = width_for(params, n_layer) if n_layer and shape.shapes is None else shape.hidden
    return ModelShape(None, params, shape.linear_shapes, width, params, configure_model=shape.configure_model)


@dataclass(frozen=True)
class LayoutSummary:
    """The sizes of the engine's layout that memory and time depend on (engine/step/layout.py)."""

    world_size: int
    shard_numel: int  # this rank's flat CPU buffers
    flat_numel: int  # the flat device buffer, padded
    buckets: int
    max_bucket: int  # padded elements of the largest bucket
    max_shard: int  # this rank's chunk of it
    device_shard_numel: int = 0  # of shard_numel, the device share's (its state on the device)
    device_max_shard: int = 0  # this rank's chunk of the device share's largest bucket
    device_max_run: int = 0  # this rank's part of the largest run of buckets joined by a split parameter in the share

    @property
    def host_shard_numel(self) -> int:
        """This rank's elements whose state is on the host."""
        return self.shard_numel - self.device_shard_numel

    @classmethod
    def of(cls, layout: Layout, device_share: float = 0.0) -> LayoutSummary:
        first = first_device_bucket(layout, device_share)
        on_device = layout.buckets[first:]
        runs = [sum(layout.buckets[b].shard_numel for b in run) for run in layout.bucket_runs() if run[-1] >= first]
        return cls(
            layout.world_size,
            layout.shard_numel,
            layout.flat_numel,
            len(layout.buckets),
            max(b.padded_numel for b in layout.buckets),
            max(b.shard_numel for b in layout.buckets),
            sum(b.shard_numel for b in on_device),
            max((b.shard_numel for b in on_device), default=0),
            max(runs, default=0),
        )


def layout_summary(
    shape: ModelShape, bucket_size_mb: float, dtype: torch.dtype, world: int, device_share: float = 0.0
) -> LayoutSummary:
    """The layout the engine would build for ``shape`` (a bare count: buckets of exactly the bucket size, the
    remainder last), and the ZeRO-2 device share's part of it."""
    bucket_numel = OffloadOptions(bucket_size_mb=bucket_size_mb).bucket_numel(dtype.itemsize)
    if shape.shapes is None:  # a bare parameter count: buckets of exactly the bucket size
        full, rest = divmod(shape.params, bucket_numel)
        padded, padded_rest = (-(-n // world) * world for n in (bucket_numel, rest))
        flat = full * padded + padded_rest
        largest = padded if full else padded_rest
        numels = [bucket_numel] * full + ([rest] if rest else [])
        kept = count_within_share(numels[::-1], device_share)  # the last buckets, whole
        padded_kept = [-(-n // world) * world for n in numels[len(numels) - kept :]]
        return LayoutSummary(
            world,
            flat // world,
            flat,
            len(numels),
            largest,
            largest // world,
            sum(padded_kept) // world,
            max(padded_kept, default=0) // world,
            max(padded_kept, default=0) // world,  # no parameter is split in a bare count
        )
    return LayoutSummary.of(build_layout(shape.shapes, bucket_numel, world, 0), device_share)
