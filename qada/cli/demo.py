"""``qada demo``: the library's main job on a small scale.

Until the model wrapper lands this runs the criteria on synthetic decode steps: bulk keys drawn i.i.d. from a
Gaussian per KV head, local keys with a planted score, and prints how often QAdA (with the bulk's own
moments) agrees with the oracle, and the sparsity both choose, over tau.
"""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("demo", help="run the criteria end to end and print a summary table")
    parser.add_argument("--length", type=int, default=4096, help="cache length T (default 4096)")
    parser.add_argument("--heads", type=int, default=64, help="query heads per run (default 64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from qada.criteria import OracleCriterion, QAdACriterion, StepContext
    from qada.moments import BulkMoments
    from qada.window import Window

    if args.length < 1 or args.heads < 1:
        raise ValueError(f"expected --length >= 1 and --heads >= 1 but got {args.length} and {args.heads}")
    generator = torch.Generator().manual_seed(args.seed)
    d, window = 64, Window()
    H = args.heads
    keys = torch.randn(1, H, args.length, d, generator=generator) * torch.rand(1, H, 1, d, generator=generator)
    keys[:, :, -window.t_recent :] += 3 * torch.randn(1, H, 1, d, generator=generator)
    query = torch.randn(1, H, d, generator=generator) * 2
    bulk = keys[:, :, window.t_sink : args.length - window.t_recent].double()
    mean = bulk.mean(2)
    centred = bulk - mean[:, :, None]
    cov = centred.transpose(-1, -2) @ centred / max(bulk.shape[2], 1)
    ctx = StepContext(query, keys, d**-0.5, window, moments=BulkMoments(mean, cov))
    print(f"synthetic decode step: T={args.length}, {H} heads, d={d}, window {window.t_local}/{window.t_sink}")
    print(f"{'tau':>6} {'oracle sparsity':>16} {'qada sparsity':>14} {'agreement':>10}")
    for tau in (0.1, 0.3, 0.5, 0.6, 0.8, 0.9, 0.99):
        oracle = OracleCriterion(tau)(ctx)
        qada = QAdACriterion(tau)(ctx)
        agreement = (oracle == qada).float().mean().item()
        print(f"{tau:>6.2f} {oracle.float().mean().item():>16.3f} {qada.float().mean().item():>14.3f} {agreement:>10.3f}")
    return 0
