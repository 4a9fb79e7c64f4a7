"""The ways kvbench grows, each walked once from a test file alone: a cache implementation
registered here runs verify, bench and memory (and a broken one fails verify); a command
declared here as a dataclass of flag() fields gets its options, --help and one-line refusals.
(A scorer: tests/test_eviction.py; a technique option: tests/test_sweep.py.)"""

from dataclasses import dataclass

import pandas as pd
import pytest
import torch
import typer
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
    if o.times < 1:
        raise KvbenchError(f"--times must be a positive integer, got {o.times}")
    text = " ".join([o.word] * o.times)
    typer.echo(text.upper() if o.loud else text)


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
