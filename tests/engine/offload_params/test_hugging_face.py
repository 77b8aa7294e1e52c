"""A Hugging Face Llama (a model nobody here wrote) through the parameter-offload mode's setup: built from its
configuration on the meta device and initialized as transformers does, or loaded from ``save_pretrained``
(one file, or an index of several), sharded or plain."""

from __future__ import annotations

import functools

import pytest
import torch
from offload_params_helpers import assert_same_state, full_state, tiny_llama_config
from torch.distributed.fsdp import FSDPModule

from lightning_zero_offload.engine.offload_params.materialize import materialize
from lightning_zero_offload.engine.offload_params.placement import find_units, shard_model
from lightning_zero_offload.engine.offload_params.pretrained import load_pretrained
from lightning_zero_offload.testing.ranks import run_ranks

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # transformers' models
IDS = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))


def reinitialized(tied: bool, seed: int) -> torch.nn.Module:
    """An eager Llama initialized again by transformers' own ``initialize_weights`` from ``seed``."""
    model = transformers.LlamaForCausalLM(tiny_llama_config(tied))
    for item in (*model.modules(), *model.parameters()):
        item.__dict__.pop("_is_hf_initialized", None)
    torch.manual_seed(seed)
    model.initialize_weights()
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_the_decoder_layers_are_the_units_and_init_is_transformers_own(mesh, tied):
    torch.manual_seed(5)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(tiny_llama_config(tied))
    assert find_units(model) == list(model.model.layers)
    shard_model(model, mesh, param_dtype=torch.float32)
    # untied, the LlamaModel around the layers is a unit too (embedding and norm); tied, they stay with the root
    submodel = [] if tied else [model.model]
    assert [m for m in model.modules() if isinstance(m, FSDPModule)] == [model, *submodel, *model.model.layers]
    reference = reinitialized(tied, seed=5)
    ours, theirs = full_state(model), full_state(reference)
    tied_names = {"model.embed_tokens.weight", "lm_head.weight"} if tied else set()
    assert list(ours) == list(theirs)
    # A tied weight takes the embedding's init (as an eager build that ties after construction); transformers'
    # initialize_weights on a model already tied overwrites it with the head's.
    assert {name for name in ours if not torch.equal(ours[name], theirs[name])} == tied_names
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    # The rotary embedding's non-persistent buffers, garbage after to_empty, recomputed by _init_weights.
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    assert torch.equal(model.model.rotary_emb.original_inv_freq, reference.model.rotary_emb.inv_freq)
    loss = model(IDS, labels=IDS).loss
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())


def test_a_model_holding_a_hugging_face_model_gets_its_decoder_layers_as_units():
    holder = torch.nn.Module()  # a LightningModule's shape
    with torch.device("meta"):
        holder.model = transformers.LlamaForCausalLM(tiny_llama_config())
    assert find_units(holder) == list(holder.model.model.layers)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("max_shard_size", [None, "20KB"])
def test_save_pretrained_loads_into_the_sharded_and_the_plain_model_bitwise(tmp_path, mesh, tied, max_shard_size):
    torch.manual_seed(0)
    eager = transformers.LlamaForCausalLM(tiny_llama_config(tied)).eval()
    eager.save_pretrained(tmp_path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    assert (tmp_path / "model.safetensors.index.json").exists() == bool(max_shard_size)
    expected = eager(IDS).logits
    for sharded in (True, False):
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(tiny_llama_config(tied))
        if sharded:
            shard_model(model, mesh, param_dtype=torch.float32, initialize=False)
        else:  # the ZeRO-2 mode's model, whole
            materialize(model, "cpu", initialize=False)
        assert load_pretrained(model, tmp_path) == ([], [])
        assert_same_state(model, eager)
        assert torch.equal(model.eval()(IDS).logits, expected), sharded


def test_at_two_ranks_the_loaded_model_is_the_saved_one(tmp_path):
    from workers.offload_params import hugging_face_llama

    checkpoint = tmp_path / "checkpoint"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(tiny_llama_config()).save_pretrained(checkpoint, max_shard_size="20KB")
    for rank in run_ranks(functools.partial(hugging_face_llama, str(checkpoint)), 2, tmp_path, timeout=300):
        # Whole parameters bitwise (checked in the rank), so the same input gives the same logits bitwise.
        assert torch.equal(rank["logits"], rank["eager_logits"])
        assert rank["loss"] > 0
