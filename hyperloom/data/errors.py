"""The one exception type the data pipeline raises for problems a user can fix.

Everything that is the user's fault (a missing path, a malformed JSONL line, a tokenizer that
does not fit the model, a split too small for the sequence length) raises `DataError` with a
message that says what was wrong and what is allowed, so the CLI can print it without a
traceback. It subclasses `ValueError` so generic callers that catch bad input still work.
"""

from __future__ import annotations


class DataError(ValueError):
    """A data configuration or corpus problem, with a message meant for the user."""


def fmt_int(n: int) -> str:
    """Thousands separators for numbers in error messages: 1234567 -> '1,234,567'."""
    return f"{n:,}"
