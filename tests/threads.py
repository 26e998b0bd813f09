"""The intra-op thread count for a block of test code, restored afterwards."""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def num_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def with_threads(n: int, fn):
    """``fn()`` run with ``n`` intra-op threads."""
    with num_threads(n):
        return fn()
