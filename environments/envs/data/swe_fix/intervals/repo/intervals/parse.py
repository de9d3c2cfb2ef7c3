"""Text forms of interval lists: "1-3, 5, 8-10"."""


def parse_ranges(text):
    """``"1-3, 5"`` -> ``[(1, 3), (5, 5)]`` (in the order written)."""
    intervals = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        start, sep, end = part.partition("-")
        start = int(start)
        intervals.append((start, int(end) if sep else start))
    return intervals


def format_ranges(intervals):
    """``[(1, 3), (5, 5)]`` -> ``"1-3, 5"``."""
    return ", ".join(str(s) if s == e else f"{s}-{e}" for s, e in intervals)
