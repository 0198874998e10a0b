"""``benchmarks/tail_rounds.py``: its simulation of the fused kernels' top-page choice keeps ``topk``'s pages and
counts no more insertion rounds than max-extraction takes, on random bounds with ties, NaN and short ranges."""

from __future__ import annotations

import math
import random

import pytest
import torch

from benchmarks.tail_rounds import insert_tile, same_as_topk, simulate_pair


def test_insert_tile_keeps_the_best_and_lets_the_list_win_ties():
    vals, ids = [-math.inf] * 3, [0] * 3
    assert insert_tile(vals, ids, [(1.0, 4), (3.0, 5), (2.0, 6), (0.5, 7)]) == 3
    assert sorted(zip(vals, ids, strict=True)) == [(1.0, 4), (2.0, 6), (3.0, 5)]
    assert insert_tile(vals, ids, [(1.0, 9), (0.0, 10)]) == 0  # a tie with the list's worst: the list keeps its own
    assert insert_tile(vals, ids, [(2.0, 11), (2.5, 12)]) == 1  # 2.5 replaces 1.0; 2.0 (page 11) ties: stays out
    assert sorted(zip(vals, ids, strict=True)) == [(2.0, 6), (2.5, 12), (3.0, 5)]


@pytest.mark.parametrize("seed", range(6))
def test_simulated_choice_is_topk_and_takes_fewer_rounds(seed):
    rng = random.Random(seed)
    G, n, top = 3, rng.randint(20, 700), rng.choice([2, 5, 8])
    bounds = torch.randn(G, n, generator=torch.Generator().manual_seed(seed)).round(decimals=1)  # (many ties)
    bounds[0, rng.randrange(n)] = float("nan")
    p_lo = rng.randrange(0, n // 2)
    p_hi = rng.randrange(p_lo, n + 1)
    got = simulate_pair(bounds, p_lo, p_hi, top, block_p=16, pages_per_program=64)
    assert same_as_topk(got["rank"], got["chosen"], p_lo, p_hi, top)
    assert got["decision_new"] <= got["decision_old"]
    assert all(new <= old for new, old in zip(got["page_top_new"], got["page_top_old"], strict=True))
    assert (p_hi - p_lo > 64) == bool(got["page_top_old"])  # page-top programs only where the range is spread
    wide = simulate_pair(bounds, p_lo, p_hi, top, block_p=16, pages_per_program=64, page_top_block_p=64)
    assert same_as_topk(wide["rank"], wide["chosen"], p_lo, p_hi, top)  # the tile size changes no page
    assert sorted(map(sorted, (v for v, _ in wide["chosen"]))) == sorted(map(sorted, (v for v, _ in got["chosen"])))
    stretches = range(p_lo, p_hi, 64) if p_hi - p_lo > 64 else []
    assert got["page_top_tiles"] == [-(-(min(b + 64, p_hi) - b) // 16) for b in stretches]
    assert wide["page_top_tiles_old"] == got["page_top_tiles"]  # (the tiles of block_p, whatever the page-top's)
    assert wide["page_top_tiles"] == [1 for _ in stretches]  # a page-top program: one tile of 64 pages, not 4
    assert wide["decision_tiles"] == (0 if stretches else -(-(p_hi - p_lo) // 16))  # (merges lists, or bounds)
    every = simulate_pair(bounds, p_lo, p_hi, top, block_p=16, pages_per_program=1 << 30, page_top_block_p=64)
    assert every["decision_tiles"] == -(-(p_hi - p_lo) // 16)  # the attending split keeps its tiles


def test_round_trips_waited_follow_the_kernels_structure():
    """A page-top program waits for its first tile only (the next ones load a tile ahead), where before it waited for
    each of its tiles of 4,096 features; a decision launched apart waits for its stretch-list tiles and its first
    token chunk only (each chunk was two dependent loads); a split that attends waits for each chunk once."""
    from benchmarks.tail_rounds import round_trips

    # SmolLM2 at 7.68k: 481 pages, 256 per page-top program, G = 3, TOP = 8, 4 pages a chunk (d = 64)
    apart = round_trips(481, 256, G=3, top=8, entries=4, block_p=16, head_dim=64)
    assert apart == {"page_top_waits_before": 4, "page_top_waits_now": 1, "decision_waits_before": 1 + 2 * 6,
                     "decision_waits_now": 1 + 1}
    # Llama-3-8B at 128k: 8,192 pages in 32 stretches (8 tiles of 4 lists), G = 4, 2 pages a chunk (d = 128)
    llama = round_trips(8192, 256, G=4, top=8, entries=2, block_p=8, head_dim=128)
    assert llama == {"page_top_waits_before": 8, "page_top_waits_now": 1, "decision_waits_before": 8 + 2 * 16,
                     "decision_waits_now": 8 + 1}
    every = round_trips(100, 256, G=3, top=8, entries=4, block_p=16, head_dim=64, attending=True)  # every split
    assert every == {"page_top_waits_before": 0, "page_top_waits_now": 0, "decision_waits_before": 7 + 2 * 6,
                     "decision_waits_now": 7 + 6}
    once = round_trips(100, 256, G=3, top=8, entries=4, block_p=16, head_dim=64)  # launched apart: a tile ahead
    assert once["decision_waits_now"] == 1 + 1
    # the splits merge the page-top programs' lists (2 stretches: one tile of lists), their token loop pipelined
    merging = round_trips(481, 256, G=3, top=8, entries=4, block_p=16, head_dim=64, attending=True)
    assert merging == apart


def test_launches_per_layer():
    """The page-top programs run in the moment step's launch: three launches, four with the decision apart."""
    from benchmarks.tail_rounds import SCENARIOS, launches_per_layer

    assert [launches_per_layer(apart=not attending) for _, attending in SCENARIOS.values()] == [3, 4, 4, 3]
