"""Docstrings and comments say what and why; measurements live in docs/benchmarks.md.

A number measured on one machine rots in a docstring: the code changes, the machine changes, and
nothing reruns it. docs/benchmarks.md keeps each with its date and machine, and the docstrings link to
it. These tests scan every docstring and comment of the package and every comment under native/.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# What a measurement looks like in prose (case-insensitive). Each pattern is checked below against the
# text it was written for, quoted from the docstrings these tests replaced, and against design facts it
# must leave alone.
MEASUREMENT_PATTERNS = {
    "speed ratio": r"\b\d+(\.\d+)?x (faster|slower|plain|fp32|torch|the)\b",
    "decimal ratio": r"\b\d+\.\d+x\b",
    "percent faster or slower": r"\b\d+(\.\d+)?% (faster|slower)\b",
    "percent gained": r"\b(removed|removes|saved|saves|cut|cuts|reduced|reduces|gained) (about |~)?[\d.]+(-[\d.]+)?%",
    "approximate percent": r"~\d+(\.\d+)?%",
    "measured result": r"\(measured\b|\bmeasured:|\bmeasured (on|with) (a|an|one|two|three|four|\d)\b"
    r"|\bmeasured (only |about |at )?[+~-]?\d",
    "one machine": r"\bon (a|an|the|this) (\d+-(core|vcpu)|avx2|avx-512)( \w+)? (machine|server|box|guest)\b",
    "time taken": r"\b(about|some|~) ?(a|one|\d+(\.\d+)?) (tenth of a )?(second|seconds|minute|minutes)\b",
    "cost in steps": r"\b(about|~) ?\d+\.\d+ (adam |optimizer )?steps\b",
}
MEASUREMENT = re.compile("|".join(f"(?:{p})" for p in MEASUREMENT_PATTERNS.values()), re.IGNORECASE)

CAUGHT = {  # pattern -> text it must find (what the package said before these tests)
    "speed ratio": "CPUs without AVX-512 BF16 or AMX run bf16 matmuls some 30x slower than fp32",
    "decimal ratio": "Llama 1.33x slower than plain Lightning",
    "percent faster or slower": "the offload path was 18% slower",
    "percent gained": "removed 37-63% of DPU's convergence loss on the demo",
    "approximate percent": "(measured: ~92% -> ~99% of the probe)",
    "measured result": "aborts the process in about one exit of four (measured with two ranks)",
    "one machine": "the native one is one vectorised pass over memory (about 1.2 Adam steps on an AVX2 machine)",
    "time taken": "The whole set takes about a second on a 2-core machine.",
    "cost in steps": "one pass costing about 1.2 Adam steps, equal to sync within fp32 rounding",
}
LEFT_ALONE = [  # design facts and derivations, not measurements
    "read p, g, m, v and write p, m, v (28 B/element)",
    "a 1.1 GB buffer would pin 2 GB",
    "buckets: the smallest size within 1% of the fastest",
    "about 65-75% of the DRAM peak",
    "forward+backward FLOP/s (about 6 x params x tokens)",
    "NaN is stored as the quiet NaN ``0x7fc0``",
    "Rates not given are measured on this machine by short probes",
    "``threads``: the thread count the node bandwidth is measured with (default: all cores)",
    "a square bf16 matmul timed too close to the threshold to be stable on an AVX2 CPU",
    "About 31 years. timedelta itself ends near 8.6e13 s",
]


def _doc_strings(tree: ast.Module) -> list[tuple[int, str]]:
    """Docstrings anywhere, ``__doc__ = ...`` and ``*_DOC = ...`` texts (an f-string's literal parts)."""
    found = []
    for node in ast.walk(tree):
        doc_assignment = isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and (t.id == "__doc__" or t.id.endswith("_DOC")) for t in node.targets
        )
        value = node.value if isinstance(node, ast.Expr) or doc_assignment else None
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            found.append((value.lineno, value.value))
        elif isinstance(value, ast.JoinedStr):
            parts = [v.value for v in value.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
            found.append((value.lineno, " ".join(parts)))
    return found


def _python_comments(source: str) -> list[tuple[int, str]]:
    """Comments, consecutive lines joined into one block (a sentence may wrap)."""
    blocks: list[tuple[int, str]] = []
    last = -2
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        text = tok.string.lstrip("#").strip()
        if tok.start[0] == last + 1 and blocks:
            blocks[-1] = (blocks[-1][0], blocks[-1][1] + " " + text)
        else:
            blocks.append((tok.start[0], text))
        last = tok.start[0]
    return blocks


def _c_comments(source: str) -> list[tuple[int, str]]:
    found = []
    for match in re.finditer(r"/\*.*?\*/|//[^\n]*", source, re.DOTALL):
        text = re.sub(r"^\s*\*", " ", match.group()[2:].removesuffix("*/"), flags=re.MULTILINE)
        found.append((source.count("\n", 0, match.start()) + 1, text))
    return found


@functools.cache
def prose() -> list[tuple[str, int, str]]:
    """(file, line, text) of every docstring and comment of the package and native/, whitespace collapsed."""
    texts = []
    for path in sorted((ROOT / "lightning_zero_offload").rglob("*.py")):
        source = path.read_text()
        for line, text in _doc_strings(ast.parse(source)) + _python_comments(source):
            texts.append((str(path.relative_to(ROOT)), line, " ".join(text.split())))
    for path in sorted(p for p in (ROOT / "native").iterdir() if p.suffix in (".c", ".h")):
        for line, text in _c_comments(path.read_text()):
            texts.append((str(path.relative_to(ROOT)), line, " ".join(text.split())))
    return texts


@pytest.mark.parametrize("name", sorted(MEASUREMENT_PATTERNS))
def test_each_pattern_catches_what_it_was_written_for(name):
    assert re.search(MEASUREMENT_PATTERNS[name], CAUGHT[name], re.IGNORECASE), (name, CAUGHT[name])


@pytest.mark.parametrize("text", LEFT_ALONE)
def test_design_facts_are_not_taken_for_measurements(text):
    assert not MEASUREMENT.search(text), MEASUREMENT.search(text)


def test_the_scan_sees_docstrings_comments_and_native_comments():
    files = {file for file, _, _ in prose()}
    assert "lightning_zero_offload/core/options.py" in files  # OPTIONS_DOC, the strategies' option list
    assert "native/kernels_simd.h" in files
    assert any(file == "lightning_zero_offload/trainer/strategy.py" and "Trainer" in text for file, _, text in prose())


def test_no_measurements_in_docstrings_or_comments():
    found = [f"{file}:{line}: ...{m.group()}..." for file, line, text in prose() if (m := MEASUREMENT.search(text))]
    assert not found, (
        "measurements in docstrings/comments: put them in docs/benchmarks.md with their date and machine, "
        'keep the reason here and link the section (docs/benchmarks.md, "<section>"):\n' + "\n".join(found)
    )


def test_linked_docs_and_sections_exist():
    """``docs/<name>.md`` and ``docs/<name>.md, "<section>"`` in prose name a file and a heading that exist."""
    missing = []
    for file, line, text in prose():
        for match in re.finditer(r"docs/([\w-]+\.md)(?:, \"([^\"]+)\")?", text):
            doc = ROOT / "docs" / match.group(1)
            if not doc.is_file():
                missing.append(f"{file}:{line}: {match.group()} (no such file)")
            elif match.group(2):
                headings = [h.lstrip("#").strip() for h in doc.read_text().splitlines() if h.startswith("#")]
                if not any(h.startswith(match.group(2)) for h in headings):
                    missing.append(f"{file}:{line}: {match.group()} (no heading starts so)")
    assert not missing, "\n".join(missing)
