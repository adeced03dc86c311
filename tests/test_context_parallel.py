"""The round plan of context-parallel prompt passes (`trl_longstraw.context_parallel.plan_rounds`); the passes
themselves run on 2 processes in tests/test_distributed.py."""

from __future__ import annotations

import pytest

from trl_longstraw.context_parallel import plan_rounds


@pytest.mark.parametrize(
    ("n", "chunk", "world", "expected"),
    [
        (0, 5, 2, []),
        (1, 5, 2, [[(0, 1)]]),  # fewer tokens than ranks: one replicated pass
        (6, 5, 2, [[(0, 3), (3, 6)]]),  # a short round splits evenly
        (12, 5, 2, [[(0, 5), (5, 10)], [(10, 11), (11, 12)]]),
        (11, 5, 2, [[(0, 5), (5, 10)], [(10, 11)]]),
        (10, 2, 3, [[(0, 2), (2, 4), (4, 6)], [(6, 8), (8, 9), (9, 10)]]),  # the first ranks take the odd tokens
        (9, 4, 1, [[(0, 4)], [(4, 8)], [(8, 9)]]),
    ],
)
def test_plan_rounds(n, chunk, world, expected):
    assert plan_rounds(n, chunk, world) == expected


@pytest.mark.parametrize("world", [2, 3, 8])
@pytest.mark.parametrize("n", [1, 7, 64, 1000, 1031])
def test_plan_rounds_cover_the_prefix(n, world):
    """Passes follow each other without gap; a round has one non-empty chunk per rank, of at most the chunk size."""
    rounds = plan_rounds(n, 64, world)
    bounds = [b for r in rounds for b in r]
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    for r in rounds:
        assert len(r) in (1, world)
        assert all(0 < end - start <= 64 for start, end in r)
