"""Issue 15, Python API: bad or unusual inputs to criteria, composition, configs, windows, executors, moment
sources and the model wrapper give a clear one-line error (or the correct behaviour), never a traceback from
deep inside or a silently wrong result. One :class:`~tests.bad_inputs.Case` per kind."""

from __future__ import annotations

import functools
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

import qada
from qada.attention import EXECUTORS, decode_attention
from qada.criteria import CRITERIA, Not
from qada.models.apply import build_run
from qada.models.generation import generate_timed
from qada.moments import MOMENT_SOURCES
from qada.registry import load_config
from qada.step import DecodeStep
from qada.window import Window
from tests.bad_inputs import Case, CliCase, check_case, check_cli_case, ids
from tests.tiny_models import tiny_model

WINDOW = {"t_local": 8, "t_sink": 2}


def holds(predicate):
    """A ``check`` asserting ``predicate(result)``."""

    def check(result) -> None:
        assert predicate(result), result

    return check


def nested_not(depth: int) -> dict:
    spec: object = "dense"
    for _ in range(depth):
        spec = {"name": "not", "criterion": spec}
    return spec  # type: ignore[return-value]


def nested_not_instances(depth: int) -> Not:
    criterion = CRITERIA.build("dense")
    for _ in range(depth):
        criterion = Not(criterion)
    return criterion  # type: ignore[return-value]


def step(batch: int = 2, T: int = 20) -> DecodeStep:
    torch.manual_seed(0)
    return DecodeStep(torch.randn(batch, 4, 16), torch.randn(batch, 2, T, 16), 0.25, Window(8, 2),
                      values=torch.randn(batch, 2, T, 16))


def enable_on_tiny(criterion) -> None:
    run = qada.enable(tiny_model("llama"), criterion=criterion, moments="none", window=WINDOW)
    run.remove()


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def generate_with_qada(model, ids_: torch.Tensor, new: int, timed: bool = False):
    with qada.apply(model, criterion="oracle", moments="none", window=WINDOW) as run:
        with torch.no_grad():
            if timed:
                out, _ = generate_timed(model, ids_, new, cache="static")
            else:
                out = model.generate(ids_, max_new_tokens=new, do_sample=False)
    return out, run.summary()


ALL_SLIDING = "every attention layer of MistralForCausalLM attends over a sliding window"


def beyond_sliding_window(model, timed: bool):
    """10 + 10 tokens on a model whose window is shorter: native tokens, qada's (oracle), its summary and the
    warnings raised while qada was attached."""
    ids_ = torch.randint(1, 128, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        native = generate_timed(model, ids_, 10, cache="static")[0] if timed else model.generate(
            ids_, max_new_tokens=10, do_sample=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, summary = generate_with_qada(model, ids_, 10, timed)
    return native, out, summary, [str(w.message) for w in caught]


def check_passes_through(all_sliding: bool):
    """The sliding layers pass through: with no global layer the tokens are the native ones and qada warns; on a
    hybrid model the sliding layers count as local in ``sparsity_all_layers``."""

    def check(result) -> None:
        native, out, summary, caught = result
        assert out.shape == (1, 20)
        warned = any(ALL_SLIDING in message for message in caught)
        if all_sliding:
            assert torch.equal(out, native), (out, native)
            assert warned, caught
            assert summary["decode_steps"] == 0 and summary["sparsity_all_layers"] == 1.0
            assert summary["global_layers"] == [] and summary["sliding_layers"] == [0, 1]
        else:
            assert not any("sliding window" in message for message in caught), caught
            assert summary["decode_steps"] == 9 and summary["global_layers"] == [2, 5]
            per_layer = summary["sparsity_per_layer"]
            assert summary["sparsity_all_layers"] == pytest.approx((sum(per_layer.values()) + 4) / 6)

    return check


def one_token_prompt(timed: bool):
    model = tiny_model("llama")
    ids_ = torch.tensor([[5]])
    with torch.no_grad():
        dense = model.generate(ids_, max_new_tokens=4, do_sample=False)
    out, summary = generate_with_qada(model, ids_, 4, timed)
    return dense, out, summary


def check_one_token(result) -> None:
    dense, out, summary = result
    assert torch.equal(out, dense), (out, dense)  # no bulk yet: the window is the whole cache, exactly dense
    assert summary["sparsity"] == 1.0


CASES = [
    # --- composition and layer overrides -----------------------------------------------------------------------
    Case("api_not_nested_2000_deep", lambda tmp: CRITERIA.build(nested_not(2000)), ValueError,
         r"at most 64 levels deep"),
    Case("api_not_instances_nested_too_deep", lambda tmp: nested_not_instances(80), ValueError,
         r"at most 64 levels deep but got 65"),
    Case("api_not_nested_at_the_limit_works", lambda tmp: CRITERIA.build(nested_not(63))(step()),
         check=holds(lambda local: bool(local.all()))),  # 63 nots of dense: local everywhere
    Case("api_layer_override_float_layer",
         lambda tmp: CRITERIA.build("layer_override", base="dense", overrides={1.7: "local"}), ValueError,
         r"integer layer indices in overrides but got 1\.7"),
    Case("api_layer_override_bool_layer",
         lambda tmp: CRITERIA.build("layer_override", base="dense", overrides={True: "local"}), ValueError,
         r"integer layer indices in overrides but got True"),
    Case("api_layer_override_negative_layer",
         lambda tmp: CRITERIA.build("layer_override", base="dense", overrides={-1: "local"}), ValueError,
         r"non-negative layer indices in overrides but got -1"),
    Case("api_layer_override_layer_twice",
         lambda tmp: CRITERIA.build("layer_override", base="dense", overrides={1: "local", "1": "dense"}),
         ValueError, r"each layer once in overrides but got layer 1 twice"),
    Case("api_layer_override_beyond_the_model",
         lambda tmp: enable_on_tiny({"name": "layer_override", "base": "dense", "overrides": {5: "local"}}),
         ValueError, r"override layers below the model's 2 layers but got \[5\]"),
    Case("api_static_mask_of_another_shape",
         lambda tmp: enable_on_tiny({"name": "static", "mask": [[True] * 4] * 3}), ValueError,
         r"static mask of shape \[2, 4\] for this model but got \[3, 4\]"),
    Case("api_static_mask_given_as_a_path", lambda tmp: CRITERIA.build("static", mask=str(tmp / "m.safetensors")),
         ValueError, r"but got the path .*load_head_mask"),
    Case("api_static_mask_ragged", lambda tmp: CRITERIA.build("static", mask=[[True, False], [True]]), ValueError,
         r"static mask as a \[layers, heads\] grid of booleans"),
    Case("api_any_of_empty_list", lambda tmp: CRITERIA.build("any_of", criteria=[]), ValueError,
         r"non-empty list of criteria for 'any_of'"),
    # --- criterion parameters --------------------------------------------------------------------------------
    Case("api_tau_above_one", lambda tmp: CRITERIA.build("qada", tau=1.5), ValueError, r"tau in \[0, 1\] but got 1.5"),
    Case("api_tau_nan", lambda tmp: CRITERIA.build("oracle", tau=float("nan")), ValueError,
         r"tau in \[0, 1\] but got nan"),
    Case("api_tau_as_string", lambda tmp: CRITERIA.build("qada", tau="0.5"), ValueError,
         r"tau in \[0, 1\] but got '0.5'"),
    Case("api_criterion_unknown_parameter", lambda tmp: CRITERIA.build("qada", tua=0.5), ValueError,
         r"unknown parameter\(s\) \['tua'\]; expected some of \['tau'\]"),
    # --- registry specs and config files ---------------------------------------------------------------------
    Case("api_unknown_criterion_suggests", lambda tmp: CRITERIA.build("qadda"), ValueError,
         r"unknown criterion 'qadda'; expected one of .*; did you mean 'qada'\?"),
    Case("api_unknown_executor_suggests", lambda tmp: EXECUTORS.build("spda"), ValueError,
         r"unknown executor 'spda'.*did you mean 'sdpa'\?"),
    Case("api_spec_name_not_a_string", lambda tmp: CRITERIA.build({"name": ["qada"]}), ValueError,
         r"criterion name \(a string\) but got list"),
    Case("api_spec_not_a_mapping_or_name", lambda tmp: CRITERIA.build(5), TypeError,
         r"criterion instance, name or config dict but got int"),
    Case("api_spec_without_name", lambda tmp: CRITERIA.build({"tau": 0.5}), ValueError,
         r"config with a 'name' key but got keys \['tau'\]"),
    Case("api_config_yaml_is_a_list", lambda tmp: load_config(write(tmp / "c.yaml", "- qada\n- dense\n")),
         ValueError, r"YAML mapping .* but got list"),
    Case("api_config_yaml_empty", lambda tmp: load_config(write(tmp / "c.yaml", "")), ValueError,
         r"YAML mapping .* but got an empty document"),
    Case("api_config_yaml_syntax_error", lambda tmp: load_config(write(tmp / "c.yaml", "criterion: [qada\n")),
         ValueError, r"could not parse the YAML config file .* at line 2"),
    Case("api_config_is_a_directory", lambda tmp: load_config(str(tmp)), ValueError, r"is a directory"),
    Case("api_config_unknown_key", lambda tmp: build_run(config={"criterion": "dense", "windw": {}}), ValueError,
         r"unknown config key\(s\) \['windw'\]"),
    Case("api_moments_none_for_qada", lambda tmp: build_run(criterion="qada", moments="none"), ValueError,
         r"needs a moment source but moments is None"),
    # --- windows -----------------------------------------------------------------------------------------------
    Case("api_window_as_list", lambda tmp: build_run(criterion="dense", moments="none", window=[128, 16]),
         ValueError, r"window as a mapping \{t_local: \.\.\., t_sink: \.\.\.\} .* but got list \[128, 16\]"),
    Case("api_window_list_in_config",
         lambda tmp: build_run(config={"criterion": "dense", "moments": "none", "window": [128, 16]}), ValueError,
         r"window as a mapping .* but got list"),
    Case("api_window_unknown_key", lambda tmp: build_run(criterion="dense", moments="none", window={"t_locl": 64}),
         ValueError, r"unknown window key\(s\) \['t_locl'\]"),
    Case("api_window_t_local_zero", lambda tmp: Window.from_config({"t_local": 0}), ValueError,
         r"t_local >= 1 but got 0"),
    Case("api_window_t_sink_negative", lambda tmp: Window(64, -1), ValueError, r"t_sink >= 0 but got -1"),
    Case("api_window_float", lambda tmp: Window.from_config({"t_local": 64.0}), TypeError,
         r"t_local to be an int but got float"),
    Case("api_window_sink_beyond_local", lambda tmp: Window(8, 9), ValueError, r"t_sink <= t_local"),
    # --- executors ---------------------------------------------------------------------------------------------
    Case("api_sdpa_splits_zero", lambda tmp: EXECUTORS.build("sdpa", splits=0), ValueError,
         r"splits to be an int >= 1 but got 0"),
    Case("api_unknown_group_policy", lambda tmp: EXECUTORS.build("reference", group_policy="majority"), ValueError,
         r"group_policy in \('exact', 'promote'\) but got 'majority'"),
    Case("api_triton_num_warps_not_power_of_two", lambda tmp: EXECUTORS.build("triton", num_warps=3), ValueError,
         r"num_warps to be a power of two but got 3"),
    Case("api_flex_block_size_not_power_of_two", lambda tmp: EXECUTORS.build("flex", block_size=48), ValueError,
         r"block_size to be a power of two >= 16 but got 48"),
    Case("api_executor_empty_batch",
         lambda tmp: decode_attention(EXECUTORS.build("sdpa"), torch.randn(0, 4, 1, 16), torch.randn(0, 2, 20, 16),
                                      torch.randn(0, 2, 20, 16), torch.zeros(0, 4, dtype=torch.bool), window=(8, 2)),
         ValueError, r"at least one row and one key for attention but got batch size 0"),
    Case("api_criterion_empty_batch", lambda tmp: CRITERIA.build("oracle")(step(batch=0)),
         check=holds(lambda local: tuple(local.shape) == (0, 4))),  # criteria decide an empty batch correctly
    # --- moment sources ----------------------------------------------------------------------------------------
    Case("api_stored_negative_offset", lambda tmp: MOMENT_SOURCES.build("stored", offset=-1), ValueError,
         r"offset to be an int >= 0 but got -1"),
    Case("api_stored_negative_length", lambda tmp: MOMENT_SOURCES.build("stored", length=-5), ValueError,
         r"length to be None or an int >= 1 but got -5"),
    Case("api_unknown_prompt_kind", lambda tmp: MOMENT_SOURCES.build("bucketed", prompt="poem"), ValueError,
         r"prompt in \['random_words', 'single_word', 'text'\] but got 'poem'"),
    Case("api_stored_path_not_a_path", lambda tmp: MOMENT_SOURCES.build("stored", path=5), ValueError,
         r"path to be None or a file path but got int 5"),
    Case("api_stored_path_is_a_directory", lambda tmp: MOMENT_SOURCES.build("stored", path=tmp), ValueError,
         r"artifact file but .* is a directory"),
    Case("api_bucket_size_zero", lambda tmp: MOMENT_SOURCES.build("bucketed", bucket_size=0), ValueError,
         r"bucket_size to be an int >= 1 but got 0"),
    Case("api_current_update_every_zero", lambda tmp: MOMENT_SOURCES.build("current", update_every=0), ValueError,
         r"update_every to be an int >= 1 but got 0"),
    # --- the model wrapper and generation ----------------------------------------------------------------------
    Case("api_one_token_prompt", lambda tmp: one_token_prompt(timed=False), check=check_one_token),
    Case("api_one_token_prompt_static_cache", lambda tmp: one_token_prompt(timed=True), check=check_one_token),
    # sliding-window layers pass through untouched (no longer refused beyond the window); qada decides on the
    # global layers only, and warns when there is none
    Case("api_mistral_beyond_sliding_window",
         lambda tmp: beyond_sliding_window(tiny_model("mistral", sliding_window=16), timed=False),
         check=check_passes_through(all_sliding=True)),
    Case("api_generate_beyond_sliding_window",
         lambda tmp: beyond_sliding_window(tiny_model("mistral", sliding_window=16), timed=True),
         check=check_passes_through(all_sliding=True)),
    Case("api_hybrid_beyond_sliding_window",
         lambda tmp: beyond_sliding_window(tiny_model("gemma3", window=8), timed=True),
         check=check_passes_through(all_sliding=False)),
    Case("api_generate_beyond_max_positions",
         lambda tmp: generate_timed(tiny_model("llama", max_position_embeddings=32), torch.randint(0, 128, (1, 30)), 4),
         ValueError, r"prompt \+ new tokens <= the model's 32 positions \(max_position_embeddings\) .* = 34"),
    Case("api_generate_empty_batch",
         lambda tmp: generate_timed(tiny_model("llama"), torch.zeros(0, 5, dtype=torch.long), 2), ValueError,
         r"input_ids of shape \[batch >= 1, tokens\] but got \(0, 5\)"),
    Case("api_generate_empty_prompt",
         lambda tmp: generate_timed(tiny_model("llama"), torch.zeros(1, 0, dtype=torch.long), 2), ValueError,
         r"a prompt of at least one token but got an empty prompt"),
]


@functools.cache
def tiny_model_path() -> str:
    """A tiny Llama with 64 positions saved with the embedded tokenizer (once per session, for the CLI rows)."""
    from transformers import AutoTokenizer

    from qada.models.loading import model_directory

    tokenizer = AutoTokenizer.from_pretrained(model_directory(None))
    folder = tempfile.TemporaryDirectory(prefix="qada-tiny-")
    tiny_model_path.folder = folder  # type: ignore[attr-defined] - kept alive (and removed) with the function
    tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=64).save_pretrained(folder.name)
    tokenizer.save_pretrained(folder.name)
    return folder.name


def generate_argv(tmp: Path, prompt: str, *extra: str) -> list[str]:
    return ["generate", "--prompt-file", write(tmp / "prompt.txt", prompt), "--model", tiny_model_path(),
            "--criterion", "oracle", "--moments", "none", "--max-new-tokens", "4", *extra]


CLI_CASES = [
    CliCase("api_cli_generate_prompt_beyond_max_positions", lambda tmp: generate_argv(tmp, "one two three " * 40),
            r"qada generate: error: expected prompt \+ new tokens <= the model's 64 positions"),
    CliCase("api_cli_generate_empty_prompt", lambda tmp: generate_argv(tmp, ""),
            r"qada generate: error: expected a prompt of at least one token"),
    CliCase("api_cli_generate_window_list_in_config",
            lambda tmp: ["generate", "--prompt-file", write(tmp / "p.txt", "hi"), "--config",
                         write(tmp / "c.yaml", "criterion: dense\nwindow: [128, 16]\n")],
            r"window as a mapping .* but got list \[128, 16\]"),
]


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_bad_input(case, tmp_path):
    check_case(case, tmp_path)


@pytest.mark.parametrize("case", CLI_CASES, ids=ids(CLI_CASES))
def test_bad_command_line(case, tmp_path, capsys):
    check_cli_case(case, tmp_path, capsys)
