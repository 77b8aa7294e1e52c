"""Crash safety of checkpoint writes, and the sharded format read back at another world size."""

import lightning as L
import pytest
import torch
from helpers import QUIET, Classifier, loader

import lightning_zero_offload.strategy as strategy_module
from lightning_zero_offload import ZeroOffloadStrategy, convert_checkpoint_to_fp32_state_dict
from lightning_zero_offload.engine import checkpoint as ckpt


def test_atomic_save_never_leaves_a_half_written_file(tmp_path, monkeypatch):
    path = tmp_path / "model.ckpt"
    ckpt.atomic_save({"w": torch.ones(3)}, path)

    def crash(obj, f):
        f.write(b"partial bytes")
        raise KeyboardInterrupt  # killed mid-write

    monkeypatch.setattr(ckpt.torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        ckpt.atomic_save({"w": torch.zeros(3)}, path)
    monkeypatch.undo()
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["model.ckpt"]  # no temporary left behind


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, fmt):
    trainer = L.Trainer(strategy=ZeroOffloadStrategy(checkpoint_format=fmt), max_steps=3, **QUIET)
    model = Classifier()
    trainer.fit(model, loader())
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    before = convert_checkpoint_to_fp32_state_dict(path)

    calls = []

    def crash_on_second_file(obj, target):
        calls.append(target)
        if len(calls) == 1 and fmt == "sharded":
            return ckpt.atomic_save(obj, target)  # the shard gets written, the metadata does not
        raise OSError("disk full")

    monkeypatch.setattr(strategy_module, "atomic_save", crash_on_second_file)
    with pytest.raises(OSError, match="disk full"):
        trainer.save_checkpoint(path)
    monkeypatch.undo()
    after = convert_checkpoint_to_fp32_state_dict(path)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_sharded_shard_math_matches_full_tensors(tmp_path):
    """Shard files reassembled by name give the full parameters and torch-format optimizer state."""
    trainer = L.Trainer(
        strategy=ZeroOffloadStrategy(checkpoint_format="sharded", bucket_size_mb=0.001), max_steps=2, **QUIET
    )
    model = Classifier(width=7)
    trainer.fit(model, loader())
    trainer.save_checkpoint(tmp_path / "s.ckpt")
    loaded = ckpt.load_sharded(tmp_path / "s.ckpt")
    for name, p in model.named_parameters():
        assert torch.equal(loaded["state_dict"][name], p.detach())
    state = loaded["optimizer_states"][0]["state"]
    assert float(state[0]["step"]) == 2 and state[0]["exp_avg"].shape == next(model.parameters()).shape
