import pytest
import torch

from lightning_zero_offload.engine import DynamicLossScaler, LossScalerConfig


def test_backoff_after_hysteresis_and_growth_after_interval():
    scaler = DynamicLossScaler(LossScalerConfig(init_scale=1024, growth_interval=3, hysteresis=2, min_scale=256))
    scaler.update(overflow=True)
    assert scaler.scale == 1024  # first overflow tolerated (hysteresis 2)
    scaler.update(overflow=True)
    assert scaler.scale == 512
    for _ in range(3):
        scaler.update(overflow=False)
    assert scaler.scale == 1024
    for _ in range(6):
        scaler.update(overflow=True)
    assert scaler.scale == 256  # clamped at min_scale


def test_state_round_trip():
    a = DynamicLossScaler(LossScalerConfig(init_scale=8, hysteresis=1))
    a.update(overflow=True)
    a.update(overflow=False)
    b = DynamicLossScaler(LossScalerConfig())
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict() == {"scale": 4.0, "good_steps": 1, "hysteresis_left": 1}


def test_torch_grad_scaler_state_round_trip():
    """The state a Lightning AMP run saves loads here and back: the scale and the good steps since the last
    growth, so growth comes when torch's GradScaler would have grown."""
    ours = DynamicLossScaler(LossScalerConfig(init_scale=2.0**10, growth_interval=4))
    for _ in range(6):
        ours.update(overflow=False)  # grows at the 4th, then 2 good steps
    torch_scaler = torch.amp.GradScaler("cpu")
    torch_scaler.load_state_dict(ours.grad_scaler_state_dict())
    assert torch_scaler.get_scale() == 2.0**11
    assert torch_scaler.state_dict()["_growth_tracker"] == 2
    back = DynamicLossScaler(LossScalerConfig(growth_interval=4))
    back.load_state_dict(torch_scaler.state_dict())
    assert back.scale == 2.0**11
    back.update(overflow=False)
    back.update(overflow=False)
    assert back.scale == 2.0**12  # 2 + 2 good steps: the interval of 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"init_scale": 0}, "loss_scale_init"),
        ({"growth_factor": 1.0}, "loss_scale_growth_factor"),
        ({"backoff_factor": 1.5}, "loss_scale_backoff_factor"),
        ({"growth_interval": 0}, "loss_scale_growth_interval"),
        ({"hysteresis": 0}, "loss_scale_hysteresis"),
        ({"min_scale": 2.0**20}, "loss_scale_min"),
    ],
)
def test_invalid_config_names_the_option(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DynamicLossScaler(LossScalerConfig(**kwargs))
