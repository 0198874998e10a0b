"""Decisions recorded from the code before the step refactor (issue 13), and the code that reproduces them.

``python tests/decision_cases.py`` (run once, on the commit before the refactor) wrote
``tests/data/decisions_before_refactor.safetensors``: for synthetic steps (their input tensors are stored too)
and for the embedded model (a left-padded batch of two pass-key prompts, greedy decoding), the ``[b, H]``
local decisions of oracle, QAdA (explicit, stored and current moments), static and composed criteria.
``tests/test_decisions_recorded.py`` recomputes them with today's code and demands bit-identical results.
Only public API is used here (criteria by config, ``qada.apply``, ``DecisionRecorder``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

RECORDED = Path(__file__).parent / "data" / "decisions_before_refactor.safetensors"

# Synthetic steps: GQA 8 query heads on 2 KV heads, d=16, three rows of which two are left padded.
SYN_SHAPE = dict(b=3, H=8, H_kv=2, T=400, d=16)
SYN_START = [0, 37, 290]  # the last row has 110 real tokens: no bulk (trivially local)


def static_mask(layers: int, heads: int, seed: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(layers, heads, generator=generator) < 0.6


def synthetic_inputs() -> dict[str, torch.Tensor]:
    s = SYN_SHAPE
    generator = torch.Generator().manual_seed(1234)
    keys = torch.randn(s["b"], s["H_kv"], s["T"], s["d"], generator=generator)
    keys[:, :, :16] += 2.0  # sinks that attract attention
    query = torch.randn(s["b"], s["H"], s["d"], generator=generator) * 1.5
    bulk = keys[:, :, 16 : s["T"] - 112].double()
    mean = bulk.mean(2)
    centred = bulk - mean[:, :, None]
    cov = centred.transpose(-1, -2) @ centred / bulk.shape[2]
    return {"query": query, "keys": keys, "start": torch.tensor(SYN_START), "mean": mean, "cov": cov}


def synthetic_specs(layers: int, heads: int) -> dict[str, dict]:
    mask = static_mask(layers, heads).tolist()
    return {
        "oracle_0.6": {"name": "oracle", "tau": 0.6},
        "oracle_0.3": {"name": "oracle", "tau": 0.3},
        "qada_0.6": {"name": "qada", "tau": 0.6},
        "qada_0.9": {"name": "qada", "tau": 0.9},
        "static": {"name": "static", "mask": mask},
        "composed": {
            "name": "layer_override",
            "base": {"name": "any_of", "criteria": [{"name": "qada", "tau": 0.9}, {"name": "static", "mask": mask}]},
            "overrides": {0: "dense", 2: {"name": "not", "criterion": {"name": "oracle", "tau": 0.3}}},
        },
        "all_of": {"name": "all_of", "criteria": [{"name": "oracle", "tau": 0.5}, {"name": "qada", "tau": 0.5}]},
    }


SYN_LAYERS = 3  # every synthetic criterion is evaluated as layers 0, 1, 2 of the same step


def synthetic_decisions(decide) -> dict[str, torch.Tensor]:
    """``decide(spec, inputs, layer) -> [b, H] bool`` for each spec and layer, stacked to ``[layers, b, H]``."""
    inputs = synthetic_inputs()
    out = {}
    for name, spec in synthetic_specs(SYN_LAYERS, SYN_SHAPE["H"]).items():
        out[f"synthetic/{name}"] = torch.stack([decide(spec, inputs, layer) for layer in range(SYN_LAYERS)])
    return out


# --- the embedded model --------------------------------------------------------------------------------------
MODEL_NEW_TOKENS = 6
REFERENCE_LENGTH = 2048  # a short stored reference: built once (seconds) and cached


def model_specs(layers: int, heads: int) -> dict[str, tuple[dict, object]]:
    mask = static_mask(layers, heads).tolist()
    stored = {"name": "stored", "length": REFERENCE_LENGTH}
    composed = {
        "name": "layer_override",
        "base": {"name": "any_of", "criteria": [{"name": "qada", "tau": 0.9}, {"name": "static", "mask": mask}]},
        "overrides": {0: "dense", layers - 1: {"name": "not", "criterion": {"name": "oracle", "tau": 0.3}}},
    }
    return {
        "oracle_0.6": ({"name": "oracle", "tau": 0.6}, None),
        "qada_stored_0.6": ({"name": "qada", "tau": 0.6}, stored),
        "qada_current_0.6": ({"name": "qada", "tau": 0.6}, "current"),
        "static": ({"name": "static", "mask": mask}, None),
        "composed_current": (composed, "current"),
    }


def model_prompts(tokenizer):
    from qada.eval.passkey import passkey_prompt

    long = passkey_prompt(tokenizer, 1024, depth=0.3, seed=0).input_ids[0]
    short = passkey_prompt(tokenizer, 700, depth=0.5, seed=1).input_ids[0]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((2, long.shape[0]), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    ids[0], mask[0] = long, 1
    ids[1, -short.shape[0] :], mask[1, -short.shape[0] :] = short, 1
    return ids, mask


def model_decisions(model, tokenizer) -> dict[str, torch.Tensor]:
    """``[steps, layers, b, H]`` decisions of each model spec, decoding greedily with that criterion."""
    import qada
    from qada.models import DecisionRecorder

    ids, mask = model_prompts(tokenizer)
    config = model.config
    out = {}
    for name, (criterion, moments) in model_specs(config.num_hidden_layers, config.num_attention_heads).items():
        recorder = DecisionRecorder()
        with qada.apply(model, criterion=criterion, moments=moments, observers=[recorder], tokenizer=tokenizer):
            tokens = model.generate(ids, attention_mask=mask, max_new_tokens=MODEL_NEW_TOKENS, do_sample=False,
                                    pad_token_id=tokenizer.pad_token_id)
        by_step: dict[int, dict[int, torch.Tensor]] = {}
        for event in recorder.events:
            by_step.setdefault(event.step, {})[event.layer] = event.local
        out[f"model/{name}"] = torch.stack(
            [torch.stack([layers[k] for k in sorted(layers)]) for _, layers in sorted(by_step.items())]
        )
        out[f"model/{name}/tokens"] = tokens[:, ids.shape[1] :]
    return out


def _record() -> None:  # pragma: no cover - run by hand, once
    from safetensors.torch import save_file

    from qada.criteria import CRITERIA, StepContext
    from qada.models import load_default_model
    from qada.moments import BulkMoments

    def decide_before(spec, inputs, layer):
        ctx = StepContext(inputs["query"], inputs["keys"], 0.25, layer=layer, start=inputs["start"],
                          moments=BulkMoments(inputs["mean"], inputs["cov"]))
        return CRITERIA.build(spec)(ctx)

    tensors = {f"inputs/{k}": v for k, v in synthetic_inputs().items()}
    tensors.update(synthetic_decisions(decide_before))
    model, tokenizer = load_default_model()
    tensors.update(model_decisions(model, tokenizer))
    RECORDED.parent.mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(RECORDED),
              metadata={"recorded_from": sys.argv[1] if len(sys.argv) > 1 else "unknown"})
    for key, value in tensors.items():
        if value.dtype == torch.bool:
            print(f"{key:<40} {tuple(value.shape)} local fraction {value.float().mean():.3f}")


if __name__ == "__main__":  # pragma: no cover
    _record()
