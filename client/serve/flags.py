"""Command-line options generated from settings: each dataclass field declared with
:func:`~tandem.backends.triton.settings.setting` and a flag becomes one argparse option
(its ``dest`` the field's name; ``TANDEM_<FLAG>`` then defaults it, see env_defaults),
and parsed arguments become the dataclass again. A setting is written once, in its
dataclass; nothing here names one.

>>> import argparse
>>> from tandem.backends.triton.settings import EngineSettings
>>> p = argparse.ArgumentParser()
>>> add_flags(p, EngineSettings)
>>> s = from_args(EngineSettings, p.parse_args(["--page-size", "32", "--enforce-eager"]))
>>> (s.page_size, s.enforce_eager, s.kv_layout)
(32, True, 'HND')
>>> dests(EngineSettings)["--threads"]
'torch_threads'
"""
from __future__ import annotations

import argparse
from dataclasses import MISSING, Field, fields
from pathlib import Path

from tandem.backends.triton.settings import FIELD_DEFAULT, flag_of

# a field's annotation -> the argparse type of its option
_TYPES = {"str": str, "int": int, "float": float, "Path | None": Path, "str | None": str}


def flag_fields(cls) -> list[Field]:
    return [f for f in fields(cls) if flag_of(f) is not None]


def default_of(f: Field):
    flag = flag_of(f)
    if flag is not None and flag.default is not FIELD_DEFAULT:
        return flag.default
    return f.default_factory() if f.default is MISSING else f.default


def add_flags(parser: argparse.ArgumentParser, cls) -> None:
    """One option per flagged field of ``cls``."""
    for f in flag_fields(cls):
        flag, default, kind = flag_of(f), default_of(f), str(f.type)
        kwargs: dict = dict(dest=f.name, default=default, help=flag.help or None)
        if kind == "bool":   # a switch: --enforce-eager sets True; --no-supervise sets False
            kwargs["action"] = "store_false" if default else "store_true"
        else:
            kwargs["type"] = _TYPES[kind]
            if flag.choices:
                kwargs["choices"] = flag.choices
            if flag.metavar:
                kwargs["metavar"] = flag.metavar
        parser.add_argument(flag.flag, **kwargs)


def from_args(cls, args: argparse.Namespace, **others):
    """``cls`` with its flagged fields from ``args`` (and ``others``)."""
    return cls(**{f.name: getattr(args, f.name) for f in flag_fields(cls)}, **others)


def dests(*classes) -> dict[str, str]:
    """``{flag: field name}`` of the classes' flagged fields."""
    return {flag_of(f).flag: f.name for cls in classes for f in flag_fields(cls)}
