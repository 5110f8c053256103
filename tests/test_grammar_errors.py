"""xgrammar's refusals in words (protos/grammar_errors.py), as both services report them."""

from __future__ import annotations

from protos.grammar_errors import compile_error


def test_xgrammars_refusal_loses_its_time_and_source_position():
    error = RuntimeError("[07:09:02] /project/cpp/regex_converter.cc:94: Regex parsing error: Unclosed '['\n")
    assert compile_error(error) == "Regex parsing error: Unclosed '['"
    assert compile_error(RuntimeError("a note\n[07:09:02] /project/cpp/x.cc:7: the reason")) == "the reason"
    assert compile_error(ValueError("plain words")) == "plain words"
    assert compile_error(RuntimeError("")) == "RuntimeError"
