"""generation/transfers.py: the decoding loop's one way to move data between host and device (its counts are what
tests/test_sync_count.py bounds per cycle)."""

import math

import pytest
import torch

from eagle3_hf.generation import transfers
from eagle3_hf.generation.transfers import COUNT, Clock, read, upload


def test_upload_gives_each_list_its_shape_and_dtype_in_one_count():
    before = COUNT.uploads
    tokens, rows, scores = upload(torch.device("cpu"), [5, 6, 7], [[1, 2], [3, 4]], [0.0, -1.5, -math.inf], floats=[2])
    assert COUNT.uploads == before + 1
    assert tokens.dtype == torch.long and tokens.tolist() == [5, 6, 7]
    assert rows.shape == (2, 2) and rows.tolist() == [[1, 2], [3, 4]]
    assert scores.dtype == torch.float32 and scores.tolist() == [0.0, -1.5, -math.inf]


def test_the_staging_buffer_carries_ints_and_float32_bits_exactly():
    """What a CUDA upload copies: one int64 buffer, float32 values as their bits; unpacked, every value is back."""
    arrays = ([3, 49151, 0], [[2, -1], [7, 8]], [0.1, -2.75, 1e-30, -math.inf], [])
    staged, shapes = transfers._stage(arrays, {2})
    assert staged.dtype == torch.long and staged.numel() == 3 + 4 + 4
    ints, grid, floats, empty = transfers._unstage(staged.clone(), shapes, {2})
    assert ints.tolist() == [3, 49151, 0] and grid.tolist() == [[2, -1], [7, 8]] and empty.numel() == 0
    assert torch.equal(floats, torch.tensor([0.1, -2.75, 1e-30, -math.inf], dtype=torch.float32))


def test_upload_refuses_ragged_rows():
    with pytest.raises(ValueError, match="equal-length rows"):
        transfers._stage(([[1, 2], [3]],), set())


def test_read_packs_every_tensor_into_one_read():
    before = COUNT.reads
    values = read([torch.tensor([1, 2]), torch.tensor([[0.5], [0.25]]), torch.tensor([True, False])])
    assert COUNT.reads == before + 1
    assert values == [[1.0, 2.0], [0.5, 0.25], [1.0, 0.0]]
    assert read([]) == [] and COUNT.reads == before + 1  # nothing to read: no read


def test_the_cpu_clock_measures_host_time_and_delivers_at_once():
    clock = Clock(torch.device("cpu"))
    start = clock.mark()
    end = clock.mark()
    assert clock.seconds(start, end) == end - start >= 0.0
    got = []
    clock.later(start, end, got.append)
    assert got == [end - start]
    clock.settle()
    assert got == [end - start]
