"""The ways kvbench grows, each walked once from a test file alone: a cache implementation
registered here runs verify, bench and memory (and a broken one fails verify); a command
declared here as a dataclass of flag() fields gets its options, --help and one-line refusals;
a technique option added to a copy of the package as one declaration, with a toy cache that
reads it, runs every command. (A scorer: tests/test_eviction.py.)"""

from dataclasses import dataclass

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from kvbench.caches import IMPLEMENTATIONS, CachedAttention, register
from kvbench.cli import app
from kvbench.errors import KvbenchError
from kvbench.measure import footprint as fp
from kvbench.sizing.config import flag

runner = CliRunner()
SHAPE = ["--batch", "2", "--prompt-len", "12", "--decode-len", "3", "--hidden", "32",
         "--q-heads", "4", "--kv-heads", "2", "--head-dim", "8", "--device", "cpu"]


class ListCache(CachedAttention):
    """K and V kept as a list of positions, stacked to attend (a toy)."""

    name = "list"
    description = "K/V as a Python list of positions (a test's toy)"
    reserves = "padded"

    @classmethod
    def footprint(cls, config, options):
        return fp.concat(config.shape, config.rope, config.dtype_bytes)

    def __init__(self, layer, batch, max_len, options=None, lens=None):
        super().__init__(layer, batch, max_len, options, lens)
        self.ks, self.vs = [], []

    def write(self, k, v):
        self.ks += list(k.unbind(2))
        self.vs += list(v.unbind(2))
        self._advance(k.shape[2])

    def kv(self):
        return torch.stack(self.ks, 2), torch.stack(self.vs, 2)

    def cache_tensors(self):
        return list(self.kv())

    def rewind(self, length):
        del self.ks[length:], self.vs[length:]
        self._rewound(length)


class ListForgetsTheFirst(ListCache):
    def kv(self):
        k, v = super().kv()
        return k[:, :, 1:], v[:, :, 1:]


@pytest.fixture
def listed():
    register(ListCache)
    yield ListCache
    del IMPLEMENTATIONS["list"]


def test_a_cache_registered_in_a_test_runs_every_command(listed, tmp_path):
    from kvbench.experiments.verify import verify
    from kvbench.sizing.config import LayerShape, RunConfig

    shape = LayerShape(batch=2, prompt_len=12, decode_len=3, hidden=32, q_heads=4, kv_heads=2,
                       head_dim=8)
    (check,) = verify(RunConfig(shape, rope=True), {"list": listed}).checks
    assert check.passed and check.cache_shape == (2, 2, 15, 8)
    (bad,) = verify(RunConfig(shape, rope=True), {"list": ListForgetsTheFirst}).checks
    assert not bad.passed
    for command in ("verify", "bench", "memory"):
        out = tmp_path / f"{command}.csv"
        extra = ["--rounds", "2", "--warmup", "1"] if command == "bench" else []
        result = runner.invoke(app, [command, *SHAPE, *extra, "--impl", "list", "--csv",
                                     str(out)])
        assert result.exit_code == 0, result.output
        assert list(pd.read_csv(out)["impl"].unique()) == ["list"]
    memory = pd.read_csv(tmp_path / "memory.csv").iloc[0]
    # K and V of 2 sequences x 2 heads x 15 positions x 8, float32
    assert memory["kv_cache_bytes"] == 2 * 2 * 2 * 15 * 8 * 4


@dataclass(frozen=True)
class EchoOptions:
    """A toy command's options, declared once."""

    times: int = flag(1, "How many times to say it.")
    word: str = flag("kv", "What to say.", "--word", "-w")
    loud: bool = flag(False, "In capitals.", "--loud")


def echo(o: EchoOptions) -> None:
    from kvbench.report import render
    from kvbench.report.tables import Report

    if o.times < 1:
        raise KvbenchError(f"--times must be a positive integer, got {o.times}")
    text = " ".join([o.word] * o.times)
    render.show(Report([text.upper() if o.loud else text]))  # what it shows, as data


@pytest.fixture
def toy_command():
    from kvbench.options import declared_signature

    def command(**values):
        echo(EchoOptions(**values))

    command.__signature__ = declared_signature(EchoOptions)
    app.command("echo", help="Say a word (a test's toy).")(command)
    yield
    app.registered_commands.pop()


def test_a_command_declared_in_a_test_gets_its_options_help_and_refusals(toy_command):
    assert runner.invoke(app, ["echo", "-w", "cache", "--times", "2"]).stdout == "cache cache\n"
    assert runner.invoke(app, ["echo", "--loud"]).stdout == "KV\n"
    helped = runner.invoke(app, ["echo", "--help"])
    assert "How many times to say it." in helped.stdout and "--loud" in helped.stdout
    bad = runner.invoke(app, ["echo", "--times", "0"])
    assert bad.exit_code == 2
    assert bad.stderr.strip() == "kvbench: error: --times must be a positive integer, got 0"


# --- a technique option: one declaration, and the cache that reads it ----------------------
# The walk on a copy of the package: the one declaration added to LayerShape, the cache that
# reads it in a plugin file beside the copy, every command then run on the copy.

SPARE_OPTION = '''    kv_spare: int | None = technique(
        None, "spare: reserve N positions beyond the longest (a test's toy option).",
        option=str | None, points=True, show_default=False, read=True)
'''

SPARE_CACHE = '''
import json
import sys

import torch
from typer.testing import CliRunner

from kvbench.caches import CachedAttention, register
from kvbench.cli import app
from kvbench.measure import footprint as fp


@register
class SpareCache(CachedAttention):
    name = "spare"
    description = "preallocated with --kv-spare positions to spare (a test's toy)"
    reads = frozenset({"kv_spare"})

    @classmethod
    def footprint(cls, config, options):
        return fp.concat(config.shape, config.rope, config.dtype_bytes)

    def __init__(self, layer, batch, max_len, options=None, lens=None):
        super().__init__(layer, batch, max_len, options, lens)
        s = layer.shape
        size = (batch, s.kv_heads, max_len + (s.kv_spare or 0), s.head_dim)
        self.k = torch.zeros(size, dtype=layer.dtype, device=layer.device)
        self.v = torch.zeros_like(self.k)

    def write(self, k, v):
        n = k.shape[2]
        self.k[:, :, self.length:self.length + n] = k
        self.v[:, :, self.length:self.length + n] = v
        self._advance(n)

    def kv(self):
        return self.k[:, :, :self.length], self.v[:, :, :self.length]

    def cache_tensors(self):
        return [self.k, self.v]

    def rewind(self, length):
        self._rewound(length)


said = []
for args in json.loads(sys.argv[1]):
    r = CliRunner().invoke(app, args)
    said.append({"code": r.exit_code, "out": r.stdout, "err": r.stderr})
print(json.dumps(said))
'''


@pytest.mark.slow
def test_a_technique_option_is_one_declaration_and_the_cache_that_reads_it(tmp_path):
    import json
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    source = Path(__file__).resolve().parent.parent / "kvbench"
    copy = tmp_path / "kvbench"
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("__pycache__"))
    config = copy / "sizing" / "config.py"
    anchor = "    # --kv-reference kvpress"
    assert config.read_text().count(anchor) == 1
    config.write_text(config.read_text().replace(anchor, SPARE_OPTION + anchor))
    (tmp_path / "spare.py").write_text(SPARE_CACHE)
    changed = [p.relative_to(copy) for p in sorted(copy.rglob("*.py"))
               if p.read_text() != (source / p.relative_to(copy)).read_text()]
    assert changed == [Path("sizing/config.py")]  # the one production file: one declaration

    memory, verify = tmp_path / "memory.csv", tmp_path / "verify.csv"
    sweep = tmp_path / "s.toml"
    sweep.write_text('impl = "spare"\nkv_spare = [2, 6]\n')
    calls = [["verify", "--help"],
             ["memory", *SHAPE, "--impl", "static,spare", "--kv-spare", "4", "--csv",
              str(memory)],
             ["verify", *SHAPE, "--impl", "spare", "--kv-spare", "4,8", "--csv", str(verify)],
             ["verify", *SHAPE, "--config", str(sweep), "--csv", str(verify)],
             ["memory", *SHAPE, "--impl", "static", "--kv-spare", "4", "--no-csv"],
             ["needle", "--help"]]
    done = subprocess.run([sys.executable, str(tmp_path / "spare.py"), json.dumps(calls)],
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    helped, measured, verified, swept, refused, needle = json.loads(done.stdout)
    assert "--kv-spare" in helped["out"] and "a test's toy option" in helped["out"]
    assert "--kv-spare" in needle["out"]  # every command that takes techniques
    assert measured["code"] == 0, measured
    rows = pd.read_csv(memory).set_index("impl")
    # the results column: the spare cache's value; static does not read it, its cell empty
    assert rows.loc["spare", "kv_spare"] == 4 and pd.isna(rows.loc["static", "kv_spare"])
    # K and V of 2 sequences x 2 heads x (15 + 4) positions x 8, float32
    assert rows.loc["spare", "kv_cache_bytes"] == 2 * 2 * 2 * (15 + 4) * 8 * 4
    assert rows.loc["static", "kv_cache_bytes"] == 2 * 2 * 2 * 15 * 8 * 4
    # a comma list runs one point per value; the sweep file's key is the field's name
    assert verified["code"] == 0 and swept["code"] == 0, (verified, swept)
    checked = pd.read_csv(verify)
    assert checked["kv_spare"].tolist() == [4, 8, 2, 6] and checked["passed"].all()
    # a run none of whose caches reads it: one line, exit 2
    assert refused["code"] == 2
    assert refused["err"].strip().splitlines() == [
        "kvbench: error: --kv-spare is read by none of static (it runs on spare); drop it or "
        "add one of those to --impl"]
