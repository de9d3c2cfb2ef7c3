"""Closed intervals ``(start, end)``: merge, measure, parse."""

from intervals.core import merge, overlaps, total_length
from intervals.parse import format_ranges, parse_ranges

__all__ = ["format_ranges", "merge", "overlaps", "parse_ranges", "total_length"]
