"""Training corpus: the running interpreter's standard-library sources.

Files are read in sorted relative-path order and split into train/validation by a
hash of the relative path, so the split does not depend on which other files exist.
Held-out prompts (function signatures, docstring openings, class headers) are cut
from validation files only.

>>> corpus = build_corpus()                      # doctest: +SKIP
>>> len(corpus.train), len(corpus.validation)    # doctest: +SKIP
(499, 28)
"""
from __future__ import annotations

import ast
import hashlib
import json
import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path

# test suites, third-party code and GUI demos; pydoc_data is one 700 kB string literal
# and encodings/ is ~100 generated charmap tables (they would inflate acceptance rates)
EXCLUDED_DIRS = frozenset({
    "test", "tests", "site-packages", "dist-packages", "idlelib", "turtledemo",
    "pydoc_data", "encodings", "__pycache__",
})
PROMPT_KINDS = ("function_signature", "docstring_opening", "class_header")


@dataclass(slots=True, frozen=True)
class Document:
    path: str       # posix path relative to the stdlib root
    text: str


@dataclass(slots=True)
class Corpus:
    root: str
    train: list[Document] = field(default_factory=list)
    validation: list[Document] = field(default_factory=list)

    def manifest(self) -> dict:
        """Small, JSON-able description: which files went where (no text)."""
        return {"root": self.root,
                "train": [d.path for d in self.train],
                "validation": [d.path for d in self.validation]}


@dataclass(slots=True, frozen=True)
class Prompt:
    kind: str       # one of PROMPT_KINDS
    path: str
    line: int       # 1-based line of the header in its file
    prompt: str     # preceding context + header up to its ":" (or docstring's first words)
    reference: str  # the next few source lines, for eyeballing samples


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_sources(root: str | Path | None = None) -> list[str]:
    """Relative posix paths of the .py files under root, sorted, exclusions applied."""
    root = Path(root) if root is not None else stdlib_root()
    paths = []
    for f in root.rglob("*.py"):
        rel = f.relative_to(root)
        if EXCLUDED_DIRS.isdisjoint(rel.parts[:-1]) and f.is_file():
            paths.append(rel.as_posix())
    return sorted(paths)


def is_validation(path: str, val_fraction: float) -> bool:
    """Stable per-file split: the first 8 bytes of sha256(path) as a fraction of 2**64."""
    h = int.from_bytes(hashlib.sha256(path.encode()).digest()[:8], "big")
    return h / 2**64 < val_fraction


def build_corpus(root: str | Path | None = None, val_fraction: float = 0.05) -> Corpus:
    root = Path(root) if root is not None else stdlib_root()
    corpus = Corpus(root=str(root))
    for rel in list_sources(root):
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a handful of stdlib files are latin-1 test fixtures
        if not text.strip():
            continue
        doc = Document(rel, text)
        (corpus.validation if is_validation(rel, val_fraction) else corpus.train).append(doc)
    return corpus


def _header_end(lines: list[str], node: ast.AST) -> int | None:
    """0-based index one past the last line of a def/class header, or None if one-line."""
    body_start = node.body[0].lineno - 1
    if body_start < node.lineno:          # `def f(): pass` on one line
        return None
    end = body_start
    while end > node.lineno and not lines[end - 1].split("#")[0].rstrip().endswith(":"):
        end -= 1                          # skip comments/blank lines between header and body
    return end


def extract_prompts(doc: Document, context_lines: int = 12,
                    reference_lines: int = 6) -> list[Prompt]:
    """Prompts from one file: `context_lines` of preceding source, then the header."""
    try:
        tree = ast.parse(doc.text)
    except SyntaxError:
        return []
    lines = doc.text.splitlines(keepends=True)
    prompts = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        end = _header_end(lines, node)
        if end is None:
            continue
        first = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
        start = max(0, first - context_lines)
        # end at the colon: BPE merges a newline with the next line's indentation,
        # so a prompt ending in "\n" would force a token boundary never seen in training
        head = "".join(lines[start:end]).removesuffix("\n")
        ref = "\n" + "".join(lines[end:end + reference_lines])
        is_class = isinstance(node, ast.ClassDef)
        prompts.append(Prompt("class_header" if is_class else "function_signature",
                              doc.path, node.lineno, head, ref))
        doc_node = node.body[0]
        if (not is_class and isinstance(doc_node, ast.Expr)
                and isinstance(doc_node.value, ast.Constant)
                and isinstance(doc_node.value.value, str)):
            # the docstring's opening quotes and its first words
            line = lines[doc_node.lineno - 1]
            col = doc_node.col_offset
            quote = line[col:col + 3] if line[col:col + 3] in ('"""', "'''") else line[col]
            opening = line[:col + len(quote)]
            words = line[col + len(quote):].split(" ")[:3]
            opening += " ".join(words).rstrip("\n")
            if words and opening.strip() != quote:
                prompts.append(Prompt("docstring_opening", doc.path, doc_node.lineno,
                                      "".join(lines[start:doc_node.lineno - 1]) + opening,
                                      line[len(opening):] + "".join(
                                          lines[doc_node.lineno:doc_node.lineno + reference_lines])))
    return sorted(prompts, key=lambda p: (p.line, p.kind))


def held_out_prompts(corpus: Corpus, per_kind: int = 64) -> list[Prompt]:
    """Up to `per_kind` prompts of each kind from validation files, spread by hash."""
    pool = [p for doc in corpus.validation for p in extract_prompts(doc)]
    chosen = []
    for kind in PROMPT_KINDS:
        of_kind = [p for p in pool if p.kind == kind]
        of_kind.sort(key=lambda p: hashlib.sha256(f"{p.path}:{p.line}:{kind}".encode()).digest())
        chosen += sorted(of_kind[:per_kind], key=lambda p: (p.path, p.line))
    return chosen


def save_prompts(prompts: list[Prompt], path: str | Path) -> None:
    Path(path).write_text(json.dumps([asdict(p) for p in prompts], indent=1) + "\n")


def load_prompts(path: str | Path) -> list[Prompt]:
    return [Prompt(**p) for p in json.loads(Path(path).read_text())]


def held_out_prompt_ids(path: str | Path, tokenizer, n: int, max_prompt_tokens: int = 256,
                        by_kind: bool = True) -> list[list[int]]:
    """Token ids of ``n`` prompts of a prompts.json (:func:`save_prompts`), each cut to its
    last ``max_prompt_tokens`` tokens: the same number of each kind (``by_kind``: kinds
    taken in turn) or the first ``n`` in the file."""
    prompts = load_prompts(path)
    if not by_kind:
        picked = prompts[:n]
    else:
        kinds = list(dict.fromkeys(p.kind for p in prompts))
        per_kind = {k: [p for p in prompts if p.kind == k] for k in kinds}
        picked, i = [], 0
        while len(picked) < n and i < max(map(len, per_kind.values())):
            picked += [per_kind[k][i] for k in kinds if i < len(per_kind[k])][:n - len(picked)]
            i += 1
    return [tokenizer.encode(p.prompt).ids[-max_prompt_tokens:] for p in picked]
