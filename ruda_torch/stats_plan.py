"""StatsPlan: the reduction tree from statistics rows to one 12-byte report."""

from __future__ import annotations

import torch

from . import _build, ops

FAN_IN = _build.MERGE_FAN_IN  # the merge kernel's (kMergeFanIn), 1024
MAX_ROWS = FAN_IN**2 * 4  # at most two intermediate levels: 4,194,304
ROW_WIDTH = 3  # [sum_of_squares, max_abs, nonfinite_count]


class StatsPlan:
    """Plans the merges of ``rows`` statistics rows into one report, fan-in 1024.

    ``levels`` lists the row counts of the intermediate levels (neither the initial rows
    nor the final report); ``scratch_elements`` is the FP32 elements they need
    (``3 * sum(levels)``) and ``scratch_bytes`` the same in bytes. For example
    ``StatsPlan(1024).levels == []``, ``StatsPlan(1025).scratch_elements == 6`` and
    ``StatsPlan(4_194_304).levels == [4096, 4]`` (49,200 bytes, the maximum).
    """

    __slots__ = ("rows", "levels")

    def __init__(self, rows: int):
        if isinstance(rows, bool) or not isinstance(rows, int):
            raise ValueError(f"StatsPlan rows must be an int, got {type(rows).__name__}")
        if not 1 <= rows <= MAX_ROWS:
            raise ValueError(f"StatsPlan rows must be in 1..={MAX_ROWS:,}, got {rows:,}")
        self.rows = rows
        levels = []
        n = rows
        while n > FAN_IN:
            n = -(-n // FAN_IN)
            levels.append(n)
        self.levels = levels

    @property
    def scratch_elements(self) -> int:
        return ROW_WIDTH * sum(self.levels)

    @property
    def scratch_bytes(self) -> int:
        return 4 * self.scratch_elements

    def __repr__(self) -> str:
        return (
            f"StatsPlan(rows={self.rows}, levels={self.levels}, scratch_bytes={self.scratch_bytes})"
        )

    def reduce(self, rows: torch.Tensor, scratch: torch.Tensor, out: torch.Tensor) -> None:
        """Merge ``rows`` (``[self.rows, 3]``) into ``out`` (3 elements) through the
        intermediate levels, which live in ``scratch`` (at least ``scratch_elements``
        FP32 elements, allocated once by the caller)."""
        if rows.shape != (self.rows, ROW_WIDTH):
            raise ValueError(f"rows must have shape ({self.rows}, 3), got {tuple(rows.shape)}")
        if scratch.numel() < self.scratch_elements:
            raise ValueError(
                f"scratch holds {scratch.numel()} elements, the plan needs {self.scratch_elements}"
            )
        src = rows
        offset = 0
        for n in self.levels:
            dst = scratch[offset : offset + ROW_WIDTH * n].view(n, ROW_WIDTH)
            ops.merge_gradient_stats(src, dst)
            src = dst
            offset += ROW_WIDTH * n
        ops.merge_gradient_stats(src, out.view(1, ROW_WIDTH))


def row_pieces(numels: list[int]) -> list[tuple[int, int, int]]:
    """Split a bucket's gradients (given by their sizes) into runs of at most MAX_ROWS
    statistics rows: (first tensor, end tensor, rows). A bucket normally is one piece."""
    pieces, lo, rows = [], 0, 0
    for i, numel in enumerate(numels):
        r = ops.stats_rows_for(numel)
        if r > MAX_ROWS:
            raise ValueError(
                f"a gradient of {numel:,} elements needs {r:,} statistics rows; one report "
                f"holds at most {MAX_ROWS:,} rows ({MAX_ROWS * _build.STATS_CHUNK:,} elements)"
            )
        if rows + r > MAX_ROWS:
            pieces.append((lo, i, rows))
            lo, rows = i, 0
        rows += r
    if rows > 0 or not pieces:
        pieces.append((lo, len(numels), rows))
    return [p for p in pieces if p[2] > 0]
