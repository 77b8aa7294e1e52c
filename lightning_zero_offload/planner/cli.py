"""``zero-offload-plan`` / ``python -m lightning_zero_offload.planner``: the planner on the command line.

Examples::

    zero-offload-plan --params 1.3e9 --batch-size 8 --seq-len 2048          # measure this machine
    zero-offload-plan --model lightning_zero_offload.demo.GPT --model-args '{"n_layer": 6}' --batch-size 8 \\
        --seq-len 256 --n-layer 6
    zero-offload-plan --model path/to/Llama-3.1-70B --batch-size 1 --seq-len 4096 --devices 8 \\
        --offload-params --configure-model --cpu-state bf16   # a Hugging Face folder (its config.json)
    zero-offload-plan --params 7e9 --batch-size 4 --seq-len 2048 --n-layer 32 --devices 8 \\
        --host "server (2 sockets, 8ch DDR4-3200 each)" --device "H100 SXM (PCIe 5)"
    zero-offload-plan --largest --host "server (1 socket, 8ch DDR4-3200)" --device "H200 SXM (PCIe 5)" \\
        --host-memory-gb 128 --device-memory-gb 141          # the largest model plain / fp32 / bf16 state
    zero-offload-plan --params 70e9 --n-layer 80 --hidden 8192 --batch-size 1 --seq-len 4096 --devices 8 \\
        --offload-params --configure-model --host "DGX H100 (2 sockets, 8ch DDR5-4800 each, 2 TB)" \\
        --device "H100 SXM (PCIe 5)"                        # the parameters offloaded too

Exit status (docs/planning.md): 0 when a configuration fits (it is recommended; --largest: some model
trains with zero_offload), 3 when none fits (the report says why and what would), 2 for a usage error.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, fields

import torch

from lightning_zero_offload.engine.options import STATE_DTYPES
from lightning_zero_offload.planner.largest import PLAIN, largest_models
from lightning_zero_offload.planner.machine import Machine, measure_machine, presets, with_rates
from lightning_zero_offload.planner.memory import CHECKPOINT_FORMATS
from lightning_zero_offload.planner.model import DTYPES, plan
from lightning_zero_offload.planner.shape import DEFAULT_N_LAYER

EXIT_FITS = 0
EXIT_USAGE = 2  # argparse's own
EXIT_DOES_NOT_FIT = 3
LARGEST_DEFAULTS = {"batch_size": 1, "seq_len": 2048, "n_layer": DEFAULT_N_LAYER}  # --largest's model when not given


def importable_cwd() -> None:
    """Put the current directory on ``sys.path``, as ``python -m`` and ``python script.py`` do: a console
    script's path starts at its bin/ directory, so ``--model mymod.MyModule`` next to you would not import."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def build_model(spec: str, kwargs: dict) -> torch.nn.Module:
    """The model to plan, on the meta device (no memory): ``package.module.Class`` (or ``package.module:Class``)
    built with ``kwargs``; or a Hugging Face model from its config, when ``spec`` is a folder holding
    ``config.json``, a config file, or a hub id (``org/name``), ``kwargs`` overriding the config's fields."""
    if not isinstance(kwargs, dict):
        raise ValueError(f"--model-args must be a JSON object of keyword arguments, got {kwargs!r}")
    if "/" in spec or os.path.exists(spec) or "." not in spec.replace(":", "."):  # gpt2, t5-small: hub ids too
        return _hugging_face_model(spec, kwargs)
    module_name, _, name = spec.replace(":", ".").rpartition(".")
    importable_cwd()
    cls = getattr(importlib.import_module(module_name), name)
    try:  # the arguments against the signature: a TypeError raised inside the constructor is the class's own
        inspect.signature(cls).bind(**kwargs)
    except TypeError as error:
        raise ValueError(f"--model {spec} with --model-args {json.dumps(kwargs)}: {error}") from None
    except ValueError:  # no signature to read (a builtin): the constructor says it
        pass
    with torch.device("meta"):
        model = cls(**kwargs)
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"--model {spec} built a {type(model).__name__}, not an nn.Module")
    return model


def _hugging_face_model(spec: str, overrides: dict) -> torch.nn.Module:
    """The class the config names (``architectures``; a causal LM where it names none), built from it."""
    try:
        import transformers
    except ImportError:
        if "/" not in spec and not os.path.exists(spec):  # a bare name: a hub id, or a class without its module
            raise SystemExit(
                f"--model {spec!r}: a class is given by a dotted path like package.module.Class; as a Hugging Face "
                "hub id, planning it needs transformers (pip install transformers)"
            ) from None
        raise SystemExit(
            f"--model {spec!r} is a Hugging Face model: planning it needs transformers (pip install "
            "transformers), or give its class as a dotted path or --params"
        ) from None
    try:
        config, unused = transformers.AutoConfig.from_pretrained(spec, return_unused_kwargs=True, **overrides)
    except (OSError, ValueError) as error:
        raise SystemExit(
            f"--model {spec!r}: no Hugging Face config there ({error}); a class is given by its dotted path, "
            "package.module.Class"
        ) from None
    if unused:  # a misspelt field would plan the model unchanged
        raise ValueError(f"--model-args {sorted(unused)}: not fields of {type(config).__name__}")
    architecture = getattr(transformers, (config.architectures or ["AutoModelForCausalLM"])[0], None)
    with torch.device("meta"):
        if architecture is None or architecture.__name__.startswith("Auto"):
            return transformers.AutoModelForCausalLM.from_config(config)
        return architecture(config)


def positive(kind: type, zero: bool = False) -> Callable[[str], float]:
    """An argparse type: a number of ``kind`` above zero (a size, a count, a rate; ``zero``: or zero, a latency),
    anything else refused as a usage error."""

    def parse(text: str) -> float:
        try:
            value = kind(float(text)) if kind is int and float(text).is_integer() else kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'a whole number' if kind is int else 'a number'}"
            ) from None
        if not (value >= 0 if zero else value > 0) or not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} must be {'zero or more' if zero else 'above zero'} and finite")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its message
    return parse


MAX_PARAMS = 10**15  # beyond any host: the layout's sizes would overflow an index


def parameter_count(text: str) -> int:
    """An argparse type: ``--params``, a whole number from 1 to :data:`MAX_PARAMS`."""
    count = positive(int)(text)
    if count > MAX_PARAMS:
        raise argparse.ArgumentTypeError(f"{text!r} is more parameters than the planner takes (at most {MAX_PARAMS:g})")
    return int(count)


def device_type(text: str) -> str:
    """An argparse type: ``--device-type``, a device type torch knows (cuda, cpu, xpu...)."""
    try:
        return torch.device(text).type
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device type (e.g. cuda, cpu)") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="zero-offload-plan",
        description="Predict host RAM, device memory and step time of zero_offload training, and what to set.",
        epilog="Rates not given are measured on this machine by short probes, or taken from --host/--device. "
        f"Exit status: {EXIT_FITS} a configuration fits, {EXIT_DOES_NOT_FIT} none fits, {EXIT_USAGE} usage error.",
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=parameter_count, help="trainable parameters (e.g. 1.3e9)")
    what.add_argument(
        "--model",
        help="dotted path of an nn.Module class, or a Hugging Face model (a folder with config.json, a config "
        "file, or a hub id like org/name or gpt2): built on the meta device",
    )
    what.add_argument(
        "--largest",
        action="store_true",
        help="the largest model that trains on the machine: plain training, zero_offload with cpu_state fp32 and "
        "bf16, with and without offload_params (a transformer of --n-layer layers, default "
        f"{LARGEST_DEFAULTS['n_layer']}, widened; "
        f"--batch-size default {LARGEST_DEFAULTS['batch_size']}, --seq-len {LARGEST_DEFAULTS['seq_len']})",
    )
    p.add_argument(
        "--model-args", type=json.loads, default={}, help="JSON keyword arguments for --model (a config's fields)"
    )
    p.add_argument("--batch-size", type=positive(int), help="micro-batch per rank, as the run will use it (required)")
    p.add_argument("--seq-len", type=positive(int), help="tokens per sample, as the run will use them (required)")
    p.add_argument(
        "--n-layer",
        type=positive(int),
        help="transformer layers: adds attention FLOPs, and the activation estimate's depth (default: an assumed "
        f"shape, the model's own blocks or {DEFAULT_N_LAYER} layers for --params, named in the report)",
    )
    p.add_argument(
        "--hidden", type=positive(int), help="model width (default: from the model, or sqrt(params / 12 / n-layer))"
    )
    p.add_argument(
        "--activation-checkpointing", action="store_true", help="the model recomputes activations in backward"
    )
    p.add_argument("--devices", type=positive(int), default=1, help="ranks per node")
    p.add_argument("--nodes", type=positive(int), default=1)
    p.add_argument("--precision", default="bf16-mixed", choices=sorted(DTYPES))
    p.add_argument("--bucket-size-mb", type=positive(float), default=25.0)
    p.add_argument("--cpu-threads", type=positive(int), help="per rank (default: cores / ranks per node)")
    p.add_argument("--accumulate-grad-batches", type=positive(int), default=1)
    p.add_argument("--checkpoint-format", default="full", choices=list(CHECKPOINT_FORMATS))
    p.add_argument(
        "--cpu-state", default="fp32", choices=list(STATE_DTYPES), help="dtype of master, moments and gradient buffers"
    )
    p.add_argument(
        "--offload-params",
        action="store_true",
        help="the parameters offloaded too (FSDP2 shards per block on the host, the blocks in flight on the device)",
    )
    p.add_argument(
        "--device-share",
        type=_share,
        default=0.0,
        help="the fraction of the parameters whose units (with --offload-params) or last buckets stay on the device, "
        "or \"auto\": with --offload-params the strategy's choice with this machine's device memory free; without, "
        "the share a run starts with (the smallest with which the host holds the rest; the run chooses after its "
        "second step)",
    )
    p.add_argument(
        "--configure-model",
        action="store_true",
        help="the model is built in configure_model or under init_module(empty_init=True): materialized block by "
        "block, never whole",
    )
    p.add_argument("--host", choices=sorted(presets.HOSTS), help="a typical host instead of measuring this one")
    p.add_argument("--device", choices=sorted(presets.DEVICES), help="a typical accelerator (needs --host)")
    p.add_argument("--measure-device", help="device to measure on (default: cuda if available, else cpu)")
    rates = p.add_argument_group("rates (override measured or preset values)")
    for f in fields(Machine):
        if f.name != "name":
            kind = int if f.name in ("cpu_cores", "torch_threads") else float
            rates.add_argument(
                "--" + f.name.replace("_", "-"),
                type=device_type if f.name == "device_type" else positive(kind, zero=f.name.endswith("_s")),
            )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    """Print the plan; the exit status says whether anything fits (EXIT_FITS / EXIT_DOES_NOT_FIT)."""
    p = parser()
    args = p.parse_args(argv)
    if (args.host is None) != (args.device is None):
        p.error("--host and --device go together (or give neither, to measure this machine)")
    for name, default in LARGEST_DEFAULTS.items():
        if getattr(args, name) is None and args.largest:
            setattr(args, name, default)
    missing = [f"--{n.replace('_', '-')}" for n in ("batch_size", "seq_len") if getattr(args, n) is None]
    if missing:
        p.error(f"the following arguments are required: {', '.join(missing)}")
    overrides = {f.name: v for f in fields(Machine) if f.name != "name" and (v := getattr(args, f.name)) is not None}
    if args.host is not None:
        machine = presets.machine(args.host, args.device)
    else:
        machine = measure_machine(args.measure_device, threads=args.cpu_threads)
    machine = with_rates(machine, **overrides) if overrides else machine
    if args.largest:
        return _largest(args, machine)
    try:
        model = args.params if args.params is not None else build_model(args.model, args.model_args)
        result = plan(
            model,
            **_shared(args),
            cpu_threads=args.cpu_threads,
            accumulate_grad_batches=args.accumulate_grad_batches,
            n_layer=args.n_layer,
            machine=machine,
            hidden=args.hidden,
            cpu_state=args.cpu_state,
            offload_params=args.offload_params,
            configure_model=args.configure_model,
            device_share=args.device_share,
        )
    except (ValueError, ImportError, AttributeError) as error:  # what the model or the plan refuses: a usage error
        p.error(f"{type(error).__name__}: {error}")
    print(json.dumps(result.to_dict(), indent=1) if args.json else result)
    return EXIT_FITS if result.fits else EXIT_DOES_NOT_FIT


def _shared(args: argparse.Namespace) -> dict:
    """The arguments ``plan`` and ``largest_models`` take alike."""
    return {
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "devices": args.devices,
        "num_nodes": args.nodes,
        "precision": args.precision,
        "bucket_size_mb": args.bucket_size_mb,
        "checkpoint_format": args.checkpoint_format,
        "activation_checkpointing": args.activation_checkpointing,
    }


def _largest(args: argparse.Namespace, machine: Machine) -> int:
    """``--largest``: print the largest model of each way to train; fits when zero_offload trains some model."""
    if machine.device_type == "cpu" or machine.device_memory_gb is None:
        raise SystemExit(
            "--largest needs a GPU: give --host and --device (e.g. --device 'H200 SXM (PCIe 5)'), or --device-type "
            "cuda and --device-memory-gb, and --host-memory-gb for the host"
        )
    result = largest_models(machine, **_shared(args), n_layer=args.n_layer)
    print(json.dumps(asdict(result), indent=1) if args.json else result)
    return EXIT_FITS if any(r.params for r in result.rows if r.setup != PLAIN) else EXIT_DOES_NOT_FIT


def _share(text: str) -> float | str:
    return text if text == "auto" else float(text)
