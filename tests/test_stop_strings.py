"""Stop strings on a stream of text pieces (planner_svc/stop_strings.py), alone."""

from __future__ import annotations

import pytest

from planner_svc.stop_strings import StopStrings


def run(stops, pieces, armed_from=0):
    matcher, out = StopStrings(stops), []
    for index, piece in enumerate(pieces):
        text, matched = matcher.feed(piece, armed=index >= armed_from)
        out.append(text)
        if matched is not None:
            return "".join(out), matched
    return "".join(out) + matcher.flush(), None


def test_a_stop_split_across_pieces_is_found_and_left_out():
    assert run(["\n\n"], ["Paris.", "\n", "\nThe"]) == ("Paris.", "\n\n")
    assert run(["END"], ["a E", "N", "D b"]) == ("a ", "END")


def test_held_text_goes_out_once_it_cannot_start_a_stop():
    matcher = StopStrings(["abc"])
    assert matcher.feed("xa") == ("x", None)
    assert matcher.feed("b") == ("", None)
    assert matcher.feed("x") == ("abx", None)
    assert matcher.feed("ab") == ("", None)
    assert matcher.flush() == "ab"


def test_the_earliest_match_wins_then_the_first_listed():
    assert run(["world", "lo"], ["hello world"]) == ("hel", "lo")
    assert run(["ab", "a"], ["xab"]) == ("x", "ab")


def test_no_stop_passes_everything():
    assert run(["zz"], ["a", "b", "z", "c"]) == ("abzc", None)


def test_unarmed_pieces_neither_match_nor_hold():
    assert run(["a"], ["a", "ba"], armed_from=1) == ("ab", "a")


def test_empty_stop_is_refused():
    with pytest.raises(ValueError):
        StopStrings(["ok", ""])
