"""The exports (checkpoints/export.py): zero-offload-convert's refusals and one-line errors, and the same
refusals from the Python function; the Hugging Face folder from each format (the files themselves:
test_hugging_face.py)."""

from unittest.mock import patch

import pytest
import torch
from checkpoint_helpers import full_checkpoint, load_w, save, save_sharded_one_rank
from offload_params_helpers import Blocks, make_engine, one_rank_group, sharded_copy

from lightning_zero_offload import checkpoints as ckpt
from lightning_zero_offload import convert_checkpoint_to_fp32_state_dict, export_hugging_face
from lightning_zero_offload.checkpoints import CheckpointError, distributed, export
from lightning_zero_offload.checkpoints.distributed import TensorByTensor
from lightning_zero_offload.engine.offload_params.full_state import full_model_state
from lightning_zero_offload.engine.offload_params.pretrained import open_checkpoint


def convert(capsys, *argv) -> tuple[int, str]:
    try:
        export.main([str(a) for a in argv])
        code = 0
    except SystemExit as done:
        code = done.code
    captured = capsys.readouterr()
    return code, captured.err


def test_convert_refuses_to_overwrite_its_input_or_a_training_checkpoint(tmp_path, capsys, monkeypatch):
    path = tmp_path / "last.ckpt"
    ckpt.atomic_save(full_checkpoint(1.0), path)
    before = path.read_bytes()
    (tmp_path / "alias.ckpt").symlink_to(path)
    monkeypatch.chdir(tmp_path)
    for output in (path, tmp_path / "alias.ckpt", "last.ckpt", tmp_path / "sub" / ".." / "last.ckpt"):
        code, err = convert(capsys, path, output)
        assert code != 0 and "refusing to write" in err and "the checkpoint itself" in err, output
    other = tmp_path / "other.ckpt"
    ckpt.atomic_save(full_checkpoint(2.0), other)
    code, err = convert(capsys, path, other)
    assert code != 0 and "is a training checkpoint" in err
    assert path.read_bytes() == before and torch.equal(
        torch.load(other, weights_only=True)["state_dict"]["w"], 2 * torch.ones(5)
    )
    assert convert(capsys, path, other, "--overwrite")[0] == 0
    assert torch.equal(torch.load(other, weights_only=True)["w"], torch.ones(5))
    sharded = tmp_path / "s.ckpt"
    save_sharded_one_rank(sharded, 1.0)
    assert "is a directory" in convert(capsys, path, sharded)[1]
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    assert "is not an fp32 state dict" in convert(capsys, path, notes)[1] and notes.read_text() == "mine"
    assert convert(capsys, path, other)[0] == 0  # an earlier export is replaced without asking


def test_convert_gives_one_line_errors_for_bad_inputs(tmp_path, capsys):
    junk = tmp_path / "notes.txt"
    junk.write_text("not a checkpoint")
    not_lightning = tmp_path / "tensor.pt"
    torch.save(torch.ones(2), not_lightning)
    cases = {
        tmp_path / "missing.ckpt": "does not exist",
        junk: "is not a PyTorch checkpoint",
        tmp_path: "is a directory, not a checkpoint file",
        not_lightning: "not a checkpoint dict",
    }
    for source, message in cases.items():
        code, err = convert(capsys, source, tmp_path / "out.pt")
        assert code == 1 and message in err and str(source) in err, (source, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out.pt").exists()


def test_the_python_export_refuses_what_the_cli_refuses_with_the_same_message(tmp_path, capsys):
    path = tmp_path / "last.ckpt"
    ckpt.atomic_save(full_checkpoint(1.0), path)
    before = path.read_bytes()
    other = tmp_path / "other.ckpt"
    ckpt.atomic_save(full_checkpoint(2.0), other)
    sharded = tmp_path / "s.ckpt"
    save_sharded_one_rank(sharded, 1.0)
    for output in (path, other, sharded):
        with pytest.raises(CheckpointError, match=rf"refusing to write {output}: ") as error:
            convert_checkpoint_to_fp32_state_dict(path, output)
        code, err = convert(capsys, path, output)
        assert code != 0
        cli_message = err.removeprefix("zero-offload-convert: error: ").strip()
        assert cli_message == str(error.value).replace("overwrite=True", "--overwrite"), output
    assert path.read_bytes() == before
    assert torch.equal(torch.load(other, weights_only=True)["state_dict"]["w"], torch.full((5,), 2.0))
    convert_checkpoint_to_fp32_state_dict(path, other, overwrite=True)
    assert torch.equal(torch.load(other, weights_only=True)["w"], torch.ones(5))
    with pytest.raises(CheckpointError, match="the checkpoint itself"):
        convert_checkpoint_to_fp32_state_dict(path, path, overwrite=True)


# -- the Hugging Face folder ---------------------------------------------------------------------------------


def read_folder(folder) -> dict[str, torch.Tensor]:
    with open_checkpoint(folder) as checkpoint:
        return {name: checkpoint.read(name, None, None) for name in checkpoint.shapes}


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_the_folder_holds_what_the_fp32_export_holds_under_the_prefix(tmp_path, capsys, fmt):
    path = tmp_path / "last.ckpt"
    save(fmt, path, 3.0)
    weight_map = export_hugging_face(path, tmp_path / "hf")
    assert weight_map == {"w": "model.safetensors"} and torch.equal(read_folder(tmp_path / "hf")["w"], load_w(path))
    with pytest.raises(CheckpointError, match=r"no name in .* starts with prefix 'model\.'; its first names: w"):
        export_hugging_face(path, tmp_path / "other", prefix="model.")
    assert not (tmp_path / "other").exists()
    code, err = convert(capsys, path, tmp_path / "hf", "--safetensors")
    assert code == 1 and "holds weights already (model.safetensors); overwrite=True (--overwrite)" in err
    assert convert(capsys, path, tmp_path / "hf", "--safetensors", "--overwrite", "--dtype", "bfloat16")[0] == 0
    assert read_folder(tmp_path / "hf")["w"].dtype == torch.bfloat16
    refusal = "it is a checkpoint; name a new folder" if fmt == "sharded" else "it is a file, not a folder"
    with pytest.raises(CheckpointError, match=refusal):  # into the checkpoint itself
        export_hugging_face(path, path)
    code, err = convert(capsys, path, tmp_path / "x", "--prefix", "model.")
    assert code == 2 and "--prefix applies to --safetensors exports only" in err and not (tmp_path / "x").exists()


def test_bf16_master_weights_of_a_full_file_are_widened_as_written(tmp_path):
    weights = torch.randn(3, 4).bfloat16()  # cpu_state="bf16" saves its master weights as they are
    ckpt.atomic_save({"state_dict": {"model.w": weights, "model.steps": torch.arange(2)}}, tmp_path / "bf16.ckpt")
    export_hugging_face(tmp_path / "bf16.ckpt", tmp_path / "hf", prefix="model.")
    written = read_folder(tmp_path / "hf")
    assert written["w"].dtype == torch.float32 and torch.equal(written["w"], weights.float())
    assert torch.equal(written["steps"], torch.arange(2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_checkpoint_of_offload_params_is_written_one_tensor_at_a_time(tmp_path, capsys, dtype):
    with one_rank_group():
        torch.manual_seed(0)
        sharded = sharded_copy(Blocks(), dtype)
        engine = make_engine(sharded, cpu_state="bf16" if dtype == torch.bfloat16 else "fp32")
        distributed.save_sharded(tmp_path / "last.ckpt", sharded, engine, {})
        want = {k: v.float() for k, v in full_model_state(sharded).items() if k.startswith("blocks.")}
    export.main([str(tmp_path / "last.ckpt"), str(tmp_path / "hf"), "--safetensors", "--prefix", "blocks."])
    assert "wrote 16 tensors in 1 file(s)" in capsys.readouterr().out
    fetched = []
    original = TensorByTensor.fetch
    with patch.object(TensorByTensor, "fetch", lambda self, n: fetched.append(n) or original(self, n)):
        weight_map = export_hugging_face(tmp_path / "last.ckpt", tmp_path / "shards", max_shard_size=1000)
    assert len(set(weight_map.values())) > 2 and len(fetched) == len(weight_map)  # each tensor read once
    for folder, prefix in ((tmp_path / "hf", "blocks."), (tmp_path / "shards", "")):
        written = read_folder(folder)
        assert {prefix + name for name in written} >= set(want)
        assert all(torch.equal(written[k.removeprefix(prefix)], v) for k, v in want.items())  # bf16 widened exactly
