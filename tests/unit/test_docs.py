"""The user docs and the log cite benchmark records that exist: every record named in README.md,
BENCHMARKS.md, docs/*.md and benchmarks/LOG.md (a reference link, a relative link, or a file
name in backticks) is a file under benchmarks/results/, and every reference link a file uses is
defined in it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "benchmarks" / "LOG.md"]
DOCS += sorted((ROOT / "docs").glob("*.md"))

# a dated record's file name, e.g. layer_fp8_h100_w1_4f6703f_2026-12-06.json
RECORD = r"[A-Za-z0-9_.\-]+_20\d\d-\d\d-\d\d[A-Za-z0-9_.\-]*\.(?:json|log|txt|png)"


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in paths]


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_every_cited_record_exists(doc: Path) -> None:
    text = doc.read_text()
    missing = []
    for target in re.findall(r"^\[`[^`]+`\]: (\S+)", text, re.M):  # reference definitions
        if not ((doc.parent / target).exists() or (ROOT / target).exists()):
            missing.append(target)
    for target in re.findall(r"\]\(((?:\.\./)?(?:benchmarks/)?results/[^)#]+)\)", text):
        if not (doc.parent / target).exists():
            missing.append(target)
    for name in re.findall(rf"`(?:(?:benchmarks/)?results/)?({RECORD})`", text):
        if not (RESULTS / name).exists():
            missing.append(name)
    assert not missing, f"{doc.name} cites records that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_every_reference_link_is_defined(doc: Path) -> None:
    text = doc.read_text()
    defined = set(re.findall(r"^\[(`[^`]+`)\]:", text, re.M))
    used = set(re.findall(r"\[(`[^`\]]+`)\](?![:(\[])", text))
    # only record names: other backticked words in brackets are prose, not links
    used = {u for u in used if re.fullmatch(rf"`{RECORD}`", u)}
    assert not used - defined, f"{doc.name}: reference links without a definition: {used - defined}"
