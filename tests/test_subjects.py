"""The subject interface: which subject takes which options, the kinds of attention layer,
and a new subject running through the commands by registration alone."""

import pytest

from kvbench import subjects
from kvbench.options import RunOptions
from kvbench.sizing.config import GQA, KINDS, LayerShape, MlaDims


def test_the_layer_takes_runs_without_a_model_and_an_mla_presets_one_layer():
    subject, o = subjects.subject_for(RunOptions())
    assert subject.name == "layer" and o == RunOptions()
    subject, o = subjects.subject_for(RunOptions(model="deepseek-v3", layers=1))
    assert subject.name == "layer"
    assert (o.model, o.attention, o.kv_lora_rank) == (None, "mla", 512)


def test_the_model_takes_a_model_kvbench_runs_whole():
    subject, o = subjects.subject_for(RunOptions(model="llama-3-8b"))
    assert subject.name == "model" and o.model == "llama-3-8b"


def test_each_run_gets_a_fresh_subject():
    a, _ = subjects.subject_for(RunOptions(model="llama-3-8b"))
    b, _ = subjects.subject_for(RunOptions(model="llama-3-8b"))
    assert a is not b  # what one run resolves (its model) is not the next run's


def test_a_new_subject_runs_the_commands_by_registration_alone(monkeypatch, tmp_path, capsys):
    # one more kind, registered first: verify runs its points through the same sweep, writes
    # its rows and says its own failure line
    ran, shown = [], []

    class Fake:
        name = "fake"

        def take(self, o):
            return o

        def expand(self, o, command):
            from kvbench.caches import ImplOptions
            from kvbench.sizing.config import RunConfig

            config = RunConfig(LayerShape(batch=1, prompt_len=4, decode_len=2, hidden=16,
                                          q_heads=2, kv_heads=1, head_dim=8))
            return [(config, ("static",))], ImplOptions(), [], None

        def point(self, command, o, impl_options, bench_options):
            def run_point(config, names, env):
                ran.append((command, names))
                check = type("Check", (), {"passed": False, "impl": "static"})()
                return type("Report", (), {"checks": [check], "config": config})(), []
            return run_point

        def plans(self, command, o, impl_options, bench_options):
            return None

        def report(self, command, result):
            from kvbench.report.tables import Report

            shown.append(command)
            return Report()

        def failed(self, report, check):
            return f"{check.impl} failed the fake way"

        def refused(self, report, check):
            return "never"

    real = subjects.subjects
    monkeypatch.setattr(subjects, "subjects", lambda: [Fake, *real()])
    import typer

    with pytest.raises(typer.Exit) as exit_:
        subjects.run(RunOptions(csv=tmp_path / "v.csv", quiet=True, device="cpu"), "verify")
    assert exit_.value.exit_code == 1
    assert ran == [("verify", ("static",))]
    assert "kvbench: verify failed: static failed the fake way" in capsys.readouterr().err


def test_the_kinds_answer_by_hand():
    s = LayerShape(batch=1, prompt_len=4, decode_len=1, hidden=64, q_heads=4, kv_heads=2,
                   head_dim=16)
    assert s.kind is GQA and s.attention == "gqa"
    assert GQA.attended_width(s) == 32  # QK^T and PV: 2 · D
    assert GQA.cached(s) == {"kv_heads": 2, "head_dim": 16}
    assert GQA.cells() == {}
    assert GQA.heads(s) == "H_q=4 H_kv=2 D=16"
    dims = MlaDims(kv_lora_rank=32, qk_rope_dim=8, qk_nope_dim=16, v_head_dim=24)
    m = s.with_mla(dims)
    assert m.kind is dims and m.attention == "mla" and KINDS["mla"] is MlaDims
    assert dims.attended_width(m) == 16 + 8 + 24  # qk + v over decompressed heads
    assert dims.cached(m) == {"mla_latent": 32, "mla_rope": 8}
    assert dims.cells() == {"kv_lora_rank": 32, "qk_rope_dim": 8, "qk_nope_dim": 16,
                            "v_head_dim": 24, "q_lora_rank": 0}
    assert dims.rope_dim(m) == 8 and GQA.rope_dim(s) == 16
    assert dims.rotates_always and not GQA.rotates_always
