"""Every decoder family of the installed transformers: the model itself under qada, or a clear error at apply.

The matrix (:mod:`family_matrix`) builds each family tiny from its config and checks it; this module says what
must hold for each row and that the docs' supported-models table says the same. A transformers release that adds a
family adds a row here: one that qada serves differently from the model fails, and so does one the table lacks.
"""

from __future__ import annotations

import contextlib
import io
import warnings

import pytest
from family_matrix import EXCLUDED, TABLE, check_family, families, parse_table

import qada
from qada.models.guards import UnsupportedModelError

# No tiny random model of these can be built from their configs with the matrix's generic sizes (their configs
# validate layouts the sizes break, or the unwrapped model does not decode step by step): untested, and the docs'
# table says so. A family that starts to build must leave this list.
UNBUILT = {"cohere_compass_text", "gemma3n_text", "gemma4_assistant", "gemma4_unified_assistant", "lfm2_moe",
           "recurrent_gemma", "zamba", "zamba2"}

MATRIX = [f for f in families() if f not in EXCLUDED]


@pytest.fixture(scope="module")
def documented() -> dict[str, str]:
    text = TABLE.read_text()
    assert "<!-- family-table -->" in text, f"{TABLE} lost its family table"
    return parse_table(text)


@pytest.mark.parametrize("family", MATRIX)
def test_each_family_is_the_model_or_a_clear_error_at_apply(family, documented):
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        result = check_family(family)
    assert result.status != "failed", f"{family}: {result.detail}"
    assert (result.status == "unbuilt") == (family in UNBUILT), f"{family}: {result.status} {result.detail}"
    if result.status == "refused":  # one line naming what is not supported
        assert "\n" not in result.detail and len(result.detail) > 40, result.detail
    word = {"supported": "supported", "refused": "refused", "unbuilt": "untested"}[result.status]
    assert documented.get(family) == word, (f"{family} is {result.status} but the table in {TABLE.name} says "
                                            f"{documented.get(family)!r}: rerun python tests/family_matrix.py --write")


def test_the_table_lists_every_family_of_the_matrix_and_no_other(documented):
    assert sorted(documented) == sorted(MATRIX)


@pytest.mark.parametrize("family, feature", [("gpt_oss", "`s_aux`"), ("gemma2", "`softcap`")])
def test_sinks_and_soft_capping_are_supported_not_refused(family, feature):
    result = check_family(family)
    assert result.status == "supported" and feature in result.features, result


def test_an_unknown_attention_keyword_is_refused_at_each_call():
    from qada.models.attention_features import attention_features

    class Attention:
        pass

    assert attention_features(Attention(), {"position_ids": 1, "indices": None, "softcap": 30.0}).softcap == 30.0
    with pytest.raises(UnsupportedModelError, match=r"Attention passes indices=\.\.\. .*sparse attention"):
        attention_features(Attention(), {"indices": object()})
    with pytest.raises(UnsupportedModelError, match="passes new_thing=.*does not know"):
        attention_features(Attention(), {"new_thing": 3})
    with pytest.raises(UnsupportedModelError, match="dropout 0.1"):
        attention_features(Attention(), {}, dropout=0.1)


def test_a_mask_with_holes_inside_a_row_is_refused():
    import torch
    from tiny_models import tiny_model

    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 12))
    mask = torch.ones_like(ids)
    mask[0, 5] = 0  # what generate() infers from a pad_token_id inside the prompt
    with qada.apply(model, criterion="dense", moments="none"), pytest.raises(UnsupportedModelError, match="hides"):
        model(input_ids=ids, attention_mask=mask)
