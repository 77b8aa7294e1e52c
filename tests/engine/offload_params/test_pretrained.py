"""Pretrained weights streamed into a sharded or plain model: safetensors (one file or an index), a state-dict
file, names with a prefix more or less, tied weights stored once, and load_state_dict's strictness."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from offload_params_helpers import Net, assert_same_state, full_state, tokens
from torch import nn

from lightning_zero_offload.engine.offload_params.materialize import materialize
from lightning_zero_offload.engine.offload_params.placement import shard_model
from lightning_zero_offload.engine.offload_params.pretrained import (
    SAFETENSORS_DTYPES,
    load_pretrained,
    open_checkpoint,
)
from lightning_zero_offload.testing.ranks import run_ranks

safetensors_torch = pytest.importorskip("safetensors.torch")  # the reference writer (installed with transformers)


def trained(tied: bool = False) -> Net:
    """A Net whose values no init gives (so a load that misses a tensor shows)."""
    torch.manual_seed(3)
    net = Net(tied)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p))
    return net


def empty_sharded(mesh, tied: bool = False) -> Net:
    with torch.device("meta"):
        net = Net(tied)
    return shard_model(net, mesh, param_dtype=torch.float32, initialize=False)


def test_the_reader_gives_what_safetensors_wrote_row_for_row(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        f"t.{name}": (torch.randn(5, 3, generator=g) * 100).to(dtype) for name, dtype in SAFETENSORS_DTYPES.items()
    }
    tensors |= {"scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4), "row": torch.arange(7.0)}
    safetensors_torch.save_file(tensors, tmp_path / "all.safetensors")
    with open_checkpoint(tmp_path / "all.safetensors") as checkpoint:
        assert checkpoint.shapes == {key: list(t.shape) for key, t in tensors.items()}
        for key, tensor in tensors.items():
            assert torch.equal(checkpoint.read(key, None, None), tensor), key
            for start, stop in ((1, 4), (3, 3), (4, 9)) if tensor.dim() else ():
                rows = checkpoint.read(key, start, stop)
                assert rows.dtype == tensor.dtype and torch.equal(rows, tensor[start:stop]), (key, start)
            for dtype in (tensor.dtype, torch.float64):  # read straight into the tensor, or cast on the way
                out = torch.empty_like(tensor[1:4] if tensor.dim() else tensor, dtype=dtype)
                checkpoint.read_into(key, 1 if tensor.dim() else None, out)
                assert torch.equal(out, (tensor[1:4] if tensor.dim() else tensor).to(dtype)), (key, dtype)


def test_a_safetensors_file_into_the_sharded_model_bitwise(tmp_path, mesh):
    source = trained()
    safetensors_torch.save_file(source.state_dict(), tmp_path / "model.safetensors")
    net = empty_sharded(mesh)
    assert load_pretrained(net, tmp_path) == ([], [])
    assert_same_state(net, source)
    assert torch.equal(net(tokens()), source(tokens()))


def test_an_index_of_several_files_and_a_cast_to_the_models_dtype(tmp_path, mesh):
    source = {name: t.to(torch.bfloat16) for name, t in trained().state_dict().items()}
    names = sorted(source)
    files = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, keys in files.items():
        safetensors_torch.save_file({key: source[key] for key in keys}, tmp_path / file)
    weight_map = {key: file for file, keys in files.items() for key in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    net = empty_sharded(mesh)
    load_pretrained(net, tmp_path)
    loaded = full_state(net)
    assert all(loaded[key].dtype == torch.float32 and torch.equal(loaded[key], source[key].float()) for key in names)


def test_a_state_dict_file_into_a_plain_model_built_on_the_meta_device(tmp_path):
    source = trained(tied=True)
    torch.save(source.state_dict(), tmp_path / "weights.pt")
    with torch.device("meta"):
        net = Net(tied=True)
    materialize(net, "cpu", initialize=False)
    load_pretrained(net, tmp_path / "weights.pt")
    assert_same_state(net, source)


class Holder(nn.Module):
    """A LightningModule's shape: the pretrained model one attribute down."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.model = net


def test_names_with_one_prefix_more_or_less_find_their_tensors(tmp_path):
    source = trained()
    safetensors_torch.save_file(source.state_dict(), tmp_path / "bare.safetensors")
    safetensors_torch.save_file(Holder(source).state_dict(), tmp_path / "held.safetensors")
    held, bare = Holder(Net()), Net()
    load_pretrained(held, tmp_path / "bare.safetensors")
    load_pretrained(bare, tmp_path / "held.safetensors")
    assert_same_state(held.model, source)
    assert_same_state(bare, source)


def test_a_tied_weight_stored_once_fills_both_names(tmp_path, mesh):
    source = trained(tied=True).state_dict()
    del source["head.weight"]  # as save_pretrained stores a tied head
    safetensors_torch.save_file(source, tmp_path / "model.safetensors")
    net = empty_sharded(mesh, tied=True)
    assert load_pretrained(net, tmp_path) == ([], [])
    assert torch.equal(net.head.weight.full_tensor(), source["embed.weight"])


def test_missing_and_unexpected_names_are_refused_before_anything_is_read(tmp_path):
    source = trained().state_dict()
    source["extra.weight"] = source.pop("norm.weight")
    safetensors_torch.save_file(source, tmp_path / "model.safetensors")
    net = Net()
    before = {key: t.clone() for key, t in full_state(net).items()}
    with pytest.raises(RuntimeError, match=r"missing \['norm.weight'\]; unexpected \['extra.weight'\]. .*strict=False"):
        load_pretrained(net, tmp_path)
    assert all(torch.equal(t, before[key]) for key, t in full_state(net).items())
    assert load_pretrained(net, tmp_path, strict=False) == (["norm.weight"], ["extra.weight"])
    loaded = full_state(net)
    assert torch.equal(loaded["norm.weight"], before["norm.weight"])
    assert all(torch.equal(loaded[key], source[key]) for key in source if key != "extra.weight")


def test_a_tensor_of_another_shape_is_refused(tmp_path):
    source = trained().state_dict()
    source["head.weight"] = source["head.weight"][:-1]
    safetensors_torch.save_file(source, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"head.weight: \(100, 13\) in the checkpoint, \(101, 13\) in the model"):
        load_pretrained(Net(), tmp_path)


def test_a_model_still_on_the_meta_device_is_refused(tmp_path):
    safetensors_torch.save_file(trained().state_dict(), tmp_path / "model.safetensors")
    with torch.device("meta"):
        net = Net()
    with pytest.raises(ValueError, match="on the meta device: load once the model has memory.*after setup"):
        load_pretrained(net, tmp_path)


@pytest.mark.slow  # two processes
def test_at_two_ranks_each_rank_reads_its_own_rows(tmp_path):
    from workers.offload_params import loaded_rows

    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    source = trained().state_dict()
    safetensors_torch.save_file(source, checkpoint / "model.safetensors")
    torch.save(source, checkpoint / "source.pt")
    run_ranks(functools.partial(loaded_rows, str(checkpoint)), 2, tmp_path, timeout=240)  # every rank checks
