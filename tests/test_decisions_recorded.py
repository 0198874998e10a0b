"""Oracle, QAdA, static and composed criteria decide exactly as before the step refactor (issue 13).

The expected decisions were recorded from main before the refactor by ``python tests/decision_cases.py``
(see that module); here today's code recomputes them and must match bit for bit.
"""

import pytest
import torch
from decision_cases import RECORDED, model_decisions, synthetic_decisions
from safetensors.torch import load_file

from qada.criteria import CRITERIA
from qada.moments import BulkMoments
from qada.step import DecodeStep


@pytest.fixture(scope="module")
def recorded():
    return load_file(str(RECORDED))


def _decide_now(spec, inputs, layer):
    step = DecodeStep(inputs["query"], inputs["keys"], 0.25, layer=layer, start=inputs["start"],
                      moments=BulkMoments(inputs["mean"], inputs["cov"]))
    return CRITERIA.build(spec)(step)


def test_synthetic_steps_decide_as_recorded(recorded):
    now = synthetic_decisions(_decide_now)
    assert now, "no synthetic cases"
    for key, decisions in now.items():
        assert torch.equal(decisions, recorded[key]), f"{key}: decisions changed"


def test_recorded_inputs_are_the_ones_the_cases_build(recorded):
    from decision_cases import synthetic_inputs

    for key, value in synthetic_inputs().items():  # float64 products may differ in the last bits between CPUs
        torch.testing.assert_close(value, recorded[f"inputs/{key}"], rtol=1e-12, atol=1e-12, msg=key)


@pytest.mark.slow
def test_embedded_model_decides_as_recorded(recorded):
    from qada.models import load_default_model

    model, tokenizer = load_default_model()
    now = model_decisions(model, tokenizer)
    for key, value in now.items():
        assert torch.equal(value, recorded[key]), (
            f"{key}: {(value != recorded[key]).sum().item()} of {value.numel()} entries changed"
        )
