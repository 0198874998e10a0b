"""The serial rounds of the ``qada_tail`` decision's top-page choice in the fused kernels, counted on real decode steps.

    python benchmarks/tail_rounds.py                     # SmolLM2 (float32), a 7,680-token pass-key prompt (~3 min)
    python benchmarks/tail_rounds.py --length 2048 --out /tmp/rounds

A decision launch has few programs (one per row and KV head), so its time is the length of its longest serial
chain, not the bytes it reads. On an H200 the ``qada_tail`` decision cost 0.16-0.2 ms per layer; its chains are
the choice of each query head's top pages and the reads of their tokens. This script takes the page bounds the
eager criterion ranks at a real decode step (every layer, SmolLM2's real weights) and counts, per program of the
``triton_fused`` launches, the rounds each way of choosing the top pages takes:

* **max-extraction** (the kernels until 2026-11-28): ``TOP`` rounds for every tile of ``BLOCK_P`` pages in a
  page-top program, and ``TOP`` rounds for every stretch's list the decision merges;
* **insertion** (:func:`~qada.attention._fused_tail_kernel.insert_top`): a round only for a tile's page that beats
  the list's worst, as many as the head of the group that takes the most (the kernel's ``while`` loop); a tile with
  none costs its check alone. The decision merges 4 stretch lists per tile.

It simulates both on the bounds (the kernels' tie rules), checks that insertion keeps the pages ``topk`` keeps,
and reports per layer the longest program's rounds (a launch waits for its longest program) and the chains of
dependent loads for the pages' tokens (``G x TOP`` one page at a time, ``G x TOP / ENTRIES`` now), for each layout
of :data:`SCENARIOS`, and the serial tiles of page extrema the longest program loads: Triton's pipeliner leaves
that loop alone, so each tile loaded in its own iteration waits one memory round trip (with 16-page tiles
everywhere, and now with :func:`~qada.attention.fused.page_top_tile`'s wider ones in the page-top programs); and the
round trips each launch's longest program waits for, by the kernels' structure (:func:`round_trips`), before and
after the page-top tiles were loaded a tile ahead and the token chunks pipelined; and each layout's launches per
layer (:func:`launches_per_layer`: the page-top programs run in the moment step's launch). It counts rounds, tiles,
round trips and launches, not time: the GPU suite (``benchmarks/run.py --gpu``) times the launches.

Writes ``<out>/tail-rounds-cpu.{json,md}``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CANDIDATE_LISTS_PER_TILE = 4
"""Stretch lists the decision launch merges per tile (``qada_tail_fused_split_kernel``'s ``CANDIDATES`` loop)."""


def insert_tile(vals: list[float], ids: list[int], tile: list[tuple[float, int]]) -> int:
    """Insert one head's ``tile`` of ``(rank, page)`` into its list ``vals, ids`` (``TOP`` entries, ``-inf`` for
    none yet) in place as :func:`~qada.attention._fused_tail_kernel.insert_top` does: while the tile's best (ties:
    the lower page) beats the list's worst, it replaces the worst (ties: the higher page). Returns the rounds."""
    remaining = sorted(tile, key=lambda entry: (-entry[0], entry[1]))
    rounds = 0
    for rank, page in remaining:
        worst = min(vals)
        if not rank > worst:
            break
        at = max((i for i, v in enumerate(vals) if v == worst), key=lambda i: (ids[i], i))
        vals[at], ids[at] = rank, page
        rounds += 1
    return rounds


def program_rounds(lists: list[tuple[list[float], list[int]]], tiles: list[list[list[tuple[float, int]]]]) -> int:
    """Rounds of one program that inserts ``tiles`` (each ``[head][entry] = (rank, page)``) into the heads' ``lists``
    (changed in place): per tile, the largest number of insertions any head makes."""
    total = 0
    for tile in tiles:
        total += max(insert_tile(vals, ids, entries) for (vals, ids), entries in zip(lists, tile, strict=True))
    return total


def simulate_pair(bounds: Any, p_lo: int, p_hi: int, top: int, block_p: int, pages_per_program: int,
                  page_top_block_p: int | None = None) -> dict:
    """Both ways of choosing the ``top`` pages of ``[p_lo, p_hi)`` for one (row, KV head): ``bounds [G, n_pages]``
    (float, NaN ranks first as ``+inf``), in tiles of ``block_p`` pages where the decision bounds them (in the splits,
    or launched apart) and of ``page_top_block_p`` (default ``block_p``) in the page-top programs. Returns the
    page-top programs' and the decision's longest rounds each way (max-extraction with tiles of ``block_p``, as the
    kernels until 2026-11-28; insertion with the tiles given), their serial tile loads (``*_tiles``: each tile's page
    extrema wait one memory round trip; ``page_top_tiles_old`` with tiles of ``block_p``) and the heads' chosen pages
    (insertion)."""
    import torch

    rank = torch.where(torch.isnan(bounds), torch.full_like(bounds, math.inf), bounds).tolist()
    G = len(rank)
    n = p_hi - p_lo
    apart = n > pages_per_program
    deciding_tile = (page_top_block_p or block_p) if apart else block_p  # (page-top programs, else the decision)
    stretches = [(b, min(b + pages_per_program, p_hi)) for b in range(p_lo, p_hi, pages_per_program)] if apart \
        else [(p_lo, p_hi)]  # fmt: skip
    stretch_lists, page_top_new, page_top_old, page_top_tiles, page_top_tiles_old = [], [], [], [], []
    for begin, end in stretches:
        lists = [([-math.inf] * top, [0] * top) for _ in range(G)]
        tiles = [[[(rank[g][p], p) for p in range(t, min(t + deciding_tile, end))] for g in range(G)]
                 for t in range(begin, end, deciding_tile)]  # fmt: skip
        page_top_new.append(program_rounds(lists, tiles))
        page_top_tiles_old.append(len(range(begin, end, block_p)))
        page_top_old.append(top * page_top_tiles_old[-1])
        page_top_tiles.append(len(tiles))
        stretch_lists.append(lists)
    if apart:  # the decision merges the stretches' lists, CANDIDATE_LISTS_PER_TILE per tile
        merged = [([-math.inf] * top, [0] * top) for _ in range(G)]
        tiles = []
        for c in range(0, len(stretch_lists), CANDIDATE_LISTS_PER_TILE):
            chunk = stretch_lists[c:c + CANDIDATE_LISTS_PER_TILE]
            tiles.append([[(v, i) for lists in chunk for v, i in zip(*lists[g], strict=True)] for g in range(G)])
        decision_new, decision_old = program_rounds(merged, tiles), top * len(stretch_lists)
        decision_tiles = 0  # (the lists, not page extrema)
        chosen = merged
    else:
        decision_new, decision_old = page_top_new[0], page_top_old[0]  # (the decision bounds its pages itself)
        decision_tiles = page_top_tiles[0]
        page_top_new, page_top_old, page_top_tiles, page_top_tiles_old = [], [], [], []
        chosen = stretch_lists[0]
    return {"page_top_new": page_top_new, "page_top_old": page_top_old, "decision_new": decision_new,
            "decision_old": decision_old, "page_top_tiles": page_top_tiles, "page_top_tiles_old": page_top_tiles_old,
            "decision_tiles": decision_tiles,
            "chosen": chosen, "rank": rank}


def same_as_topk(rank: list[list[float]], chosen: list[tuple[list[float], list[int]]], p_lo: int, p_hi: int,
                 top: int) -> bool:
    """Whether each head's chosen values are ``topk``'s over ``[p_lo, p_hi)`` (values: ties may pick other pages)."""
    for g, (vals, _) in enumerate(chosen):
        window = sorted(rank[g][p_lo:p_hi], reverse=True)[:top]
        window += [-math.inf] * (top - len(window))
        if sorted(vals, reverse=True) != window:
            return False
    return True


def record_top_pages(model: Any, run: Any, ids: Any, steps: int = 2) -> list[dict[str, Any]]:
    """Prefill ``ids [1, T]`` with ``run`` attached and decode ``steps`` tokens; return what the criterion's
    ``top_pages`` received at the last step, per layer: ``{"query", "halves", "scale", "first", "last", "page",
    "top"}``."""
    import contextlib

    from benchmarks.common import greedy_decode
    from qada.criteria import tail as tail_module
    from qada.models import attach

    seen: list[dict[str, Any]] = []
    original = tail_module.top_pages

    def recording(query, halves, scale, first, last, page_size, m):  # noqa: ANN001, ANN202
        seen.append({"query": query.float().clone(), "halves": halves.clone(), "scale": float(scale),
                     "first": first.clone(), "last": last.clone(), "page": page_size, "top": m})
        return original(query, halves, scale, first, last, page_size, m)

    def last_step_only(step: int) -> contextlib.AbstractContextManager:
        seen.clear()
        return contextlib.nullcontext()

    attach(model, run)
    tail_module.top_pages = recording
    try:
        greedy_decode(model, ids, steps, ids.shape[1] + steps + 2, last_step_only)
    finally:
        tail_module.top_pages = original
        run.remove()
    return list(seen)


PAGE_TOP_TILE_FEATURES_BEFORE = 4096
"""The page-top launch's tile (pages times the padded head dimension) before its tiles were loaded a tile ahead
(2026-12-04): 64 pages at ``d = 64``, each tile loaded in its own iteration and waited for."""


def round_trips(n_pages: int, pages_per_program: int, G: int, top: int, entries: int, block_p: int,
                head_dim: int, attending: bool = False) -> dict[str, int]:
    """The memory round trips one (row, KV head)'s longest page-top program and its decision wait for (a load not
    issued ahead of the work before it), for a bulk of ``n_pages`` pages, by the kernels' structure (no data):

    * page-top program (where the pages are spread: more than ``pages_per_program``), ``before``: each of its tiles
      of :data:`PAGE_TOP_TILE_FEATURES_BEFORE` features; ``now``: the first tile only
      (:func:`~qada.attention._fused_tail_kernel.page_top`'s ``AHEAD``: the next tile loads while the tile before
      is bounded and inserted);
    * decision: its tiles of stretch lists (4 lists a tile) where the pages are spread, else its tiles of page
      extrema (a split that attends loads none ahead, a decision launched apart each a tile ahead), then the top
      pages' tokens, ``G x ceil(TOP / ENTRIES)`` chunks: ``before`` two dependent loads each (heavy flags, then
      keys); ``now`` one each in a split that attends and bounds its own pages (``attending``: flags and keys
      together), and in a launch that only decides or a split that merges page-top lists the first chunk alone (the
      keys through the loop's software pipeline, the flags loaded by the chunk before).

    Counted, not timed: a load issued ahead is still waited for when the work it overlaps is shorter."""
    from qada.attention.fused import _next_pow2

    spread = n_pages > pages_per_program
    chunks = G * math.ceil(top / entries)
    tokens_now = chunks if attending and not spread else (1 if chunks else 0)  # (a wait per chunk: bounding splits)
    if spread:
        longest = min(n_pages, pages_per_program)
        tile_before = max(8, PAGE_TOP_TILE_FEATURES_BEFORE // max(16, _next_pow2(head_dim)))
        merges = math.ceil(math.ceil(n_pages / pages_per_program) / CANDIDATE_LISTS_PER_TILE)
        return {"page_top_waits_before": math.ceil(longest / tile_before), "page_top_waits_now": 1 if longest else 0,
                "decision_waits_before": merges + 2 * chunks, "decision_waits_now": merges + tokens_now}
    tiles = math.ceil(n_pages / block_p)
    return {"page_top_waits_before": 0, "page_top_waits_now": 0, "decision_waits_before": tiles + 2 * chunks,
            "decision_waits_now": (tiles if attending else min(tiles, 1)) + tokens_now}


def launches_per_layer(apart: bool) -> int:
    """The launches of one layer's ``qada_tail`` step with a built-in moment source: the moment step's (which runs
    the page-top programs too where a row's pages are spread over them; until 2026-12-05 a launch of their own, one
    more), the decision where it is ``apart`` (then the ``triton`` split), the split, the combine."""
    return 3 + int(apart)


def count_layers(records: list[dict[str, Any]], num_kv_heads: int, pages_per_program: int,
                 attending: bool = False) -> list[dict[str, Any]]:
    """Per layer: the longest program's rounds each way (page-top launch, decision launch), the token chains, and
    whether insertion kept ``topk``'s pages, from :func:`record_top_pages`' records."""
    from qada.attention.fused import page_tiles, page_top_tile
    from qada.functional.tail import bounds_from_halves

    layers = []
    for layer, r in enumerate(records):
        query, halves, top, page = r["query"], r["halves"], r["top"], r["page"]
        b, H, d = query.shape
        G = H // num_kv_heads
        tiles = page_tiles(page, top, d)
        block_p, entries = tiles["BLOCK_P"], tiles["ENTRIES"]
        top_tile = page_top_tile(d, pages_per_program)  # (a page-top program's tiles)
        bounds = bounds_from_halves(query, halves, r["scale"])  # [b, H, n_pages]
        row = {"layer": layer, "pages": int(halves.shape[2]), "top": top, "block_p": block_p,
               "page_top_block_p": top_tile,
               "G": G, "page_top_old": 0, "page_top_new": 0, "decision_old": 0, "decision_new": 0, "same_pages": True,
               "token_chains_old": G * top, "token_chains_new": G * math.ceil(top / entries),
               "page_top_tiles_old": 0, "page_top_tiles_new": 0, "decision_tiles": 0,
               "page_top_waits_before": 0, "page_top_waits_now": 0, "decision_waits_before": 0,
               "decision_waits_now": 0}
        for i in range(b):
            p_lo = int(r["first"][i]) // page
            p_hi = -(-int(r["last"][i]) // page) if int(r["last"][i]) > int(r["first"][i]) else p_lo
            for kv in range(num_kv_heads):
                pair = bounds[i, kv * G:(kv + 1) * G]
                got = simulate_pair(pair, p_lo, p_hi, top, block_p, pages_per_program, page_top_block_p=top_tile)
                for key in ("page_top_old", "page_top_new"):
                    row[key] = max([row[key], *got[key]])
                for key in ("decision_old", "decision_new"):
                    row[key] = max(row[key], got[key])
                row["page_top_tiles_old"] = max([row["page_top_tiles_old"], *got["page_top_tiles_old"]])
                row["page_top_tiles_new"] = max([row["page_top_tiles_new"], *got["page_top_tiles"]])
                row["decision_tiles"] = max(row["decision_tiles"], got["decision_tiles"])  # (tiles of block_p)
                row["same_pages"] &= same_as_topk(got["rank"], got["chosen"], p_lo, p_hi, top)
                waits = round_trips(p_hi - p_lo, pages_per_program, G, top, entries, block_p, d, attending)
                for key, value in waits.items():
                    row[key] = max(row[key], value)
        layers.append(row)
    return layers


SCENARIOS = {  # name: (pages per page-top program, None: none, every split bounds every page; decided in the splits)
    "decision in every split, 256 pages per page-top program (decide_once=False)": (256, True),
    "decision launched apart, 256 pages per page-top program (the default)": (256, False),
    "decision launched apart, 64 pages per page-top program": (64, False),
    "decision in every split, each bounding every page (decide_once=False until 2026-12-05)": (None, True),
}
"""The ways the ``triton_fused`` executor lays out a ``qada_tail`` decision (``decide_once``, ``pages_per_program``;
a budget always decides apart), and the layout ``decide_once=False`` had until its splits merged the page-top
programs' lists too."""


def report(results: dict[str, Any]) -> str:
    """The markdown report of :func:`main`'s results."""
    from benchmarks.common import table

    keys = ("page_top_old", "page_top_new", "decision_old", "decision_new", "token_chains_old", "token_chains_new",
            "page_top_tiles_old", "page_top_tiles_new", "decision_tiles", "page_top_waits_before",
            "page_top_waits_now", "decision_waits_before", "decision_waits_now")
    rows = []
    for name, layers in results["scenarios"].items():
        total = {key: sum(row[key] for row in layers) for key in keys}
        rows.append([name, results.get("launches_per_layer", {}).get(name, ""), total["page_top_old"],
                     total["page_top_new"], total["decision_old"],
                     total["decision_new"], total["token_chains_old"], total["token_chains_new"],
                     f"{total['page_top_tiles_old']} / {total['decision_tiles']}",
                     f"{total['page_top_tiles_new']} / {total['decision_tiles']}",
                     f"{total['page_top_waits_before']} / {total['decision_waits_before']}",
                     f"{total['page_top_waits_now']} / {total['decision_waits_now']}",
                     "every layer" if all(r["same_pages"] for r in layers) else "NOT every layer"])
    first = next(iter(results["scenarios"].values()))[0]
    lines = [f"# The serial rounds of the qada_tail top-page choice: {results['model']}", "",
             f"Command: `{results['command']}`; a {results['prompt_tokens']:,}-token pass-key prompt, the page bounds "
             f"the eager `qada_tail` criterion ranked at the second decode step in each of the {results['layers']} "
             f"layers, {first['pages']} pages of {results['page_size']} slots, top {first['top']} per query head, "
             f"{first['G']} query heads per KV head, tiles of {first['block_p']} pages. Summed over the layers, the "
             "longest program's rounds of each launch (a launch waits for its longest program): `old` by "
             "max-extraction (TOP rounds per tile of pages or stretch list), `new` by insertion (a round per page "
             "that enters a list; the decision merges 4 stretch lists per tile); token chains: the chains of "
             "dependent loads per program that read the top pages' tokens; tile loads: the serial tiles of page "
             "extrema the longest page-top / decision program loads (not pipelined: each waits one "
             f"memory round trip), with tiles of {first['block_p']} pages everywhere, and now, with a page-top "
             f"program's tiles of {first['page_top_block_p']} (the decision keeps {first['block_p']}); round trips "
             "waited: the loads the longest page-top / decision program waits for, not issued ahead of the work "
             "before them (`round_trips`: page extrema tiles, stretch-list tiles, token chunks), before the "
             "page-top tiles were loaded a tile ahead and the token chunks pipelined (2026-12-04) and now; a split "
             "that attends and bounds its own pages pipelines no chunk. Launches per layer: the moment step's "
             "(which runs the page-top programs too since 2026-12-05: until then a launch of their own, one more "
             "per layer where a row's pages are spread), the decision where it is launched apart, the split, the "
             "combine. Rounds, "
             "tiles and round trips counted from the kernels' structure, not timed.", "",
             table(["layout", "launches per layer", "page-top programs old", "new", "decision old", "new",
                    "token chains old", "new",
                    f"tile loads page-top / decision, {first['block_p']}-page tiles", "now",
                    "round trips waited page-top / decision, before", "now",
                    "insertion kept topk's pages"], rows)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=7680, help="prompt length in tokens")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    os.environ["QADA_COMPILE"] = "0"  # the eager criterion: its top_pages call is what is recorded

    import torch

    from benchmarks.common import machine_info, write_results
    from qada.eval.passkey import passkey_prompt
    from qada.models import build_run, load_default_model, prepare_run

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    model, tokenizer = load_default_model(dtype=torch.float32)
    ids = passkey_prompt(tokenizer, length=args.length, depth=0.5).input_ids
    run = prepare_run(build_run(criterion={"name": "qada_tail", "tau": 0.3}, moments="current", executor="sdpa"),
                      model, tokenizer)
    records = record_top_pages(model, run, ids)
    if len(records) != model.config.num_hidden_layers:
        raise RuntimeError(f"expected one top_pages call per layer ({model.config.num_hidden_layers}) but got "
                           f"{len(records)}")
    scenarios = {name: count_layers(records, model.config.num_key_value_heads, pages or 1 << 30, attending)
                 for name, (pages, attending) in SCENARIOS.items()}  # fmt: skip
    launches = {name: launches_per_layer(apart=not attending) for name, (_, attending) in SCENARIOS.items()}
    flags = f" --length {args.length}" if args.length != 7680 else ""
    results = {"command": f"python benchmarks/tail_rounds.py{flags}", "machine": machine_info("cpu"),
               "model": "SmolLM2-135M (embedded, float32)", "prompt_tokens": int(ids.shape[1]),
               "layers": len(records), "page_size": records[0]["page"], "scenarios": scenarios,
               "launches_per_layer": launches}
    paths = write_results(args.out, "tail-rounds-cpu", results, report(results))
    print(paths[1].read_text())
    return paths[1]


if __name__ == "__main__":
    main()
