"""What ``tandem bench peers`` sends and where it runs: the machine's CPU (model, the
flags that decide the dtype), the prompts (cold: unique; warm: one shared prefix and a
unique suffix, cut from the standard library's source, the same for every server),
the requests, the ``--dtype`` both servers accept, and the CPU that servers not under
measurement burn meanwhile.

>>> exact_request("tandem", "def f():", 128, vllm=True).ignore_eos
True
>>> kinds(5)
['cold', 'warm', 'cold', 'warm', 'cold']
"""
from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from tandem.client.bench.args import ArgumentTypeError
from tandem.client.bench.report import cpu_info
from tandem.client.bench.request_client import RequestInput
from tandem.client.serve.process_group import live_processes


def auto_dtype(info: dict) -> str:
    """bf16 only where the CPU computes it natively; fp32 otherwise (bf16 emulated on
    AVX2 is several times slower).

    >>> auto_dtype({"flags": ["avx2"]}), auto_dtype({"flags": ["avx2", "amx_bf16"]})
    ('float32', 'bfloat16')
    """
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & set(info["flags"]) else "float32"


def dtype(text: str) -> str:
    """``--dtype``: float32 or bfloat16, which vLLM's CPU build and Tandem both serve, or
    auto (:func:`auto_dtype` of this machine)."""
    if text not in ("auto", "float32", "bfloat16"):
        raise ArgumentTypeError(f"must be auto, float32 or bfloat16, got {text!r}")
    return auto_dtype(cpu_info()) if text == "auto" else text


def kinds(n: int) -> list[str]:
    """Cold and warm requests alternate within a level, so both meet the same load."""
    return ["cold" if i % 2 == 0 else "warm" for i in range(n)]


def requests_per_level(minimum: int, concurrency: int) -> int:
    """At least two requests per stream: every stream then starts one under full load."""
    return max(minimum, 2 * concurrency)


def exact_request(model: str, prompt: str, max_tokens: int, vllm: bool, kind: str = "request") -> RequestInput:
    """A greedy stream of exactly ``max_tokens`` tokens (min = max; vLLM also needs
    ``ignore_eos``, as min_tokens alone still stops at a stop string)."""
    return RequestInput(prompt, max_tokens, kind=kind, model=model, min_tokens=max_tokens, ignore_eos=vllm)


@dataclass(slots=True)
class Prompts:
    """Texts of about the given token counts from disjoint windows of one token stream:
    ``prefix`` (shared by the warm prompts), then unique ``cold`` and ``suffixes``."""
    prefix: str
    cold: list[str]
    suffixes: list[str]

    @classmethod
    def cut(cls, tokenizer_json: Path, n: int, prefix_tokens: int, suffix_tokens: int) -> "Prompts":
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(tokenizer_json))
        cold_len = prefix_tokens + suffix_tokens
        need = prefix_tokens + n * (cold_len + suffix_tokens)
        ids: list[int] = []
        for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
            ids += tok.encode(f.read_text(errors="replace")).ids
            if len(ids) >= need:
                break
        if len(ids) < need:
            raise ValueError(f"the standard library holds {len(ids)} tokens; {need} needed for {n} prompts")
        pos = prefix_tokens
        cold, suffixes = [], []
        for _ in range(n):
            cold.append(tok.decode(ids[pos:pos + cold_len]))
            suffixes.append(tok.decode(ids[pos + cold_len:pos + cold_len + suffix_tokens]))
            pos += cold_len + suffix_tokens
        return cls(tok.decode(ids[:prefix_tokens]), cold, suffixes)

    def level(self, start: int, n: int) -> list[tuple[str, str]]:
        """``n`` (kind, prompt) of a level, alternating cold and warm; the cold ones and
        the warm suffixes from ``start`` on (each level and repeat its own)."""
        return [(kind, self.cold[start + i] if kind == "cold" else self.prefix + self.suffixes[start + i])
                for i, kind in enumerate(kinds(n))]


# a chat request's question around the cut text: cold prompts ask about unique code,
# warm ones about the one shared prefix (what the prefix cache keeps) and a unique part
CHAT_COLD = "Explain what this Python code does, step by step:\n\n```python\n{text}\n```"
CHAT_WARM = "{text}\n```\n\nExplain what the last lines above do and how they fit the rest."


def chat_text(kind: str, text: str, prefix: str) -> str:
    """The user message of a chat request cut as ``kind`` (warm: ``prefix`` + its suffix).

    >>> chat_text("warm", "p" + "s", "p").startswith("Here is a Python module")
    True
    """
    if kind != "warm":
        return CHAT_COLD.format(text=text)
    return CHAT_WARM.format(text="Here is a Python module:\n\n```python\n" + text)


def role(pid: int, root: int, comm: str, argv: list[str]) -> str:
    """What a server's process is, for its CPU per token: a Triton stub by its model,
    tritonserver, the root (``tandem serve``: the supervisor and the OpenAI frontend;
    vLLM: its API server), else the process's name (vLLM's ``VLLM::EngineCore``).

    >>> role(5, 5, "python", ["python", "-m", "vllm.entrypoints.openai.api_server"])
    'api server'
    >>> role(6, 5, "VLLM::EngineCor", ["VLLM::EngineCore"])
    'VLLM::EngineCore'
    """
    from tandem.client.serve.stubs import Stub
    stub = Stub.from_argv(pid, argv) if argv else None
    if stub is not None:
        return f"stub:{stub.model}"
    if pid == root:
        return "tandem serve (frontend)" if any("tandem" in a for a in argv[:4]) else "api server"
    if comm == "tritonserver" or (argv and argv[0].endswith("tritonserver")):
        return "tritonserver"
    return argv[0].rsplit("/", 1)[-1] if argv and argv[0].startswith("VLLM") else comm


def cpu_by_role(root: int) -> dict[str, float]:
    """CPU seconds (user + system) each role (:func:`role`) of the live process tree under
    ``root`` has used."""
    ticks = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    info: dict[int, tuple[float, Path]] = {}
    for pid, fields, entry in live_processes():
        children.setdefault(int(fields[1]), []).append(pid)
        info[pid] = ((int(fields[11]) + int(fields[12])) / ticks, entry)
    out: dict[str, float] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        if pid not in info:
            continue
        seconds, entry = info[pid]
        try:
            comm = (entry / "comm").read_text().strip()
            argv = [a.decode(errors="replace") for a in (entry / "cmdline").read_bytes().split(b"\0") if a]
        except OSError:
            continue
        name = role(pid, root, comm, argv)
        out[name] = out.get(name, 0.0) + seconds
    return out


def tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system) the live processes under ``root`` (it included) have
    used: an idle server must stay near zero while another one is measured."""
    ticks = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    times: dict[int, float] = {}
    for pid, fields, _ in live_processes():
        children.setdefault(int(fields[1]), []).append(pid)
        times[pid] = (int(fields[11]) + int(fields[12])) / ticks   # utime, stime
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += times.get(pid, 0.0)
        todo += children.get(pid, [])
    return total
