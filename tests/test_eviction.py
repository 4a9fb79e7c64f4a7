"""Token eviction's interface: every scorer through one shared list of checks, and a new
scorer written in this file alone running verify, bench and memory by registration."""

from dataclasses import replace

import pandas as pd
import pytest
from typer.testing import CliRunner

from kvbench.caches import IMPLEMENTATIONS, register
from kvbench.caches.eviction import EvictionCache, scorer_modules
from kvbench.cli import app
from kvbench.experiments.verify import verify
from kvbench.sizing.config import LayerShape, RunConfig

runner = CliRunner()
SCORERS = sorted(n for n, c in IMPLEMENTATIONS.items() if issubclass(c, EvictionCache))
# 40 prompt positions kept to 12 per KV head, then 8 steps: the prompt compressed, and at
# --kv-compress decode an eviction every step
SHAPE = LayerShape(batch=2, prompt_len=40, decode_len=8, hidden=64, q_heads=4, kv_heads=2,
                   head_dim=16, kv_budget=12)


def test_every_scorer_file_registers_one_implementation():
    assert SCORERS == sorted(scorer_modules()) == ["expected", "h2o", "knorm", "snapkv", "tova"]


@pytest.mark.parametrize("compress", ["decode", "prefill"])
@pytest.mark.parametrize("name", SCORERS)
def test_every_scorer_passes_its_gate_and_its_replay(name, compress):
    config = RunConfig(replace(SHAPE, kv_compress=compress), rope=True)
    (check,) = verify(config, {name: IMPLEMENTATIONS[name]}).checks
    assert check.passed, check.message
    assert check.cache_shape == (2, 2, 12 if compress == "decode" else 12 + 8, 16)


def reversed_scorer(cls):
    """The scorer's choice turned upside down: the prompt keeps its lowest scores, a full
    cache evicts its highest. Exact over what it kept, so only the replay can tell."""
    class Reversed(cls):
        def prompt_scores(self, q, k, v):
            return -super().prompt_scores(q, k, v)

        def slot_scores(self):
            return -super().slot_scores()

    Reversed.name = cls.name
    return Reversed


@pytest.mark.parametrize("compress", ["decode", "prefill"])
@pytest.mark.parametrize("name", SCORERS)
def test_every_scorer_reversed_fails_its_replay(name, compress):
    config = RunConfig(replace(SHAPE, kv_compress=compress), rope=True)
    (check,) = verify(config, {name: reversed_scorer(IMPLEMENTATIONS[name])}).checks
    assert not check.passed and "policy" in check.message, check.message


# --- a scorer written here alone ------------------------------------------------------------

class ValueNormCache(EvictionCache):
    """Keeps the positions whose values have the largest norm (a toy)."""

    name = "vnorm"
    description = "token eviction by value norm (a test's toy); lossy"
    newest_only = True

    @classmethod
    def prompt_scoring(cls, s) -> int:
        return s.batch * s.kv_heads * s.prompt_len * s.head_dim * 4

    def prompt_scores(self, q, k, v):
        return v.float().norm(dim=-1)

    def written_score(self, k, v):
        return v.float().norm(dim=-1)

    @classmethod
    def replay_prompt(cls, head):
        return {p: float(head.v[p].norm()) for p in range(head.P)}

    @classmethod
    def replay_written(cls, head, t):
        return float(head.v[t].norm())


class ValueNormKeepsTheSmallest(ValueNormCache):
    def prompt_scores(self, q, k, v):
        return -super().prompt_scores(q, k, v)

    def written_score(self, k, v):
        return -super().written_score(k, v)


@pytest.fixture
def vnorm():
    register(ValueNormCache)
    yield ValueNormCache
    del IMPLEMENTATIONS["vnorm"]


@pytest.mark.parametrize("compress", ["decode", "prefill"])
def test_a_new_scorer_is_verified_by_registration_alone(vnorm, compress):
    config = RunConfig(replace(SHAPE, kv_compress=compress), rope=True)
    (check,) = verify(config, {"vnorm": vnorm}).checks
    assert check.passed and check.lossy, check.message
    (bad,) = verify(config, {"vnorm": ValueNormKeepsTheSmallest}).checks
    assert not bad.passed and "vnorm policy" in bad.message


def test_a_new_scorer_runs_the_commands(vnorm, tmp_path):
    shape = ["--batch", "2", "--prompt-len", "40", "--decode-len", "8", "--hidden", "64",
             "--q-heads", "4", "--kv-heads", "2", "--head-dim", "16", "--device", "cpu",
             "--impl", "vnorm", "--kv-budget", "12"]
    for command in ("verify", "bench", "memory"):
        out = tmp_path / f"{command}.csv"
        extra = ["--rounds", "2", "--warmup", "1"] if command == "bench" else []
        result = runner.invoke(app, [command, *shape, *extra, "--csv", str(out)])
        assert result.exit_code == 0, result.output
        rows = pd.read_csv(out)
        assert "vnorm" in set(rows["impl"]) and (rows["kv_budget"] == 12).all()
    memory = pd.read_csv(tmp_path / "memory.csv").set_index("impl").loc["vnorm"]
    # K and V of 12 slots of 2 heads × 16 dims, float32, for 2 sequences
    assert memory["kv_cache_bytes"] == 2 * 2 * 2 * 12 * 16 * 4


def test_the_help_names_every_scorer_and_what_it_scores_by():
    import importlib

    from kvbench.options import IMPL_HELP

    assert "expected, h2o, knorm, snapkv and tova (token eviction under --kv-budget by" in IMPL_HELP
    for name in SCORERS:
        assert importlib.import_module(f"kvbench.caches.eviction.{name}").SUMMARY in IMPL_HELP
