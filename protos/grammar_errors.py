"""xgrammar's refusals in words, as the planner (checking a schema at intake) and the executor (compiling the
grammar a plan writes) report them."""

from __future__ import annotations

import re

# xgrammar's messages start with a time and its C++ source: "[07:09:02] /project/cpp/x.cc:94: Unsupported ..."
_SOURCE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def compile_error(error: Exception) -> str:
    """xgrammar's refusal in words: its message's last line, less the time and source position."""
    lines = str(error).strip().splitlines()
    return _SOURCE_PREFIX.sub("", lines[-1]) if lines else type(error).__name__
