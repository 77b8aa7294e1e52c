"""PEFT's adapter layers in a model built on the meta device (``configure_model``, ``empty_init=True``).

Built eagerly, ``get_peft_model`` initializes a LoRA layer's adapters after the model's own initialization:
each adapter's ``nn.Linear`` A and B as constructed, then PEFT's ``reset_lora_parameters`` (B zero, so the
adapted model starts as the base model). On the meta device all of that did nothing, and the model's
``_init_weights`` or the layers' ``reset_parameters`` alone would give the adapters the values of ordinary
layers, silently. ``adapter_layers`` finds PEFT's tuner layers (by PEFT's own attributes: this package does
not import peft), the initialization leaves them out of the model's own plan, and ``adapter_plan`` replays
what PEFT did, in the order an eager ``get_peft_model`` does it (after every module of the base model;
adapter by adapter, layer by layer): B zero, A from PEFT's distribution, drawn from the random stream after the
model's initialization (an eager build's construction draws from it too, so the values are not its). What
cannot be replayed without the base weights, which are not there yet (PiSSA, OLoRA, LoftQ and the other
initializations computed from them, DoRA's magnitudes), and tuner layers other than LoRA's linear ones, are
refused with the ways around.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# PEFT's init_lora_weights values that need nothing but the random stream (False: nn.Linear's own init).
REPLAYED_INITS = (True, False, "gaussian")

Pending = Callable[[nn.Module, str, torch.Tensor], bool]


def adapter_layers(module: nn.Module) -> list[tuple[nn.Module, dict]]:
    """Each PEFT tuner layer in ``module`` (a class with PEFT's ``adapter_layer_names``), in module order, with
    the ``peft_config`` (adapter name -> config) of the PEFT model that holds it (empty where none does)."""
    found: list[tuple[nn.Module, dict]] = []

    def visit(m: nn.Module, configs: dict) -> None:
        own = getattr(m, "peft_config", None)
        configs = own if isinstance(own, dict) else configs
        if hasattr(type(m), "adapter_layer_names"):
            found.append((m, configs))
        for child in m.children():
            visit(child, configs)

    visit(module, {})
    return found


def adapter_modules(layer: nn.Module) -> list[nn.Module]:
    """The tuner layer and the modules holding its adapters (containers and their entries): what PEFT
    initializes, not the model (its ``base_layer`` is the model's)."""
    held: list[nn.Module] = [layer]
    for name in type(layer).adapter_layer_names:  # type: ignore[attr-defined]
        container = getattr(layer, name, None)
        if isinstance(container, nn.Module):
            held += [container, *(m for m in container.modules() if m is not container)]
    return held


def adapter_plan(
    layers: list[tuple[nn.Module, dict]], pending: Pending
) -> list[tuple[nn.Module, Callable[[nn.Module], None]]]:
    """The initialization of the adapters still to initialize (``pending``), in eager ``get_peft_model``
    order: adapter by adapter, then layer by layer. Each run lists the adapter's A and B (their parameters
    stand in whole while it runs) and then the layer, whose entry replays PEFT's steps."""
    waiting = [(layer, configs) for layer, configs in layers if _has_pending(layer, pending)]
    for layer, configs in waiting:
        _check_replayable(layer, configs)
    names = list(dict.fromkeys(name for layer, _ in waiting for name in layer.lora_A))
    plan: list[tuple[nn.Module, Callable[[nn.Module], None]]] = []
    for name in names:
        for layer, configs in waiting:
            if name in layer.lora_A:
                plan += [(layer.lora_A[name], _nothing), (layer.lora_B[name], _nothing)]
                plan.append((layer, _replay(name, configs[name].init_lora_weights)))
    return plan


def _has_pending(layer: nn.Module, pending: Pending) -> bool:
    return any(
        pending(m, n, t)
        for m in adapter_modules(layer)
        for n, t in (*m._parameters.items(), *m._buffers.items())
        if t is not None
    )


def _check_replayable(layer: nn.Module, configs: dict) -> None:
    kind = type(layer).__name__
    where = (
        "Build the PEFT model over a model built eagerly (in __init__, not configure_model or "
        "init_module(empty_init=True)), or load trained adapter weights into it with load_pretrained after setup"
    )
    lora_a = getattr(layer, "lora_A", None)
    if not isinstance(lora_a, nn.ModuleDict) or not all(isinstance(a, nn.Linear) for a in lora_a.values()):
        raise ValueError(f"cannot initialize the PEFT layer {kind} on the meta device (LoRA's linear ones): {where}.")
    if len(getattr(layer, "lora_embedding_A", ())) or len(getattr(layer, "lora_magnitude_vector", ())):
        raise ValueError(
            f"cannot initialize the PEFT layer {kind} on the meta device: embedding adapters and DoRA's magnitudes "
            f"are initialized from the base weights, which are not there yet. {where}."
        )
    for name in lora_a:
        init = configs[name].init_lora_weights if name in configs else None
        if not any(init is ok if isinstance(ok, bool) else init == ok for ok in REPLAYED_INITS):
            raise ValueError(
                f"cannot initialize LoRA adapter {name!r} with init_lora_weights={init!r} on the meta device: "
                "it is computed from the base weights, which are not there yet (True, 'gaussian' and False are "
                f"replayed as PEFT does them). {where}."
            )


def _replay(name: str, init: bool | str) -> Callable[[nn.Module], None]:
    def replay(layer: nn.Module) -> None:
        layer.lora_A[name].reset_parameters()  # as PEFT constructs them: nn.Linear's init
        layer.lora_B[name].reset_parameters()
        if init is not False:
            layer.reset_lora_parameters(name, init)

    return replay


def _nothing(module: nn.Module) -> None:
    """An adapter's A or B: initialized by its layer's entry, which runs while their values stand in."""
