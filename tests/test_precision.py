import warnings

import lightning as L
import pytest
from helpers import QUIET, Classifier, loader

import lightning_zero_offload  # noqa: F401  (registers the strategy)


def _fit_warnings(**trainer_kwargs) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = L.Trainer(strategy="zero_offload", max_steps=2, **QUIET, **trainer_kwargs)
        trainer.fit(Classifier(scheduler=False), loader(n=32))
    return [str(w.message) for w in caught]


@pytest.mark.parametrize(("kwargs", "warned"), [({}, True), ({"precision": "bf16-mixed"}, False)])
def test_fp32_default_precision_warns_and_names_what_to_pass(kwargs, warned):
    messages = [m for m in _fit_warnings(**kwargs) if "zero_offload is training in '32-true'" in m]
    assert bool(messages) == warned
    if warned:
        assert len(messages) == 1 and "precision='bf16-mixed'" in messages[0]
