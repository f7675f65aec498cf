"""Command-line flags generated from a configuration dataclass: one flag per field, its default
the dataclass's, its help the field's docstring, so no default is restated by hand.

A field's ``metadata["flag"]`` (a :class:`Flag`, see :func:`flag`) may rename the flag, add
aliases, give a parser or a shorter help, or say the field is computed from other flags
(``derived``); a caller may pass the same per field for a dataclass it does not own.
:func:`config_kwargs` turns the parsed namespace back into the dataclass's keyword arguments,
leaving out a value that was not given where the dataclass computes its own default (a
``default_factory``).

The bottom layer: no flashckpt imports, no torch.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import itertools
import textwrap
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Union

__all__ = [
    "Flag",
    "add_dataclass_args",
    "config_kwargs",
    "field_docs",
    "flag",
    "flag_fields",
    "storage_url",
]


@dataclass(frozen=True, slots=True)
class Flag:
    """How one dataclass field appears on the command line."""

    names: tuple[str, ...] = ()
    """Option strings, first the main one (default: ``--field-name``)."""
    help: str | None = None
    """Help text (default: the first sentence of the field's docstring)."""
    parse: Callable[[str], Any] | None = None
    """Converts the flag's text (default: from the field's type)."""
    to_field: Callable[[Any], Any] | None = None
    """Converts the parsed value to the field's value (e.g. a port 0 meaning off to None)."""
    action: str | None = None
    """An argparse action (``store_true``...); booleans get one from their default."""
    choices: tuple[Any, ...] | None = None
    """The values allowed."""
    metavar: str | None = None
    """The value's name in the help."""
    derived: str | None = None
    """The field is computed by the caller from this flag (declared elsewhere), not parsed."""
    hidden: bool = False
    """Declared, but left out of ``--help``."""

    def __post_init__(self) -> None:
        if any(not n.startswith("-") for n in self.names):
            raise ValueError(f"flag names {self.names} must start with '-'")


def flag(*names: str, **kw: Any) -> dict[str, Flag]:
    """Field metadata: ``field(default=3, metadata=flag("--keep", help="..."))``."""
    return {"flag": Flag(names=names, **kw)}


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its docstring (the string literal right after the field), read from the
    class's source; empty where the source is not available."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    out: dict[str, str] = {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for prev, node in itertools.pairwise(body):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            out[prev.target.id] = inspect.cleandoc(node.value.value)
    return out


def _first_sentence(doc: str) -> str:
    text = " ".join(doc.split())
    end = text.find(". ")
    text = text if end < 0 else text[: end + 1]
    return text.replace("%", "%%")


def _spec(cls: type, f: dataclasses.Field[Any], override: Mapping[str, Flag]) -> Flag:
    spec = override.get(f.name) or f.metadata.get("flag") or Flag()
    if not isinstance(spec, Flag):
        raise TypeError(f"{cls.__name__}.{f.name}: metadata['flag'] is not a Flag")
    return spec


def _base_type(tp: Any) -> Any:
    """``int`` of ``int | None``; the type itself otherwise."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return tp


def _default(f: dataclasses.Field[Any]) -> tuple[Any, bool]:
    """(the field's default, whether it has one); a factory is called (for the help only: one
    that fails, e.g. on a bad environment variable, fails where the config is built)."""
    if f.default is not dataclasses.MISSING:
        return f.default, True
    if f.default_factory is not dataclasses.MISSING:
        try:
            return f.default_factory(), True
        except (ValueError, OSError):
            return "computed", True
    return None, False


def _type_error(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` with its ValueError shown as argparse shows a bad value (the message kept)."""

    @functools.wraps(parse)
    def wrapped(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return wrapped


def flag_fields(cls: type, flags: Mapping[str, Flag] | None = None) -> list[tuple[str, Flag]]:
    """Every field of ``cls`` with its flag (``derived`` ones included)."""
    flags = flags or {}
    return [(f.name, _spec(cls, f, flags)) for f in dataclasses.fields(cls)]


def add_dataclass_args(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    flags: Mapping[str, Flag] | None = None,
    skip: Iterable[str] = (),
    dest_prefix: str = "",
) -> None:
    """Adds one flag per field of the dataclass ``cls`` to ``parser``.

    Args:
        flags: per-field flags for a dataclass whose fields carry none (they win over metadata).
        skip: fields added by hand (e.g. a nested config, given its own group).
        dest_prefix: prefix of the namespace attributes (``dest``), for nested configs.
    """
    flags = flags or {}
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        spec = _spec(cls, f, flags)
        if spec.derived is not None:
            continue
        default, has_default = _default(f)
        names = spec.names or ("--" + f.name.replace("_", "-"),)
        help_text = spec.help if spec.help is not None else _first_sentence(docs.get(f.name, ""))
        kw: dict[str, Any] = {
            "dest": dest_prefix + f.name,
            "help": argparse.SUPPRESS if spec.hidden else help_text,
        }
        tp = _base_type(hints[f.name])
        choices = spec.choices
        if typing.get_origin(tp) is typing.Literal:
            choices = choices or typing.get_args(tp)
            tp = type(typing.get_args(tp)[0])
        action = spec.action
        if action is None and tp is bool:
            action = "store_false" if default else "store_true"
        if action is not None:
            kw["action"] = action
            if action in ("store_true", "store_false"):
                # The flag's own default is the bool argparse implies; to_field maps it when
                # the field is not a bool (``--shared-read`` -> a file mode).
                kw["default"] = action == "store_false"
        else:
            kw["type"] = _type_error(spec.parse) if spec.parse is not None else tp
            if has_default and f.default_factory is dataclasses.MISSING:
                kw["default"] = default
            elif has_default:
                # The dataclass computes it (host name, run dir, environment): shown, and left
                # to the dataclass when not given (config_kwargs drops None).
                kw["default"] = None
                if not spec.hidden and "default" not in help_text:
                    kw["help"] = f"{help_text} (default: {default})".strip()
            else:
                kw["required"] = True
            if choices is not None:
                kw["choices"] = choices
            else:
                long = next((n for n in names if n.startswith("--")), names[0])
                kw["metavar"] = spec.metavar or long.lstrip("-").replace("-", "_").upper()
            show = has_default and default is not None and "default" not in kw["help"]
            if show and not spec.hidden and f.default_factory is dataclasses.MISSING:
                kw["help"] = f"{kw['help']} (default: %(default)s)".strip()
        parser.add_argument(*names, **kw)


def config_kwargs(
    cls: type,
    args: argparse.Namespace,
    *,
    flags: Mapping[str, Flag] | None = None,
    skip: Iterable[str] = (),
    dest_prefix: str = "",
) -> dict[str, Any]:
    """The keyword arguments of ``cls`` from a namespace parsed with :func:`add_dataclass_args`
    (derived and skipped fields left to the caller)."""
    flags = flags or {}
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        spec = _spec(cls, f, flags)
        if f.name in skip or spec.derived is not None:
            continue
        value = getattr(args, dest_prefix + f.name)
        if value is None and f.default_factory is not dataclasses.MISSING:
            continue  # not given: the dataclass's own default
        out[f.name] = spec.to_field(value) if spec.to_field is not None else value
    return out


def storage_url(text: str) -> str:
    """A checkpoint root URL or path given on the command line, refused where it would land
    somewhere else than meant.

    ``file://tmp/x`` (two slashes) reads ``tmp`` as a host name, and fsspec then writes to
    ``./tmp/x``, relative to the working directory, without a word.

    Raises:
        ValueError: For a ``file://`` URL with a host part, naming the three-slash form.
    """
    scheme, sep, rest = text.partition("://")
    if sep and scheme.lower() == "file" and not rest.startswith("/"):
        host = rest.split("/", 1)[0]
        raise ValueError(
            f"{text!r}: a file:// URL names an absolute path after its two slashes, but here "
            f"{host!r} follows them (read as a host, the path would be relative to the working "
            f"directory): write 'file:///{rest}' for /{rest}, or a plain path"
        )
    return text
