"""vLLM's rules and defaults as one table per version (kvbench.sizing.versions): which one a
spec names, and the tables against what each installed release itself says (the peers'
committed readings, results/sample/peer-vllm-defaults-X.csv)."""

import csv
import json
from dataclasses import replace
from pathlib import Path

import pytest

from kvbench.errors import KvbenchError
from kvbench.sizing import versions

SAMPLE = Path(__file__).resolve().parents[1] / "results" / "sample"


def test_a_bare_vllm_is_the_newest_and_a_version_is_named_either_way():
    assert versions.release("vllm").version == "0.34"
    assert versions.release("vllm==0.33").release == "0.33.0"
    assert versions.release("VLLM==0.33.0") == versions.release("vllm==0.33")
    assert versions.release("vllm==0.34")["block_size"] == 64
    assert versions.release("vllm==0.33")["block_size"] == 16
    assert versions.release("vllm==0.33").label == "vLLM 0.33"
    assert versions.choices() == ["vllm", "vllm==0.33", "vllm==0.34"]
    assert versions.having("cache_aware_admission_window") == ["vllm==0.34"]
    for bad in ("vllm==0.32", "vllm==0.34.1", "vllm==banana", "sglang==0.4"):
        with pytest.raises(KvbenchError, match="use one of vllm, vllm==0.33, vllm==0.34"):
            versions.release(bad)


def test_every_value_names_the_file_of_the_engines_source_it_comes_from():
    for rel in versions.releases().values():
        for name, _, source in rel.values:
            file = source.split(":")[0]
            assert file.endswith(".py") or source.startswith("("), (rel.spec, name)


def test_the_serve_tiers_by_gpu_memory():
    rel = versions.release("vllm==0.34")
    gib = 2**30
    assert rel.serve_defaults(69 * gib) == (256, 2048)
    assert rel.serve_defaults(80 * gib) == (1024, 8192)
    assert rel.serve_defaults(80 * gib, a100=True) == (256, 2048)  # PR #17885's exception
    assert rel.serve_defaults(160 * gib) == (1024, 16384)


def _read(version: str) -> dict:
    """What the installed release said of itself (the peer's reading, committed)."""
    with (SAMPLE / f"peer-vllm-defaults-{version}.csv").open(newline="") as f:
        out = {}
        for row in csv.DictReader(f):
            text = row["vllm"]
            try:
                out[row["field"]] = json.loads(text.lower() if text in ("True", "False")
                                               else text)
            except json.JSONDecodeError:
                out[row["field"]] = text
        return out


@pytest.mark.parametrize("version", ["0.33", "0.34"])
def test_each_table_equals_what_its_release_says_and_a_changed_default_is_found(version):
    rel = versions.release(f"vllm=={version}")
    found = _read(version)
    assert len(found) >= 10
    rows = versions.check(rel, found)
    assert all(r["equal"] for r in rows), [r for r in rows if not r["equal"]]
    # one default changed in kvbench's table: the comparison names it
    wrong = replace(rel, values=tuple((k, 32 if k == "block_size" else v, s)
                                      for k, v, s in rel.values))
    bad = [r["field"] for r in versions.check(wrong, found) if not r["equal"]]
    assert bad == ["block_size"]
