"""Run by tests/test_eval_ddp.py: the evaluator on 2 CPU processes (Lightning Fabric DDP, gloo)."""

import json
import sys

import torch
from lightning.fabric import Fabric


def main(out_dir: str, devices: int) -> None:
    from transformers import AutoTokenizer

    from qada.eval.configs import EvalConfig
    from qada.eval.evaluator import Evaluator
    from qada.eval.tasks import TASKS
    from qada.models.loading import model_directory
    from tests.tiny_models import tiny_model

    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto")
    fabric.launch()
    tokenizer = AutoTokenizer.from_pretrained(model_directory(None))
    model = tiny_model("llama", vocab_size=len(tokenizer))
    samples = TASKS.build("niah_single_2").generate(tokenizer, 400, 4, seed=0)
    window = {"t_local": 96, "t_sink": 4}
    configs = [
        EvalConfig("dense", "dense", None, "sdpa", window, "dense"),
        EvalConfig("qada", {"name": "qada", "tau": 0.25}, "current", "sdpa", window, "qada/current"),
    ]
    results = Evaluator(model, tokenizer, configs, out_dir, fabric=fabric, record_oracle=True,
                        progress=False).evaluate(samples)
    if fabric.global_rank == 0:
        with open(f"{out_dir}/metrics.json", "w") as handle:
            json.dump(results, handle)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
