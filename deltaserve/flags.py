"""The flag machinery: options that fall back to DELTASERVE_<FLAG> variables, and the value parsers they use."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from planner_svc.config import model_name_error
from protos.auth import MAX_KEY_CHARS

ENV_PREFIX = "DELTASERVE_"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
_ADDRESS = re.compile(r"(\[[0-9a-fA-F:.]+\]|[^:\s]+):\d{1,5}")
_SHARED_PREFIX = re.compile(r"(?:(messages|tokens):(\d+))|message:(\d+):(\d+)")

EPILOG = f"""\
Every flag can also be given as an environment variable: {ENV_PREFIX}<FLAG>, upper case with
dashes as underscores (--pool-pages 512 is {ENV_PREFIX}POOL_PAGES=512; switches take 1/0,
true/false, yes/no, on/off). A flag on the command line wins over its variable."""


def env_name(flag: str) -> str:
    """--pool-pages -> DELTASERVE_POOL_PAGES."""
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


def default_cache_dir(environ: Mapping[str, str]) -> str:
    """Where snapshots live by default: $XDG_CACHE_HOME/deltaserve, else ~/.cache/deltaserve.

    XDG says a relative XDG_CACHE_HOME is to be ignored."""
    xdg = environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return os.path.join(xdg, "deltaserve")
    home = environ.get("HOME") or os.path.expanduser("~")
    return os.path.join(home, ".cache", "deltaserve")


# ---- value parsers ----

INT32_MAX = 2**31 - 1  # the wire's int32 fields (max_tokens, top_k, token ids, ...)
UINT64_MAX = 2**64 - 1  # the seed's


class BadValue(argparse.ArgumentTypeError, ValueError):
    """A bad flag or variable value; argparse shows the message as is (a plain ValueError it would not)."""


def parse_bool(text: str) -> bool:
    if text.strip().lower() in _TRUE:
        return True
    if text.strip().lower() in _FALSE:
        return False
    raise BadValue(f"expected one of {sorted(_TRUE | _FALSE - {''})}, got {text!r}")


def int_at_least(low: int, high: int | None = None) -> Callable[[str], int]:
    """An integer >= low (and <= high, where given)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise BadValue(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f"in {low}..{high}" if high is not None else f">= {low}"
            raise BadValue(f"expected an integer {bound}, got {value}")
        return value

    return parse


def api_key(text: str) -> str:
    """A key as gRPC metadata and HTTP headers carry one (printable ASCII, at most MAX_KEY_CHARS); the message
    never repeats it."""
    if len(text) > MAX_KEY_CHARS:
        raise BadValue(f"the key has {len(text)} characters; no key has more than {MAX_KEY_CHARS}")
    if not (text.isascii() and text.isprintable()):
        raise BadValue("the key has characters a key cannot send (printable ASCII only)")
    return text


def model_name(text: str) -> str:
    error = model_name_error(text)
    if error:
        raise BadValue(error)
    return text


@dataclass(frozen=True, slots=True)
class TextFile:
    """A file's text, read once when the flag is parsed. Not a str: argparse applies a flag's type again to a
    default (the flag's variable) that is one."""

    text: str


def text_file(path: str) -> TextFile:
    """A non-empty file of UTF-8 text (a chat template), read when the flag is given, so a mistake stops the
    command before any model loads."""
    try:
        text = pathlib.Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise BadValue(f"cannot read {path!r}: {error}") from None
    if not text.strip():
        raise BadValue(f"{path!r} is empty")
    return TextFile(text)


def port(text: str) -> int:
    value = int_at_least(0)(text)
    if value > 65535:
        raise BadValue(f"expected a port in 0..65535, got {value}")
    return value


def float_in(low: float, high: float, *, low_open: bool = False) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise BadValue(f"expected a number, got {text!r}") from None
        if not (low < value if low_open else low <= value) or value > high:
            raise BadValue(
                f"expected a number in {'(' if low_open else '['}{low:g}, {high:g}], got {value:g}"
            )
        return value

    return parse


def int_list(text: str) -> list[int]:
    """'1,2,3' (spaces allowed) -> [1, 2, 3], each a 32-bit integer (what the wire's fields hold)."""
    parts = [part for part in text.replace(" ", ",").split(",") if part]
    try:
        values = [int(part) for part in parts]
    except ValueError:
        raise BadValue(f"expected comma-separated integers, got {text!r}") from None
    for value in values:
        if not -INT32_MAX - 1 <= value <= INT32_MAX:
            raise BadValue(f"expected integers that fit in 32 bits, got {value}")
    return values


def token_ids(text: str) -> list[int]:
    ids = int_list(text)
    if not ids or min(ids) < 0:
        raise BadValue(f"expected non-negative token ids, got {text!r}")
    return ids


def buckets(text: str) -> tuple[int, ...]:
    sizes = int_list(text)
    if not sizes or min(sizes) < 1:
        raise BadValue(f"expected positive batch sizes such as 1,2,4,8, got {text!r}")
    return tuple(sizes)


def prefill_buckets(text: str) -> tuple[int, ...]:
    if text.strip().lower() == "none":
        return ()
    sizes = int_list(text)
    if not sizes or min(sizes) < 1:
        raise BadValue(f"expected positive token counts such as 256,2048, or none, got {text!r}")
    return tuple(sizes)


def device(text: str) -> str:
    if not _DEVICE.fullmatch(text):
        raise BadValue(f"expected auto, cpu, cuda or cuda:N, got {text!r}")
    return text


def address(text: str) -> str:
    if not _ADDRESS.fullmatch(text):
        raise BadValue(f"expected HOST:PORT, got {text!r}")
    return text


def addresses(text: str) -> list[str]:
    """'a:1,b:2' -> ['a:1', 'b:2']."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise BadValue("expected HOST:PORT[,HOST:PORT...]")
    return [address(part) for part in parts]


def address_groups(text: str) -> list[list[str]]:
    """'a:1,b:2;c:3,d:4' -> [['a:1', 'b:2'], ['c:3', 'd:4']]: groups of addresses, separated by semicolons."""
    groups = [addresses(group) for group in text.split(";") if group.strip()]
    if not groups:
        raise BadValue("expected HOST:PORT,HOST:PORT...[;HOST:PORT,...]")
    return groups


def cache_choice(text: str) -> str:
    """`up --cache`: auto (a cache service in this process), off, or the HOST:PORT of a running one."""
    if text in ("auto", "off"):
        return text
    if not _ADDRESS.fullmatch(text):
        raise BadValue(f"expected auto, off or HOST:PORT, got {text!r}")
    return text


def shared_prefix(text: str) -> dict[str, int]:
    """'messages:K' | 'message:I:N' | 'tokens:N' -> GenerateOptions.shared_prefix."""
    match = _SHARED_PREFIX.fullmatch(text.strip())
    if match is None:
        raise BadValue(f"expected messages:K, message:I:N or tokens:N (non-negative integers), got {text!r}")
    kind, count, index, chars = match.groups()
    numbers = [int(n) for n in (count, index, chars) if n is not None]
    if max(numbers) > INT32_MAX:
        raise BadValue(f"expected numbers that fit in 32 bits, got {text!r}")
    if kind is not None:
        return {kind: numbers[0]}
    return {"message": numbers[0], "chars": numbers[1]}


def json_object(text: str) -> dict[str, object]:
    """A JSON object's text -> the dict (the planner checks what its keys may be)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise BadValue(f"expected a JSON object, got {text!r}: {error}") from None
    if not isinstance(value, dict):
        raise BadValue(f"expected a JSON object, got {text!r}")
    return value


# ---- argparse pieces ----


class ExtendReplacingDefault(argparse.Action):
    """Like action="extend", except that values given on the command line replace the default
    (which came from the environment) instead of adding to it."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest, None)
        kept = [] if current is None or current is self.default else current
        setattr(namespace, self.dest, [*kept, *values])


SECRET_METAVAR = "KEY"  # the API key flags: a default from the environment is a secret, never printed


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "%(default)" in text
            or action.default in (None, argparse.SUPPRESS)
            or isinstance(action, argparse.BooleanOptionalAction)  # adds its own
            or not action.option_strings
        ):
            return text
        if action.metavar == SECRET_METAVAR:
            return text + " (default: set from the environment, not shown)"
        return text + " (default: %(default)s)"


class Flags:
    """Adds options to one parser, each defaulting to its DELTASERVE_<FLAG> variable when that is set.

    Bad variables are collected in `env_errors` rather than reported at once, so that a bad
    DELTASERVE_PORT fails only the commands that have --port.
    """

    def __init__(
        self, parser: argparse.ArgumentParser, environ: Mapping[str, str], *, suppress: bool = False
    ):
        self.parser = parser
        self.environ = environ
        # Global flags repeated on a subcommand: set only when given there, never from the environment
        # (the top-level parser already read it).
        self.suppress = suppress
        self.env_errors: list[str] = []

    def _from_env(self, name: str, parse: Callable[[str], Any], choices=None) -> tuple[bool, Any]:
        raw = self.environ.get(name)
        if raw is None or self.suppress:
            return False, None
        try:
            value = parse(raw)
        except ValueError as error:
            shown = "(not shown)" if parse is api_key else repr(raw)  # a key is a secret, even a bad one
            self.env_errors.append(f"{name}={shown}: {error}")
            return False, None
        if choices is not None and value not in choices:
            self.env_errors.append(f"{name}={raw!r}: expected one of {', '.join(map(str, choices))}")
            return False, None
        return True, value

    def option(
        self,
        flag: str,
        *,
        type: Callable[[str], Any] = str,
        default: Any = None,
        required: bool = False,
        help: str,
        env: str | None = None,
        **kwargs,
    ) -> None:
        """`env` names the variable when env_name(flag) would clash with another command's meaning."""
        env = env or env_name(flag)
        found, value = self._from_env(env, type, kwargs.get("choices"))
        if found:
            default, required = value, False
        if self.suppress:
            default = argparse.SUPPRESS
        self.parser.add_argument(
            flag, type=type, default=default, required=required, help=f"{help} [env {env}]", **kwargs
        )

    def switch(self, flag: str, *, default: bool | None = False, help: str) -> None:
        """--flag / --no-flag."""
        found, value = self._from_env(env_name(flag), parse_bool)
        initial: bool | str | None = value if found else default  # a str: argparse.SUPPRESS
        if self.suppress:
            initial = argparse.SUPPRESS
        self.parser.add_argument(
            flag,
            action=argparse.BooleanOptionalAction,
            default=initial,
            help=f"{help} [env {env_name(flag)}]",
        )

    def repeated(self, flag: str, *, type: Callable[[str], list], metavar: str, help: str) -> None:
        """Repeatable, each value comma-separated; the environment variable is comma-separated too."""
        _, value = self._from_env(env_name(flag), type)
        self.parser.add_argument(
            flag,
            type=type,
            default=value,
            action=ExtendReplacingDefault,
            metavar=metavar,
            help=f"{help} [env {env_name(flag)}]",
        )
