"""The sharded checkpoints of offload_params=True (checkpoints/distributed.py) at one rank: a bitwise resume,
loads without pickled code, failed and killed saves, damaged files, the whole-state reader and the streamed
export. At 2 -> 1, 2 and 3 ranks: test_distributed_ranks.py."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import crash_at, save_sharded_one_rank
from offload_params_helpers import (
    FREEZING,
    Blocks,
    batches,
    differences,
    frozen_block_resume_differences,
    full_state,
    make_engine,
    one_rank_group,
    sharded_copy,
    train,
    trained_copy,
    training_state,
    two_groups,
)
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter

from lightning_zero_offload.checkpoints import FORMAT_KEY, CheckpointError, distributed, export
from lightning_zero_offload.checkpoints import load_sharded as load_zero2
from lightning_zero_offload.checkpoints import sharded as sharded_format
from lightning_zero_offload.checkpoints.distributed_files import DCP_METADATA, MetadataReader, file_records
from lightning_zero_offload.checkpoints.sharded import META_FILE, current_version, layout_checksum
from lightning_zero_offload.engine.offload_params.full_state import full_model_state, full_optimizer_state

EXTRA = {"epoch": 2, "global_step": 3, "loops": {"fit_loop": {"batches": torch.arange(3)}}, "callbacks": {"cb": "x"}}


@pytest.fixture(autouse=True, scope="module")
def group():
    with one_rank_group():
        yield


def trained(steps: int, dtype: torch.dtype = torch.float32, seed: int = 0, **options):
    torch.manual_seed(seed)
    return trained_copy(Blocks(), batches(steps=steps, micro=2), dtype, clip_norm=0.5, **options)


def version_file(path: Path, name: str) -> Path:
    return Path(current_version(path).path) / name


@pytest.mark.parametrize(
    ("cpu_state", "cpu_step"),
    [("fp32", "sync"), pytest.param("fp32", "speculative", marks=pytest.mark.slow), ("bf16", "speculative")],
)
def test_a_sharded_checkpoint_resumes_bitwise_as_the_uninterrupted_run(tmp_path, cpu_state, cpu_step):
    dtype = torch.bfloat16 if cpu_state == "bf16" else torch.float32
    data = batches(steps=6, micro=2)
    torch.manual_seed(0)
    model = Blocks()
    uninterrupted, engine = trained_copy(model, data, dtype, clip_norm=0.5, cpu_state=cpu_state, cpu_step=cpu_step)

    first, first_engine = trained_copy(model, data[:3], dtype, clip_norm=0.5, cpu_state=cpu_state, cpu_step=cpu_step)
    distributed.save_sharded(tmp_path / "last.ckpt", first, first_engine, EXTRA)
    torch.manual_seed(1)  # another init and bf16 rounding seed: everything must come from the checkpoint
    resumed = sharded_copy(Blocks(), dtype)
    resumed_engine = make_engine(resumed, cpu_state=cpu_state, cpu_step=cpu_step)
    moments = [slot.exp_avg.data_ptr() for slot in resumed_engine.slots]
    extra = distributed.load_sharded(tmp_path / "last.ckpt", resumed, resumed_engine)
    assert [slot.exp_avg.data_ptr() for slot in resumed_engine.slots] == moments  # in place
    assert differences(training_state(resumed, resumed_engine), training_state(first, first_engine)) == []
    assert extra.keys() == EXTRA.keys() and torch.equal(extra["loops"]["fit_loop"]["batches"], torch.arange(3))
    train(resumed, resumed_engine, data[3:], clip_norm=0.5)
    assert differences(training_state(resumed, resumed_engine), training_state(uninterrupted, engine)) == []


@pytest.mark.parametrize("cpu_state", ["fp32", "bf16"])
@pytest.mark.parametrize("case", FREEZING)
def test_a_frozen_blocks_state_resumes_as_torch_keeps_it(tmp_path, case, cpu_state):
    """Frozen across the save: its state is saved, loaded into it frozen and taken up when it is unfrozen; trained
    only after the save (the checkpoint has no state for it): it starts afresh. Both bitwise as the uninterrupted
    run."""

    def checkpoint(first, first_engine, resumed, resumed_engine):
        distributed.save_sharded(tmp_path / "last.ckpt", first, first_engine, {})
        distributed.load_sharded(tmp_path / "last.ckpt", resumed, resumed_engine)

    assert frozen_block_resume_differences(case, cpu_state, checkpoint) == []


def test_every_file_loads_without_pickled_code(tmp_path):
    sharded, engine = trained(2)
    path = tmp_path / "last.ckpt"
    distributed.save_sharded(path, sharded, engine, EXTRA)
    meta = torch.load(version_file(path, META_FILE), weights_only=True)
    assert meta["extra"]["callbacks"] == {"cb": "x"} and meta["engine"]["step_calls"] == 2
    reader = MetadataReader(current_version(path))  # DCP's index, through the restricted unpickler
    kinds = {type(entry).__name__ for entry in reader.read_metadata().state_dict_metadata.values()}
    assert kinds == {"TensorStorageMetadata"}  # DCP would unpickle any other value with weights_only=False


def test_a_planted_payload_in_the_index_is_refused_and_never_runs(tmp_path):
    sharded, engine = trained(1)
    path = tmp_path / "last.ckpt"
    distributed.save_sharded(path, sharded, engine, {})
    ran = tmp_path / "ran"
    version_file(path, DCP_METADATA).write_bytes(pickle.dumps(_RunsCode(ran)))
    _record_files_anew(path)  # as an attacker who knows the format would
    with pytest.raises(CheckpointError, match=r"refused by weights_only loading: it holds posix.system") as error:
        distributed.load_sharded(path, sharded, engine)
    assert "only files you trust with weights_only=False" in str(error.value) and not ran.exists()


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _record_files_anew(path: Path) -> None:
    target = version_file(path, META_FILE)
    meta = torch.load(target, weights_only=True)
    info = meta[FORMAT_KEY]
    info["files"] = file_records(current_version(path), sorted(info["files"]))
    info["layout_crc32"] = layout_checksum(info)
    torch.save(meta, target)


def test_an_object_in_extra_is_refused_by_name_unless_weights_only_is_false(tmp_path):
    sharded, engine = trained(1)
    path = tmp_path / "last.ckpt"
    distributed.save_sharded(path, sharded, engine, {"hparams": _Hyperparameters()})
    with pytest.raises(CheckpointError, match=r"was refused by weights_only loading: it holds Python objects"):
        distributed.load_sharded(path, sharded, engine)
    extra = distributed.load_sharded(path, sharded, engine, weights_only=False)
    assert isinstance(extra["hparams"], _Hyperparameters)


class _Hyperparameters:
    pass


def test_a_save_that_fails_while_writing_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    sharded, engine = trained(1)
    path = tmp_path / "last.ckpt"
    distributed.save_sharded(path, sharded, engine, {"step": 1})
    before = training_state(sharded, engine)
    train(sharded, engine, batches(steps=1, micro=1, seed=5))
    written = FileSystemWriter.write_data

    def fails_midway(self, plan, planner):
        written(self, plan, planner).wait()  # the shards are on disk, the index not yet
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", fails_midway)
    with pytest.raises(CheckpointError, match=r"saving the sharded checkpoint failed on rank 0: OSError: .* No space"):
        distributed.save_sharded(path, sharded, engine, {"step": 2})
    monkeypatch.undo()
    assert [p.name for p in path.iterdir()] == [current_version(path).name]  # the failed version is gone
    assert distributed.load_sharded(path, sharded, engine) == {"step": 1}
    assert differences(training_state(sharded, engine), before) == []


def test_a_save_that_fails_before_publishing_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    sharded, engine = trained(1)
    path = tmp_path / "last.ckpt"
    distributed.save_sharded(path, sharded, engine, {"step": 1})

    def no_publishing(*args):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(sharded_format, "publish_version", no_publishing)
    with pytest.raises(CheckpointError, match="saving the sharded checkpoint failed on rank 0: OSError"):
        distributed.save_sharded(path, sharded, engine, {"step": 2})
    assert len(list(path.iterdir())) == 1 and distributed.load_sharded(path, sharded, engine) == {"step": 1}


@pytest.mark.slow  # 22 kill points, a save and a load each: 7 s, the fast tier's longest
def test_a_kill_at_any_step_of_a_save_leaves_a_checkpoint_and_the_next_save_cleans_up(tmp_path):
    sharded, engine = trained(1)
    path = tmp_path / "last.ckpt"
    crashes = 0
    for step in range(1, 100):
        for after in (False, True):
            distributed.save_sharded(path, sharded, engine, {"value": 1})
            if not crash_at(step, after, lambda: distributed.save_sharded(path, sharded, engine, {"value": 2})):
                assert crashes >= 20, f"only {crashes} crash points in a save"  # observed: 22
                return
            crashes += 1
            assert distributed.load_sharded(path, sharded, engine)["value"] in (1, 2), (step, after)
            distributed.save_sharded(path, sharded, engine, {"value": 3})
            assert distributed.load_sharded(path, sharded, engine) == {"value": 3}
            assert [p.name for p in path.iterdir()] == [current_version(path).name], (step, after)
    pytest.fail("the save never completed")


def test_a_damaged_missing_or_foreign_file_is_named_before_anything_is_loaded(tmp_path):
    sharded, engine = trained(1)
    path = tmp_path / "last.ckpt"
    distributed.save_sharded(path, sharded, engine, {})
    shard = version_file(path, "__0_0.distcp")
    good = shard.read_bytes()
    before = full_state(sharded)
    other, other_engine = trained(1, seed=3)
    cases = {
        good[:-10]: "has {} bytes, its record in meta.pt says",
        good[:100] + bytes([good[100] ^ 1]) + good[101:]: "does not match its checksum in meta.pt",
    }
    for damaged, message in cases.items():
        shard.write_bytes(damaged)
        with pytest.raises(CheckpointError, match=message.format(len(damaged))):
            distributed.load_sharded(path, other, other_engine)
    shard.unlink()
    with pytest.raises(CheckpointError, match=r"__0_0.distcp of the checkpoint is missing"):
        distributed.load_sharded(path, other, other_engine)
    assert all(torch.equal(full_state(sharded)[k], v) for k, v in before.items())
    # The index decides the format: without it the readers of the other formats said "saved with
    # offload_params=True ... resume with offload_params=True", also to a run doing just that.
    distributed.save_sharded(path, sharded, engine, {})
    version_file(path, DCP_METADATA).unlink()
    with pytest.raises(CheckpointError, match=r"\.metadata of the checkpoint is missing .* copy the checkpoint"):
        export.convert_checkpoint_to_fp32_state_dict(path)
    with pytest.raises(CheckpointError, match=r"\.metadata of the checkpoint is missing"):
        load_zero2(path)


def test_a_checkpoint_of_another_model_is_refused_before_anything_is_loaded(tmp_path):
    sharded, engine = trained(1)
    distributed.save_sharded(tmp_path / "last.ckpt", sharded, engine, {})
    wider = sharded_copy(Blocks(width=24))
    wider_engine = make_engine(wider)
    before = full_state(wider)
    with pytest.raises(CheckpointError, match=r"'model.embed.weight' has shape \(16, 8\) in the checkpoint"):
        distributed.load_sharded(tmp_path / "last.ckpt", wider, wider_engine)
    assert all(torch.equal(full_state(wider)[k], v) for k, v in before.items())


def test_a_weights_only_save_holds_the_model_and_is_refused_as_a_resume(tmp_path):
    sharded, engine = trained(2)
    path = tmp_path / "weights.ckpt"
    distributed.save_sharded(path, sharded, engine, {}, with_optimizer=False)
    fresh = sharded_copy(Blocks())
    fresh_engine = make_engine(fresh)
    with pytest.raises(CheckpointError, match="holds the model only .* load it with with_optimizer=False"):
        distributed.load_sharded(path, fresh, fresh_engine)
    distributed.load_sharded(path, fresh, fresh_engine, with_optimizer=False)
    assert all(torch.equal(full_state(fresh)[k], v) for k, v in full_state(sharded).items())
    assert fresh_engine.slots[0].step == 0 and "optimizer_state" not in distributed.load_sharded_full(path)


def test_the_whole_state_is_what_the_full_format_holds_and_torch_adamw_takes_it(tmp_path):
    sharded, engine = trained(3)
    distributed.save_sharded(tmp_path / "last.ckpt", sharded, engine, EXTRA)
    whole = distributed.load_sharded_full(tmp_path / "last.ckpt")
    model, optimizer = full_model_state(sharded), full_optimizer_state(engine)
    assert list(whole["state_dict"]) == list(model)
    assert all(torch.equal(whole["state_dict"][k], v) for k, v in model.items())
    assert whole["optimizer_state"]["param_groups"] == optimizer["param_groups"]
    assert sorted(whole["optimizer_state"]["state"]) == sorted(optimizer["state"])
    for index, entry in optimizer["state"].items():
        assert all(torch.equal(whole["optimizer_state"]["state"][index][k], v) for k, v in entry.items())
    assert whole["engine_state"]["step_calls"] == 3 and whole["extra"]["epoch"] == 2
    plain = Blocks()
    plain.load_state_dict(whole["state_dict"])
    torch.optim.AdamW(two_groups(plain)).load_state_dict(whole["optimizer_state"])


class Tied(Blocks):
    """An output layer sharing the input layer's weight (as a language model's head shares its embedding)."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(16, 8, bias=False)
        self.out.weight = self.embed.weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_export_writes_the_fp32_state_dict_one_tensor_at_a_time(tmp_path, capsys, dtype):
    torch.manual_seed(0)
    sharded = sharded_copy(Tied(), dtype)
    engine = make_engine(sharded, cpu_state="bf16" if dtype == torch.bfloat16 else "fp32")
    distributed.save_sharded(tmp_path / "last.ckpt", sharded, engine, {})
    export.main([str(tmp_path / "last.ckpt"), str(tmp_path / "model.pt")])
    assert "wrote 21 tensors" in capsys.readouterr().out
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    want = full_model_state(sharded)
    assert list(exported) == list(want) and all(t.dtype == torch.float32 for t in exported.values())
    assert all(torch.equal(exported[k], v.float()) for k, v in want.items())  # bf16 widens exactly
    assert exported["out.weight"].data_ptr() == exported["embed.weight"].data_ptr()  # tied: written once
    plain = Tied()
    plain.load_state_dict(exported)


def test_the_other_formats_name_this_one_and_it_names_them(tmp_path):
    sharded, engine = trained(1)
    distributed.save_sharded(tmp_path / "last.ckpt", sharded, engine, {})
    with pytest.raises(CheckpointError, match=r"was saved with offload_params=True .*distributed.load_sharded_full"):
        load_zero2(tmp_path / "last.ckpt")
    save_sharded_one_rank(tmp_path / "zero2.ckpt", 1.0)
    assert not distributed.is_distributed_checkpoint(tmp_path / "zero2.ckpt")
    with pytest.raises(CheckpointError, match=r"is not a checkpoint of offload_params=True"):
        distributed.load_sharded_full(tmp_path / "zero2.ckpt")
    with pytest.raises(CheckpointError, match="to a local or mounted path only"):
        distributed.save_sharded("memory://bucket/last.ckpt", sharded, engine, {})
