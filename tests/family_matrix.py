"""Every decoder family of the installed transformers, built tiny from its config, wrapped by qada.

:func:`families` lists every entry of transformers' causal-LM mapping; :data:`EXCLUDED` says why an entry is not
a decoder-only text model (an encoder, an encoder-decoder, a multimodal wrapper whose text model is listed on its
own). :func:`tiny_family_model` builds the others with random weights (2 layers, 4 heads, 2 KV heads, head dim 16,
MoE and hybrid ones included: more layers where the default pattern has no attention layer among the first two);
:func:`check_family` runs one through the matrix and returns its :class:`FamilyResult`:

* ``supported``: with the ``dense`` criterion the tokens equal the unwrapped model's and the logits are within
  :data:`TOLERANCE`, prefill and decode, on a ``DynamicCache`` and a ``StaticCache``; ``qada`` and ``qada_tail``
  decode and report finite statistics;
* ``refused``: :func:`qada.apply` fails at once with :class:`~qada.models.guards.UnsupportedModelError`, whose
  message is recorded;
* anything else (an error while decoding, a silent difference) is a failure of the matrix.

``python tests/family_matrix.py`` runs the matrix and rewrites the docs' table (:data:`TABLE`); the tests check that
the table says what the matrix finds.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import re
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

TABLE = Path(__file__).resolve().parents[1] / "docs" / "models.md"
TOLERANCE = 1e-4  # max |logit difference| of the dense criterion against the unwrapped model
PROMPT, STEPS = 96, 6
WINDOW = {"t_local": 16, "t_sink": 4}  # a bulk of 76+ tokens at the prompt's end

SIZES = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, sliding_window=16,
    # MoE
    moe_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
    n_shared_experts=1, shared_expert_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1,
    # multi-head latent attention
    kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
)  # fmt: skip

EXCLUDED = {
    # encoders used as decoders (bidirectional by default), encoder-decoders' decoders, non-text models
    **dict.fromkeys(
        ["bert", "bert-generation", "camembert", "data2vec-text", "electra", "ernie", "roberta",
         "roberta-prelayernorm", "roc_bert", "xlm-roberta", "xlm-roberta-xl", "xmod", "big_bird", "megatron-bert",
         "rembert", "roformer", "modernbert-decoder", "reformer", "xlnet", "xlm", "bigbird_pegasus",
         "blenderbot", "blenderbot-small", "bart", "mbart", "marian", "mvp", "pegasus", "plbart", "prophetnet",
         "trocr", "whisper", "git", "cpmant"],
        "not a decoder-only text model (an encoder, or the decoder of an encoder-decoder)"),
    # multimodal wrappers: their text model is a family of its own in the matrix, or needs vision weights
    **dict.fromkeys(
        ["gemma3", "gemma3n", "gemma4", "gemma4_unified", "got_ocr2", "fuyu", "mllama", "llama4", "emu3",
         "qwen3_5", "qwen3_5_moe", "qwen4_exp", "dots3_note", "phi4_multimodal", "moss_transcribe_diarize",
         "minimax_m3_vl_text", "musicgen", "musicgen_melody", "blt"],
        "multimodal or audio: a wrapper around a text model (listed on its own where transformers has it)"),
}  # fmt: skip


@dataclass
class FamilyResult:
    """One family's row of the matrix."""

    family: str
    status: str  # "supported", "refused", "excluded", "unbuilt" (no tiny model) or "failed"
    features: list[str] = field(default_factory=list)
    detail: str = ""


def families() -> list[str]:
    """Every model type of transformers' causal-LM mapping, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def model_class(family: str):
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family])


def _attention_layers(config) -> list[int]:
    """The layers whose cache holds softmax attention keys (not linear attention, convolution or MoE-only layers)."""
    from qada.models.layer_types import OTHER_KINDS, cache_layers

    layers = cache_layers(config)
    if layers is None:
        return list(range(config.num_hidden_layers))
    return [i for i, kind in enumerate(layers[0]) if kind not in OTHER_KINDS]


def _attempts(family: str, num_layers: int, **overrides) -> list[dict]:
    """Config entries to try, most tiny first: :data:`SIZES` where the config has the entry (then with its layer
    pattern cut to ``num_layers``; then with as many KV heads as heads), else only the vocabulary and the layers."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        default = CONFIG_MAPPING[family]()
    except Exception as error:  # noqa: BLE001 - a config without defaults that validate
        raise NotBuilt(f"no tiny {family} model could be built: its default config does not validate "
                       f"({error})") from None
    defaults = default.to_dict()
    # hasattr: a config's attribute_map gives the common names (GPT-2's n_embd is its hidden_size)
    sizes = {name: value for name, value in SIZES.items() if (name in defaults or hasattr(default, name))
             and not isinstance(getattr(type(default), name, None), property)}  # not a derived property
    if "qk_rope_head_dim" in defaults:  # multi-head latent attention: head_dim is the rotary part, no GQA
        sizes["head_dim"] = SIZES["qk_rope_head_dim"]
        sizes["num_key_value_heads"] = SIZES["num_attention_heads"]
    base = {"num_hidden_layers": num_layers}
    for i, name in enumerate(("pad_token_id", "bos_token_id", "eos_token_id")):
        if defaults.get(name) is not None:
            base[name] = i
    attempts = [{**sizes, **base}]
    pattern = defaults.get("layer_types")
    if isinstance(pattern, list) and pattern:
        kinds = list(dict.fromkeys(pattern))  # each kind once, in order: every kind within the first layers
        attempts.append({**sizes, **base, "layer_types": (kinds * num_layers)[:num_layers]})
    attempts.append({**sizes, **base, "num_key_value_heads": SIZES["num_attention_heads"]})
    fix = FIXES.get(family)
    if fix is not None:
        attempts.insert(0, {**sizes, **base, **fix(num_layers)})
    return [{**attempt, **overrides} for attempt in attempts]


MAX_PARAMETERS = 20_000_000
"""A tiny model is at most this big (checked on the meta device before any weight is allocated)."""

FIXES = {
    # families whose configs validate sizes against each other
    "mamba2": lambda n: {"num_heads": 8, "head_dim": 16, "expand": 2, "n_groups": 1},
    "zaya": lambda n: {"num_experts_per_tok": 1},
    "gemma4_text": lambda n: {"vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 16},
    "gpt_neo": lambda n: {"attention_types": [[["global", "local"], n // 2]], "num_layers": n, "num_heads": 4},
    "dbrx": lambda n: {"d_model": 64, "n_heads": 4, "n_layers": n, "max_seq_len": 2048,
                       "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                       "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2}},
}  # fmt: skip


def tiny_family_model(family: str, _any: bool = False, **overrides):
    """``family``'s causal LM with random weights in float32 eval mode: the first of :func:`_attempts` that builds,
    at the fewest layers (2, 4 or 8) whose pattern holds an attention layer; ``overrides``: config entries."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    errors, without_attention = [], None
    for num_layers in (2, 4, 8):
        for values in _attempts(family, num_layers, **overrides):
            try:
                config = CONFIG_MAPPING[family](**values)
                text = config.get_text_config() if hasattr(config, "get_text_config") else config
                if not _attention_layers(text) and not _any:
                    without_attention = without_attention or values
                    continue
                with torch.device("meta"):
                    size = sum(p.numel() for p in model_class(family)(config).parameters())
                if size > MAX_PARAMETERS:
                    errors.append(f"{size} parameters with {sorted(values)}")
                    continue
                torch.manual_seed(0)
                model = model_class(family)(config).eval()
            except Exception as error:  # noqa: BLE001 - the next attempt
                errors.append(f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:200]} ({values})")
                continue
            model.generation_config.eos_token_id = None
            with torch.no_grad():  # sharper attention than a fresh init, so that heads differ
                for name, parameter in model.named_parameters():
                    if name.endswith(("q_proj.weight", "k_proj.weight")):
                        parameter.mul_(4.0)
            return model
    if without_attention is not None and not overrides:  # no attention layer at all (a state-space model)
        return tiny_family_model(family, **without_attention, _any=True)
    raise NotBuilt(f"no tiny {family} model could be built: {errors[-1] if errors else 'no attention layer'}")


class NotBuilt(RuntimeError):
    """No tiny model of a family could be built from :data:`SIZES` and :data:`FIXES`."""


def attention_keywords(model) -> list[str]:
    """The keywords the model's attention passes to the attention function (from its source), sorted."""
    from qada.models.attention_features import _attention_calls
    from qada.models.layer_types import attention_modules

    names = set()
    for cls in {type(m) for m in attention_modules(model)}:
        for call in _attention_calls(cls) or []:
            names.update(k.arg for k in call.keywords if k.arg and k.arg not in ("dropout", "scaling", "query", "key",
                                                                                 "value", "attention_mask", "module"))
    return sorted(names)


def features_of(model) -> list[str]:
    """What the table lists for a family: the attention keywords and the kinds of its layers."""
    from qada.models.layer_types import layer_types

    found = [f"`{name}`" for name in attention_keywords(model)]
    try:
        types = layer_types(model)
        if types.sliding:
            found.append("sliding layers" if types.global_layers else "every layer sliding")
    except Exception:  # noqa: BLE001 - listed only
        pass
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if len(_attention_layers(config)) < config.num_hidden_layers:
        found.append("non-attention layers")
    if any(getattr(config, name, None) for name in ("num_experts", "num_local_experts", "n_routed_experts")):
        found.append("MoE")
    return found


def _decode(model, ids, cache_kind: str, run=None):
    """Prefill ``ids`` then :data:`STEPS` greedy steps: ``(tokens [1, STEPS], logits [STEPS + 1, vocab])``."""
    from transformers import StaticCache

    cache = None  # a growing cache: the one the model makes (DynamicCache, or a class of its own)
    if cache_kind == "static":
        cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + STEPS + 2)
    mask = torch.ones_like(ids)
    out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    cache = out.past_key_values if cache is None else cache
    logits, tokens = [out.logits[:, -1]], []
    for _ in range(STEPS):
        token = logits[-1].argmax(-1, keepdim=True)
        tokens.append(token)
        mask = torch.cat([mask, torch.ones_like(token)], 1)
        out = model(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1])
    return torch.cat(tokens, 1), torch.cat(logits, 0)


def _finite_summary(summary: dict) -> bool:
    def finite(value) -> bool:
        if isinstance(value, float):
            return math.isfinite(value)
        if isinstance(value, dict):
            return all(finite(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return all(finite(v) for v in value)
        return True

    return finite(summary)


@torch.no_grad()
def check_family(family: str) -> FamilyResult:
    """Run ``family`` through the matrix (module docstring)."""
    import qada
    from qada.models.guards import UnsupportedModelError

    if family in EXCLUDED:
        return FamilyResult(family, "excluded", detail=EXCLUDED[family])
    try:
        model = tiny_family_model(family)
    except NotBuilt as error:
        return FamilyResult(family, "unbuilt", detail=str(error))
    features = features_of(model)
    ids = torch.randint(3, 128, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    try:
        qada.enable(model, criterion="dense", moments="none", window=WINDOW).remove()
    except UnsupportedModelError as error:
        return FamilyResult(family, "refused", features, str(error))
    for cache_kind in ("dynamic", "static"):
        try:
            tokens, logits = _decode(model, ids, cache_kind)
        except Exception as error:  # noqa: BLE001 - the unwrapped model itself does not decode so here
            if cache_kind == "dynamic":
                return FamilyResult(family, "unbuilt", features, "the unwrapped model does not decode step by step "
                                    f"here ({type(error).__name__}: {str(error).splitlines()[0][:120]})")
            features.append("no StaticCache")
            break
        with qada.apply(model, criterion="dense", moments="none", window=WINDOW):
            got_tokens, got_logits = _decode(model, ids, cache_kind)
        difference = (got_logits - logits).abs().max().item()
        if not torch.equal(got_tokens, tokens) or not difference <= TOLERANCE:
            return FamilyResult(family, "failed", features,
                                f"dense differs from the model on a {cache_kind} cache: max |logit difference| "
                                f"{difference:.2e}, tokens equal: {torch.equal(got_tokens, tokens)}")
    cache_kind = "dynamic" if "no StaticCache" in features else "static"
    decided = _decide(model, ids, cache_kind)
    if decided is None:  # every layer slides: the summary said so, NaN-free; decide on the variant without a window
        decided = _decide_without_window(family, ids, cache_kind)
    if decided:
        return FamilyResult(family, "failed", features, decided)
    return FamilyResult(family, "supported", features)


def _decide_without_window(family: str, ids, cache_kind: str) -> str:
    """:func:`_decide` on ``family`` with ``sliding_window=None`` (global layers), where transformers builds and
    decodes that variant at all; ``""`` where it does not (nothing to decide on)."""
    try:
        model = tiny_family_model(family, sliding_window=None)
        _decode(model, ids, cache_kind)
    except Exception:  # noqa: BLE001 - the family has no variant without a window
        return ""
    return _decide(model, ids, cache_kind) or ""


def _decide(model, ids, cache_kind: str = "static") -> str | None:
    """Decode with ``qada`` and ``qada_tail``: ``""`` when both report finite statistics for every step, ``None``
    when the model has no global layer (and its summary says so, NaN-free), else what went wrong."""
    import qada

    for criterion in ({"name": "qada", "tau": 0.5}, {"name": "qada_tail", "tau": 0.3, "heavy": 4, "observe": 4,
                                                      "page_size": 4, "pages": 2}):
        with qada.apply(model, criterion=criterion, moments="current", window=WINDOW) as run:
            _decode(model, ids, cache_kind)
            summary = run.summary()
        if not _finite_summary(summary):
            return f"{criterion['name']}: a summary with NaN: {summary}"
        if not summary["global_layers"]:
            if summary["decode_steps"] == 0 and summary["sparsity_all_layers"] == 1.0:
                return None
            return f"{criterion['name']}: a summary without global layers: {summary}"
        if summary["decode_steps"] != STEPS or summary["sparsity"] is None or summary["kv_read"] is None:
            return f"{criterion['name']}: summary {summary}"
    return ""


def run_matrix(names: list[str] | None = None, echo: bool = False) -> list[FamilyResult]:
    """:func:`check_family` of every family (or ``names``); an exception is a ``failed`` row with its message."""
    results = []
    for family in names or families():
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            try:
                result = check_family(family)
            except Exception as error:  # noqa: BLE001 - recorded in the row
                result = FamilyResult(family, "failed", detail=f"{type(error).__name__}: {error}")
        results.append(result)
        if echo:
            print(f"{family:28s} {result.status:9s} {', '.join(result.features)} {result.detail[:160]}", flush=True)
    return results


def table(results: list[FamilyResult]) -> str:
    """The docs' table of ``results`` (markdown)."""
    lines = [
        "| family | attention features | status |",
        "|---|---|---|",
    ]
    for r in results:
        if r.status == "excluded":
            continue
        status = {"supported": "supported", "refused": "refused at `apply`: " + _short(r.detail),
                  "unbuilt": "untested (no tiny random model from its config)",
                  "failed": "not served: " + _short(r.detail)}[r.status]
        lines.append(f"| `{r.family}` | {', '.join(r.features) or '-'} | {status} |")
    return "\n".join(lines) + "\n"


def _short(detail: str) -> str:
    """The reason of an error, without the family prefix, for the table."""
    detail = re.sub(r"^[\w-]+: ", "", detail.splitlines()[0] if detail else "")
    return detail.replace("|", "\\|")


def parse_table(text: str) -> dict[str, str]:
    """``{family: status word}`` of a table written by :func:`table`."""
    rows = {}
    for line in text.splitlines():
        match = re.match(r"\| `([^`]+)` \| .* \| (supported|refused|untested|not served)", line)
        if match:
            rows[match.group(1)] = match.group(2)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", help="only these (default: all)")
    parser.add_argument("--write", action="store_true", help=f"rewrite {TABLE}")
    args = parser.parse_args(argv)
    results = run_matrix(args.families or None, echo=True)
    if args.write:
        text = TABLE.read_text()
        begin, end = "<!-- family-table -->", "<!-- /family-table -->"
        head, rest = text.split(begin)
        TABLE.write_text(head + begin + "\n" + table(results) + end + rest.split(end)[1])
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main())
