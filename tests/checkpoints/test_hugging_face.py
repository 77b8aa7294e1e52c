"""The Hugging Face weights folder (checkpoints/hugging_face.py): safetensors files as ``save_pretrained`` writes
them, read back by this package's reader and, in the slow tier, by transformers' ``from_pretrained`` after a fit;
shards within the limit, the folder's other files kept, refusals, and a failed export leaving the folder's
weights as they were; ``save_hugging_face`` from a live module, offload_params' shards gathered at 1 and 2 ranks."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import QUIET, BlockRegression, block_data
from offload_params_helpers import Blocks, full_state, sharded_copy, tiny_llama_config
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero_offload import ZeroOffloadStrategy, export_hugging_face, save_hugging_face
from lightning_zero_offload.checkpoints import CheckpointError
from lightning_zero_offload.checkpoints.hugging_face import INDEX, write_safetensors_folder
from lightning_zero_offload.engine.offload_params.pretrained import open_checkpoint


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(16, 8, generator=g),  # 512 bytes
        "layer.weight": torch.randn(8, 8, generator=g),
        "layer.bias": torch.randn(8, generator=g),
        "big": torch.randn(40, 8, generator=g),  # 1280 bytes: over the limit below, a shard of its own
        "position_ids": torch.arange(6),  # an integer buffer keeps its dtype
        "scale": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
    }


def write(folder: Path, tensors: dict[str, torch.Tensor], **options) -> dict[str, str]:
    return write_safetensors_folder(
        {name: t.to("meta") for name, t in tensors.items()}, tensors.__getitem__, folder, **options
    )


def read_back(folder: Path) -> dict[str, torch.Tensor]:
    with open_checkpoint(folder) as checkpoint:
        return {name: checkpoint.read(name, None, None) for name in checkpoint.shapes}


def header(file: Path) -> tuple[int, dict]:
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        return length, json.loads(f.read(length))


def test_the_shards_hold_every_tensor_bitwise_within_the_limit_and_the_index_lists_them(tmp_path):
    tensors = state()
    weight_map = write(tmp_path, tensors, max_shard_size=700)
    files = sorted(set(weight_map.values()))
    assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    assert len(files) == 4 and list(weight_map) == list(tensors)  # in the module's order
    index = json.loads((tmp_path / INDEX).read_text())
    assert index == {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    for file in files:
        length, entries = header(tmp_path / file)
        assert length % 8 == 0 and entries.pop("__metadata__") == {"format": "pt"}
        data = (tmp_path / file).stat().st_size - 8 - length
        assert data == sum(tensors[name].nbytes for name in entries)
        assert data <= 700 or len(entries) == 1  # only a tensor bigger than the limit exceeds it, alone
    back = read_back(tmp_path)
    assert list(back) == list(tensors)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_one_file_below_the_limit_and_bf16_rounds_floats_only(tmp_path):
    tensors = state()
    assert set(write(tmp_path, tensors, dtype=torch.bfloat16).values()) == {"model.safetensors"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    back = read_back(tmp_path)
    assert back["position_ids"].dtype == torch.int64 and torch.equal(back["position_ids"], tensors["position_ids"])
    for name in ("embed.weight", "big", "scale"):
        assert back[name].dtype == torch.bfloat16 and torch.equal(back[name], tensors[name].bfloat16())


def test_an_earlier_export_is_replaced_only_when_asked_and_the_other_files_stay(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    write(tmp_path, state(), max_shard_size=700)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(CheckpointError, match=r"holds weights already \(model-00001-of-00004.*overwrite=True"):
        write(tmp_path, state())
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    doubled = {name: t * 2 for name, t in state().items()}
    write(tmp_path, doubled, overwrite=True)  # one file now: the shards and their index are gone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert all(torch.equal(read_back(tmp_path)[name], t) for name, t in doubled.items())


def test_an_export_that_fails_leaves_the_folders_weights_as_they_were(tmp_path):
    write(tmp_path, state())
    before = (tmp_path / "model.safetensors").read_bytes()
    tensors = state()

    def failing(name: str) -> torch.Tensor:
        if name == "big":
            raise OSError("No space left on device")
        return tensors[name]

    with pytest.raises(OSError, match="No space left"):
        placeholders = {name: t.to("meta") for name, t in tensors.items()}
        write_safetensors_folder(placeholders, failing, tmp_path, max_shard_size=700, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # no shard, no temporary
    assert (tmp_path / "model.safetensors").read_bytes() == before


def test_bad_arguments_are_refused_before_anything_is_written(tmp_path):
    tensors = {"w": torch.ones(2)}
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"mine")
    cases = [
        ({"output": a_file}, CheckpointError, "it is a file, not a folder"),
        ({"output": "s3://bucket/model"}, CheckpointError, "writes to a local folder only"),
        ({"dtype": torch.float64}, ValueError, "dtype must be torch.float32, torch.bfloat16 or torch.float16"),
        ({"max_shard_size": "5 gigs"}, ValueError, "max_shard_size must be a number of bytes or a size like '5GB'"),
        ({"max_shard_size": 0}, ValueError, "max_shard_size must be"),
        ({"max_shard_size": "1.5"}, ValueError, "max_shard_size must be"),  # a fraction of a byte
    ]
    for options, error, message in cases:
        output = options.pop("output", tmp_path / "out")
        with pytest.raises(error, match=message):
            write(output, tensors, **options)
    assert not (tmp_path / "out").exists() and a_file.read_bytes() == b"mine"


# "1000": bytes as the command line gives them (--max-shard-size 100000000 was refused)
@pytest.mark.parametrize(
    ("size", "limit"), [(1000, 1000), ("1000", 1000), ("1.5kB", 1500), ("1KiB", 1024), (" 2 KB ", 2000)]
)
def test_shard_sizes_read_as_save_pretrained_reads_them(tmp_path, size, limit):
    quarter = {f"t{i}": torch.zeros(limit // 4, dtype=torch.uint8) for i in range(5)}
    shards = sorted(set(write(tmp_path, quarter, max_shard_size=size).values()))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]  # four fill one
    assert (tmp_path / shards[0]).stat().st_size - 8 - header(tmp_path / shards[0])[0] == 4 * (limit // 4)


class _LitLlama(L.LightningModule):
    """A LightningModule holding a Hugging Face Llama as ``self.model``, as fine-tuning recipes do."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        self.model = LlamaForCausalLM(tiny_llama_config(tied))

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


@pytest.mark.slow  # transformers, two fits
@pytest.mark.usefixtures("own_process_group")  # conftest.py: offload_params' group ends with the test
@pytest.mark.parametrize(
    ("tied", "options"), [(True, {"offload_params": True}), (False, {"checkpoint_format": "sharded"})]
)
def test_transformers_loads_the_trained_weights_from_the_folder(tmp_path, tied, options):
    from transformers import AutoModelForCausalLM

    module = _LitLlama(tied)
    trainer = L.Trainer(strategy=ZeroOffloadStrategy(**options), max_steps=3, **QUIET)
    trainer.fit(module, DataLoader(TensorDataset(torch.randint(0, 128, (24, 16))), batch_size=8))
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    trained = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in module.model.state_dict().items()}
    for dtype in (torch.float32, torch.bfloat16):
        folder = tmp_path / str(dtype)
        module.model.config.save_pretrained(folder)  # config.json: the folder's other files are kept
        weight_map = export_hugging_face(
            tmp_path / "last.ckpt", folder, prefix="model.", dtype=dtype, max_shard_size="100KB"
        )
        assert len(set(weight_map.values())) > 1 and (folder / "config.json").exists()
        loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).state_dict()
        assert sorted(loaded) == sorted(trained)
        for name, tensor in trained.items():  # the fp32 master weights, bitwise (rounded once for bf16)
            assert torch.equal(loaded[name], tensor.detach().to(dtype)), name


@pytest.mark.usefixtures("own_process_group")  # conftest.py: offload_params' group ends with the test
def test_after_fit_the_sharded_module_is_written_whole(tmp_path):
    """``save_pretrained`` and ``torch.save(state_dict())`` see FSDP2's DTensors after an offload_params fit; this
    writes the whole tensors, as ``save_pretrained`` does after a fit under auto."""
    module = BlockRegression()
    L.Trainer(strategy=ZeroOffloadStrategy(offload_params=True), max_steps=2, **QUIET).fit(module, block_data(32))
    assert any(hasattr(p, "full_tensor") for p in module.model.parameters())  # still sharded
    want = full_state(module.model)
    weight_map = save_hugging_face(module, tmp_path / "hf", prefix="model.", max_shard_size=2000)
    assert list(weight_map) == list(want) and len(set(weight_map.values())) > 1
    assert all(torch.equal(read_back(tmp_path / "hf")[name], t) for name, t in want.items())
    with pytest.raises(CheckpointError, match="holds weights already"):
        save_hugging_face(module, tmp_path / "hf", prefix="model.")
    with pytest.raises(CheckpointError, match=r"no name of the module starts with prefix 'net\.'; its first: model"):
        save_hugging_face(module, tmp_path / "other", prefix="net.")


def _two_ranks_save(folder: str, rank: int) -> dict:
    torch.manual_seed(0)
    sharded = sharded_copy(Blocks())
    refused = None
    try:  # every rank refuses a folder that holds weights (only rank 0 looks), none waits in a gather
        save_hugging_face(sharded, Path(folder) / "taken")
    except CheckpointError as error:
        refused = str(error)
    weight_map = save_hugging_face(sharded, Path(folder) / "hf", max_shard_size=3000)
    return {
        "weight_map": weight_map,
        "refused": refused,
        "want": {k: v.tolist() for k, v in full_state(sharded).items()},
    }


@pytest.mark.slow  # ranks in processes
def test_two_ranks_gather_each_tensor_and_rank_0_writes(tmp_path):
    from lightning_zero_offload.testing.ranks import run_ranks

    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "model.safetensors").write_bytes(b"theirs")
    results = run_ranks(functools.partial(_two_ranks_save, str(tmp_path)), 2, tmp_path, timeout=300)
    assert results[1]["weight_map"] is None and len(set(results[0]["weight_map"].values())) > 1
    assert all("holds weights already (model.safetensors)" in r["refused"] for r in results)
    written = read_back(tmp_path / "hf")
    assert all(torch.equal(written[k], torch.tensor(v)) for k, v in results[0]["want"].items())


def test_a_plain_module_is_written_as_its_state_dict(tmp_path):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    assert save_hugging_face(net, tmp_path) == dict.fromkeys(net.state_dict(), "model.safetensors")
    assert all(torch.equal(read_back(tmp_path)[k], v) for k, v in net.state_dict().items())  # num_batches_tracked too


def test_during_a_zero2_fit_with_a_bf16_copy_it_refuses_and_names_the_ways(tmp_path):
    """The parameters are then the bf16 copy the forward uses, not the fp32 master weights: refused, not written
    one bf16 ulp off; in 32-true the copy is the master, and it writes."""
    outcomes = []

    class SaveMidFit(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            if trainer.global_step == 2:
                try:
                    outcomes.append(save_hugging_face(pl_module, tmp_path / trainer.precision))
                except CheckpointError as error:
                    outcomes.append(str(error))

    for precision in ("bf16-mixed", "32-true"):
        trainer = L.Trainer(
            strategy=ZeroOffloadStrategy(in_place_on_cpu=False), precision=precision, max_steps=2,
            callbacks=[SaveMidFit()], **QUIET,
        )  # fmt: skip
        trainer.fit(BlockRegression(), block_data(32))
    refused, written = outcomes
    assert "its parameters are the torch.bfloat16 device copy of the engine's torch.float32 master" in refused
    assert "export_hugging_face(path, folder)" in refused and not (tmp_path / "bf16-mixed").exists()
    assert len(written) == len(BlockRegression().state_dict())
