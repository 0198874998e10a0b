import pytest
import torch

from qada.functional import bulk_count, bulk_mask, local_index_set, window_indices
from qada.window import Window


def test_local_index_set_long_sequence():
    idx = local_index_set(300, 128, 16)
    assert idx.tolist() == list(range(16)) + list(range(300 - 112, 300))


@pytest.mark.parametrize("T", [0, 1, 5, 127, 128])
def test_local_index_set_short_sequence_is_everything(T):
    assert local_index_set(T).tolist() == list(range(T))


def test_local_index_set_just_above_window():
    assert local_index_set(129).tolist() == list(range(16)) + list(range(17, 129))


@pytest.mark.parametrize("T", [1, 7, 20, 64, 65, 100, 200])
@pytest.mark.parametrize("start", [0, 3, 30])
def test_window_indices_and_bulk_partition_each_row(T, start):
    """Local set + bulk = exactly the row's real tokens, without overlap, with padding excluded."""
    if start >= T:
        pytest.skip("row without real tokens")
    t_local, t_sink = 64, 8
    starts = torch.tensor([start, 0])
    index, valid = window_indices(T, t_local, t_sink, starts)
    bulk = bulk_mask(T, t_local, t_sink, starts)
    for row, s in enumerate([start, 0]):
        local = index[row][valid[row]].tolist()
        assert len(local) == len(set(local)), "a token counted twice in the local set"
        expected_local = (local_index_set(T - s, t_local, t_sink) + s).tolist()
        assert sorted(local) == expected_local
        bulk_positions = bulk[row].nonzero().flatten().tolist()
        assert sorted(local + bulk_positions) == list(range(s, T))
        assert bulk_count(T, t_local, t_sink, starts)[row].item() == len(bulk_positions)


def test_window_rejects_bad_sizes():
    with pytest.raises(ValueError, match="t_sink <= t_local"):
        Window(16, 32)
    with pytest.raises(ValueError, match="t_sink >= 0"):
        Window(16, -1)
    with pytest.raises(ValueError, match="t_local >= 1"):
        Window(0, 0)
    with pytest.raises(ValueError, match="T >= 0"):
        local_index_set(-1)
    with pytest.raises(ValueError, match="t_sink <= t_local"):
        local_index_set(10, 8, 9)


@pytest.mark.parametrize("T", [5, 64, 65, 200])
def test_gather_window_slices_equal_the_indexed_gather(T):
    from qada.functional import gather_window

    x = torch.randn(2, 3, T, 4)
    sliced, valid = gather_window(x, 64, 8)
    index, expected_valid = window_indices(T, 64, 8, torch.zeros(2, dtype=torch.long))
    gathered = torch.gather(x, 2, index[:, None, :, None].expand(2, 3, index.shape[1], 4))
    assert torch.equal(sliced, gathered) and torch.equal(valid, expected_valid)
    padded, padded_valid = gather_window(x, 64, 8, torch.tensor([0, 3]))
    assert torch.equal(padded[0], gathered[0]) and padded_valid.shape == (2, min(T, 64))
