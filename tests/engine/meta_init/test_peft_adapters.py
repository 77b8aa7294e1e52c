"""PEFT's LoRA adapters on a model built on the meta device: initialized as PEFT initializes them, or refused."""

from __future__ import annotations

import math

import pytest
import torch
from offload_params_helpers import full_state, one_rank_group, tiny_llama_config

from lightning_zero_offload.engine.offload_params.materialize import materialize
from lightning_zero_offload.engine.offload_params.placement import shard_model
from lightning_zero_offload.engine.offload_params.pretrained import load_pretrained

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytestmark = [
    pytest.mark.slow,  # transformers' and PEFT's models
    # PEFT 0.21 asks transformers 5.24 is_gradient_checkpointing, which it deprecates: neither is ours to mend
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]
IDS = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
RANK = 4


def lora(**config) -> torch.nn.Module:
    """A tiny Llama with LoRA adapters on its attention's q and v, built on the meta device."""
    with torch.device("meta"):
        base = transformers.LlamaForCausalLM(tiny_llama_config())
        options = {"r": RANK, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], **config}
        return peft.get_peft_model(base, peft.LoraConfig(**options))


def adapters(model: torch.nn.Module, which: str) -> list[torch.Tensor]:
    return [t for name, t in full_state(model).items() if f"lora_{which}" in name]


@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "sharded"])
@pytest.mark.parametrize("init", [True, "gaussian"])
def test_lora_adapters_start_as_peft_initializes_them(sharded, init):
    """The model's own init (transformers' ``_init_weights``) gave B the values of an ordinary layer, so the
    adapted model did not start as the base model; B is zero now, A as PEFT draws it (kaiming-uniform, or
    normal with std 1/r)."""
    torch.manual_seed(0)
    model = lora(init_lora_weights=init)
    if sharded:
        with one_rank_group() as mesh:
            shard_model(model, mesh, param_dtype=torch.float32)
            check_initialized(model, init)
    else:
        materialize(model, "cpu")
        check_initialized(model, init)


def check_initialized(model: torch.nn.Module, init: bool | str) -> None:
    assert all(not b.any() for b in adapters(model, "B"))
    weights = torch.cat([a.flatten() for a in adapters(model, "A")])
    if init is True:  # nn.Linear's kaiming_uniform_(a=sqrt(5)): uniform within 1/sqrt(fan_in)
        bound = 1 / math.sqrt(tiny_llama_config().hidden_size)
        assert weights.abs().max() <= bound and weights.std() > bound / 2
    else:
        assert weights.std() == pytest.approx(1 / RANK, rel=0.1)
    with torch.no_grad():
        adapted = model(input_ids=IDS).logits
        with model.disable_adapter():
            base = model(input_ids=IDS).logits
    assert torch.equal(adapted, base)


def test_init_lora_weights_false_gives_both_their_linear_init():
    torch.manual_seed(0)
    model = lora(init_lora_weights=False)
    materialize(model, "cpu")
    for b in adapters(model, "B"):
        assert b.abs().max() <= 1 / math.sqrt(RANK) and b.any()


@pytest.mark.parametrize(
    ("config", "refusal"),
    [
        ({"use_dora": True}, "DoRA's magnitudes"),
        ({"init_lora_weights": "pissa"}, "init_lora_weights='pissa'.*computed from the base weights"),
        ({"target_modules": ["embed_tokens"]}, "embedding adapters"),
    ],
)
def test_adapters_computed_from_the_base_weights_are_refused_with_the_ways_around(config, refusal):
    model = lora(**config)
    with pytest.raises(ValueError, match=refusal) as refused:
        materialize(model, "cpu")
    assert "Build the PEFT model over a model built eagerly" in str(refused.value)
    assert "load_pretrained" in str(refused.value)


@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "sharded"])
def test_the_base_models_checkpoint_loads_into_the_peft_model(sharded, tmp_path):
    """PEFT holds a wrapped layer's weights as ``base_layer.*`` and the adapters are its own: the base model's
    checkpoint left q_proj and v_proj at their random init (strict: refused as missing and unexpected)."""
    torch.manual_seed(7)
    base = transformers.LlamaForCausalLM(tiny_llama_config())
    base.save_pretrained(tmp_path)
    model = lora()
    if sharded:
        with one_rank_group() as mesh:
            shard_model(model, mesh, param_dtype=torch.float32)
            check_base_loaded(model, base, tmp_path)
    else:
        materialize(model, "cpu")
        check_base_loaded(model, base, tmp_path)


def check_base_loaded(model: torch.nn.Module, base: torch.nn.Module, path) -> None:
    assert load_pretrained(model, path) == ([], [])
    loaded = {name.replace(".base_layer", ""): t for name, t in full_state(model).items() if "lora_" not in name}
    want = full_state(base)
    assert {name.removeprefix("base_model.model.") for name in loaded} == set(want)
    assert all(torch.equal(t, want[name.removeprefix("base_model.model.")]) for name, t in loaded.items())
    assert all(not b.any() for b in adapters(model, "B"))
    with torch.no_grad():
        assert torch.equal(model(input_ids=IDS).logits, base(input_ids=IDS).logits)
