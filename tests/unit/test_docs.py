"""The docs cannot drift from the code: docs/SERVING.md's inputs and outputs tables list
exactly what ``generate_request.INPUTS`` / ``response_arrays`` and the ensembles'
``config.pbtxt`` declare (names, types, shapes), and every relative link in README.md
and docs/*.md points at a file (and heading) that exists."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tandem.backends.triton.generate_request import INPUTS
from tandem.backends.triton.response_arrays import TOKEN_OUTPUT_NAMES

ROOT = Path(__file__).resolve().parents[2]
SERVING = ROOT / "docs" / "SERVING.md"
ENSEMBLES = ("tandem", "tandem_tokens", "tandem_colocated")
SHAPES = {"[1, 1]": [1], "[1, N]": [-1], "[1, N, D]": [-1, -1], "[1, N, 3]": [-1, 3]}   # the table's request shape -> config dims


# -- markdown, just enough of it ------------------------------------------------------

def _without_code_blocks(text: str) -> str:
    """The text with every fenced block blanked (line numbers kept)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else line)
    return "\n".join(out)


def _cells(line: str) -> list[str]:
    cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))
    return [c.strip().replace("\\|", "|") for c in cells]


def tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every pipe table: (header cells, rows of cells)."""
    found, lines = [], _without_code_blocks(text).splitlines()
    i = 0
    while i + 1 < len(lines):
        if lines[i].startswith("|") and re.fullmatch(r"\|?(\s*:?-+:?\s*\|)+\s*:?-*:?\s*", lines[i + 1]):
            header, rows, i = _cells(lines[i]), [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            found.append((header, rows))
        else:
            i += 1
    return found


def table_after(text: str, first_header: str) -> list[dict[str, str]]:
    """The one table whose first header cell is ``first_header``, as dicts."""
    (match,) = [(h, rows) for h, rows in tables(text) if h[0] == first_header]
    header, rows = match
    for row in rows:
        assert len(row) == len(header), f"a row of the {first_header!r} table has {len(row)} cells: {row}"
    return [dict(zip(header, row)) for row in rows]


def documented(rows: list[dict[str, str]], name_column: str) -> dict[str, dict[str, str]]:
    """name -> its row; a row may name several tensors (`a`, `b`) that share type and shape.
    A name listed twice is an error."""
    out: dict[str, dict[str, str]] = {}
    for row in rows:
        names = re.findall(r"`([a-z_]+)`", row[name_column])
        assert names, f"no `name` in row {row}"
        for name in names:
            assert name not in out, f"{name} is listed twice"
            out[name] = row
    return out


def inputs_table(text: str) -> dict[str, tuple[str, list[int]]]:
    """SERVING.md's inputs table as ``INPUTS`` spells it: name -> (TYPE_X, dims)."""
    rows = documented(table_after(text, "input"), "input")
    out = {}
    for name, row in rows.items():
        shape = row["shape"].strip("`")
        assert shape in SHAPES, f"{name}: shape {shape!r}; write one of {sorted(SHAPES)}"
        out[name] = (f"TYPE_{row['type']}", SHAPES[shape])
    return out


def outputs_table(text: str) -> dict[str, str]:
    """SERVING.md's outputs table: name -> TYPE_X."""
    return {name: f"TYPE_{row['type']}" for name, row in documented(table_after(text, "output"), "output").items()}


def ensemble_config(name: str):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    path = ROOT / "model_repository" / name / "config.pbtxt"
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


# -- the tables, against the code and the configs ---------------------------------------

def test_the_inputs_table_is_exactly_INPUTS():
    table = inputs_table(SERVING.read_text())
    assert sorted(set(INPUTS) - set(table)) == [], "inputs missing from docs/SERVING.md"
    assert sorted(set(table) - set(INPUTS)) == [], "inputs in docs/SERVING.md that INPUTS lacks"
    wrong = {n: (table[n], tuple(INPUTS[n])) for n in INPUTS if tuple(table[n]) != tuple(INPUTS[n])}
    assert wrong == {}, "type or shape differs (docs, INPUTS)"


@pytest.mark.parametrize("ensemble", ENSEMBLES)
def test_every_ensemble_input_is_in_the_table_as_declared(ensemble):
    from tritonclient.grpc import model_config_pb2

    table = inputs_table(SERVING.read_text())
    for i in ensemble_config(ensemble).input:
        declared = (model_config_pb2.DataType.Name(i.data_type), list(i.dims))
        assert table.get(i.name) == declared, (ensemble, i.name)


def test_the_table_has_no_input_that_no_ensemble_declares():
    declared = {i.name for e in ENSEMBLES for i in ensemble_config(e).input}
    assert set(inputs_table(SERVING.read_text())) == declared


def test_the_outputs_table_is_exactly_what_the_ensembles_return():
    from tritonclient.grpc import model_config_pb2

    table = outputs_table(SERVING.read_text())
    assert sorted(table) == sorted(TOKEN_OUTPUT_NAMES)
    for e in ENSEMBLES:
        for o in ensemble_config(e).output:
            assert table[o.name] == model_config_pb2.DataType.Name(o.data_type), (e, o.name)


# -- the checker catches a missing, an extra and a mistyped row ---------------------------

ROW = "| `max_tokens` | INT32 | `[1, 1]` | 16 | >= 1 |\n"


def _table_of_INPUTS() -> str:
    """A correct inputs table written from ``INPUTS`` (max_tokens as ``ROW``)."""
    shape = {dims: text for text, dims in ((t, tuple(d)) for t, d in SHAPES.items())}
    rows = [f"| `{n}` | {t.removeprefix('TYPE_')} | `{shape[tuple(d)]}` | - | - |\n"
            for n, (t, d) in INPUTS.items() if n != "max_tokens"]
    return "| input | type | shape | default | allowed |\n|---|---|---|---|---|\n" + ROW + "".join(rows)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t, None),
    (lambda t: t.replace(ROW, ""), "inputs missing"),
    (lambda t: t.replace(ROW, ROW + "| `max_new_tokens` | INT32 | `[1, 1]` | 16 | >= 1 |\n"), "INPUTS lacks"),
    (lambda t: t.replace(ROW, ROW.replace("INT32", "INT64")), "type or shape differs"),
    (lambda t: t.replace(ROW, ROW.replace("[1, 1]", "[1, N]")), "type or shape differs"),
    (lambda t: t.replace(ROW, ROW + ROW), "listed twice"),
])
def test_a_drifted_table_fails(monkeypatch, tmp_path, edit, message):
    drifted = tmp_path / "SERVING.md"
    drifted.write_text("# Serving\n\n" + edit(_table_of_INPUTS()) + "\nText after it.\n")
    monkeypatch.setattr(sys.modules[__name__], "SERVING", drifted)
    if message is None:
        test_the_inputs_table_is_exactly_INPUTS()
        return
    with pytest.raises(AssertionError, match=message):
        test_the_inputs_table_is_exactly_INPUTS()


# -- links ------------------------------------------------------------------------------

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def links(text: str) -> list[str]:
    text = re.sub(r"`[^`\n]*`", "", _without_code_blocks(text))   # no code spans either
    return LINK.findall(text)


def anchors(text: str) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens, -1, -2
    for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for line in _without_code_blocks(text).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(path: Path) -> list[str]:
    bad = []
    for target in links(path.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):      # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{path.name}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            bad.append(f"{path.name}: {target} (no such heading in {dest.name})")
    return bad


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    assert broken_links(path) == []


def test_the_link_checker_sees_a_broken_link(tmp_path):
    (tmp_path / "there.md").write_text("# A heading, with `code`\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md) [ok](there.md#a-heading-with-code) [web](https://x.org/y)\n"
                    "[gone](missing.md) [gone](there.md#nope)\n```\n[in code](not-checked.md)\n```\n")
    assert broken_links(page) == ["page.md: missing.md (no such file)",
                                  "page.md: there.md#nope (no such heading in there.md)"]
