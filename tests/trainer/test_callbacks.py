import time

import lightning as L
import pytest
import torch
from engine_helpers import CPU, make_net, options
from helpers import QUIET, Classifier, loader
from lightning.pytorch.loggers import CSVLogger

from lightning_zero_offload import OffloadMetrics, ZeroOffloadPrecision, ZeroOffloadStrategy
from lightning_zero_offload.core import OffloadSession
from lightning_zero_offload.trainer.callbacks import format_summary


def test_metrics_are_logged_per_optimizer_step_and_summary_printed(tmp_path, caplog):
    trainer = L.Trainer(
        strategy="zero_offload",
        precision="bf16-mixed",
        max_steps=6,
        accumulate_grad_batches=2,
        log_every_n_steps=1,
        **{**QUIET, "logger": CSVLogger(tmp_path)},
    )
    with caplog.at_level("INFO"):
        trainer.fit(Classifier(), loader())
    assert sum(isinstance(c, OffloadMetrics) for c in trainer.callbacks) == 1
    metrics = trainer.logged_metrics
    for name in ("cpu_step_ms", "transfer_wait_ms", "copy_back_ms", "hidden_transfer_pct", "grad_norm", "backward_ms"):
        assert f"offload/{name}" in metrics, name
    assert metrics["offload/cpu_step_ms"] > 0 and 0 <= metrics["offload/hidden_transfer_pct"] <= 100
    assert metrics["offload/grad_norm"] > 0 and metrics["offload/skipped_steps"] == 0
    assert 0 < metrics["offload/forward_ms"] < metrics["offload/step_ms"]
    assert metrics["offload/forward_ms"] + metrics["offload/backward_ms"] < metrics["offload/step_ms"]
    csv = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    assert "offload/cpu_step_ms" in csv[0] and len(csv) == 1 + 6  # one row per optimizer step, not per batch
    summary = caplog.text
    assert "16 B/param for plain mixed-precision Adam" in summary and "2.0 B/param (parameters)" in summary
    assert "per optimizer step over 6 steps" in summary and "forward" in summary


class SlowForward(Classifier):
    """A training step that takes at least FORWARD_S, before its backward."""

    FORWARD_S = 0.05

    def training_step(self, batch, batch_idx):
        time.sleep(self.FORWARD_S)
        return super().training_step(batch, batch_idx)


def test_forward_time_is_the_training_step_summed_over_the_accumulation_window(tmp_path):
    trainer = L.Trainer(
        strategy="zero_offload",
        max_steps=3,
        accumulate_grad_batches=2,
        log_every_n_steps=1,
        **{**QUIET, "logger": CSVLogger(tmp_path)},
    )
    trainer.fit(SlowForward(), loader())
    rows = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    steps = [dict(zip(header, row.split(","))) for row in rows[1:]]
    assert len(steps) == 3
    for row in steps:
        forward, backward, step = (float(row[f"offload/{k}_ms"]) for k in ("forward", "backward", "step"))
        # Two micro-batches per optimizer step, each sleeping in training_step before its backward.
        assert 2e3 * SlowForward.FORWARD_S <= forward < step
        assert forward + backward + float(row["offload/cpu_step_ms"]) <= step


def test_fp16_logs_the_loss_scale_and_metrics_can_be_turned_off():
    trainer = L.Trainer(
        strategy=ZeroOffloadStrategy(loss_scale_init=2.0**8),
        plugins=[ZeroOffloadPrecision("16-mixed")],
        max_steps=2,
        **QUIET,
    )
    trainer.fit(Classifier(), loader())
    assert trainer.logged_metrics["offload/loss_scale"] == pytest.approx(2.0**8)
    trainer = L.Trainer(strategy=ZeroOffloadStrategy(metrics=False), max_steps=2, **QUIET)
    trainer.fit(Classifier(), loader())
    assert not any(isinstance(c, OffloadMetrics) for c in trainer.callbacks)
    assert not any(k.startswith("offload/") for k in trainer.logged_metrics)


def test_summary_reports_the_hidden_share_of_transfers_as_a_percentage():
    net = make_net()
    session = OffloadSession.start(net, [torch.optim.AdamW(net.parameters())], CPU, "32-true", options(), 1, 1)
    totals = dict.fromkeys(
        ("forward", "backward", "transfer_wait", "cpu_step", "update_wait", "copy_back", "speculated_fraction", "step"),
        0.0,
    )
    totals.update(transfer=1.0, transfer_wait=0.25)
    assert "(75% of transfers hidden)" in format_summary(session, totals, 1)
    totals["transfer_wait"] = 2.8  # a wait longer than the work (thread wake-up on a busy machine): was -180%
    assert "(0% of transfers hidden)" in format_summary(session, totals, 1)
    session.close()


def test_speculation_metrics_and_summary(caplog):
    trainer = L.Trainer(
        strategy=ZeroOffloadStrategy(cpu_step="speculative", overlap=True, bucket_size_mb=0.002),
        precision="bf16-mixed",
        max_steps=8,
        gradient_clip_val=0.3,  # triggers on some steps: those are rolled back
        log_every_n_steps=1,
        **QUIET,
    )
    with caplog.at_level("INFO"):
        trainer.fit(Classifier(), loader())
    metrics = trainer.logged_metrics
    assert 0 <= metrics["offload/speculated_fraction"] <= 1
    assert metrics["offload/rollbacks"] == trainer.strategy.session.rollbacks > 0
    assert "CPU step schedule: speculative" in caplog.text and "rollback(s)" in caplog.text
