"""Operations on closed intervals, given as ``(start, end)`` pairs with start <= end."""


def _check(interval):
    start, end = interval
    if start > end:
        raise ValueError(f"interval {interval!r} ends before it starts")
    return start, end


def overlaps(a, b):
    """Whether the closed intervals ``a`` and ``b`` share a point."""
    (a_start, a_end), (b_start, b_end) = _check(a), _check(b)
    return a_start <= b_end and b_start <= a_end


def merge(intervals):
    """The union of ``intervals`` as a sorted list of disjoint intervals; intervals that
    overlap or touch are joined. The input is not modified."""
    merged = []
    for start, end in sorted(map(_check, intervals)):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def total_length(intervals):
    """How much of the line ``intervals`` cover (overlaps counted once)."""
    return sum(end - start for start, end in merge(intervals))
