"""The public GPU corpus (planner/public_gpu/records.jsonl, issue 25) is data a test set can stand on: every record
names its source and quotes it, and every number it says was measured is in its quote, as written there. Records of
kind "own_measurement" are this project's own runs: their source is a result file in this repository, and their quote
is lines of it, verbatim."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RECORDS = Path(__file__).resolve().parents[1] / "planner" / "public_gpu" / "records.jsonl"
ROOT = Path(__file__).resolve().parents[1]
PUBLIC_KINDS = {"llamacpp_buffers", "llamabench", "hf_transformers", "vllm_startup"}
OWN = "own_measurement"
KINDS = PUBLIC_KINDS | {OWN}
REQUIRED = {"id", "kind", "source", "quote", "gpu", "engine", "model", "measured", "complete"}


def _records() -> list[dict]:
    return [json.loads(line) for line in RECORDS.read_text(encoding="utf-8").splitlines() if line.strip()]


def _as_written(value: float) -> set[str]:
    """How a source may write `value`: as is, without trailing zeros, with thousands separators."""
    forms = {f"{value}", f"{value}".rstrip("0").rstrip(".") if "." in f"{value}" else f"{value}"}
    if float(value).is_integer():
        forms.add(f"{int(value):,}")
    return forms


def test_records_are_unique_and_cover_the_four_kinds():
    records = _records()
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids))
    assert {r["kind"] for r in records} == KINDS
    assert len({r["gpu"] for r in records if r["kind"] in PUBLIC_KINDS}) >= 10


@pytest.mark.parametrize("record", [r for r in _records() if r["kind"] == OWN], ids=lambda r: r["id"])
def test_an_own_measurement_quotes_a_result_file_of_this_repository(record):
    source = record["source"]
    path = ROOT / source["path"]
    assert path.is_file() and not Path(source["path"]).is_absolute(), source
    assert source["row"] and len(source["commit"]) == 40, source
    text = path.read_text(encoding="utf-8").splitlines()
    lines = [ln for ln in record["quote"].splitlines() if ln != "[...]"]
    assert all(any(t.strip() == ln for t in text) for ln in lines), [ln for ln in lines
                                                                     if not any(t.strip() == ln for t in text)]


@pytest.mark.parametrize("record", _records(), ids=lambda r: r["id"])
def test_a_record_names_its_source_and_its_numbers_are_quoted(record):
    assert REQUIRED <= set(record), REQUIRED - set(record)
    assert record["kind"] in KINDS
    source = record["source"]
    assert source.get("repo") or source.get("url") or source.get("path"), source
    assert record["quote"].strip()
    numbers = {k: v for k, v in record["measured"].items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if not numbers:  # an out-of-memory outcome is a measurement too
        assert record["measured"].get("oom") is True and "OOM" in record["quote"], record["measured"]
    missing = {k: v for k, v in numbers.items() if not any(f in record["quote"] for f in _as_written(v))}
    assert not missing, f"not in the quote: {missing}"
