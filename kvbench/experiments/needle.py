"""`kvbench needle`: retrieval through every cache on a trained model, the failure perplexity
hides: has the cache kept the one fact the answer needs?

A prompt of exactly --context tokens is built from a haystack (RULER's and LongLoRA's filler
sentences, or --haystack FILE) with a needle at each --depth (0: right after the instruction,
1: just before the question) and the question last:

- passkey: " The pass key is 71432. Remember it." and "What is the pass key? The pass key
  is"; the answer is right when its first number is the key.
- multikey: --keys needles " The pass key for NAME is N.", the asked one at the depth, the
  others at seeded places; one asked.
- copy: a seeded random token sequence shown twice; the second copy is fed teacher-forced
  and the figure is the share of its tokens the model predicts (no question).

Each prompt runs through path A (transformers' greedy generate, no kvbench code) and then
through each implementation (kvbench's caches inside the model, greedy too). Query-aware
(the default, as kvpress evaluates): the whole prompt is prefilled, question included, so a
compression's observation window sees the question. --question-after-compression
(query-agnostic, a cache compressed once and reused for any question): the haystack and
needle are prefilled, the cache compresses, then the question is fed token by token.

A lossy cache that records what it kept is gated as verify gates it: every layer's attention
at every step against float64 attention over the positions it kept, so a wrong answer is the
method's, not a bug (a cell's first prompt; the replay of the policy's choice, pure Python
and minutes at these lengths, is verify's). An exact cache must give path A's answer token
for token.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvbench.errors import KvbenchError
from kvbench.report.tables import Report
from kvbench.sizing.config import flag

TASKS = ("passkey", "multikey", "copy")
# RULER's and LongLoRA's pass-key filler (the sentences, not a text anyone owns)
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
          "again. ")
INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about it.\n")
NAMES = ("red", "blue", "green", "gold", "silver", "black", "white", "orange", "purple",
         "brown", "pink", "grey")
ANSWER_TOKENS = 8  # greedy tokens generated for an answer (a 5-digit key and a margin)
DEFAULT_CONTEXTS = (512, 1024)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass(frozen=True)
class Prompt:
    """One prompt: its token ids, where the needle's key sits (positions whose every token an
    answer needs), where the question starts, and the expected answer."""

    ids: list[int]
    key: str  # the answer (passkey, multikey); "" for copy
    needle: list[int]  # positions of the asked key's tokens (copy: the first copy)
    question: int  # the index of the question's first token (copy: the second copy's)
    depth: float


class Tokens:
    """The tokenizer's two calls the prompts need (ids of a text, text of ids)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def haystack_ids(tok: Tokens, path: Path | None, need: int) -> list[int]:
    """At least `need` filler tokens: the filler sentences repeated, or the file's text (one
    line when it is empty, binary or too short)."""
    if path is None:
        one = tok.encode(FILLER)
        return one * (need // max(len(one), 1) + 1)
    try:
        text = Path(path).read_text()
    except IsADirectoryError:
        raise KvbenchError(f"--haystack {path} is a folder; give a plain-text file") from None
    except FileNotFoundError:
        raise KvbenchError(f"--haystack {path}: no such file") from None
    except (OSError, UnicodeDecodeError):
        raise KvbenchError(f"--haystack {path} is not UTF-8 text; give a plain-text "
                           "file") from None
    if "\x00" in text or not text.strip():
        raise KvbenchError(f"--haystack {path} is {'binary' if text.strip() else 'empty'}; "
                           "give a plain-text file")
    ids = tok.encode(text)
    if len(ids) < need:
        raise KvbenchError(f"--haystack {path} has {len(ids):,} tokens; the longest context "
                           f"needs {need:,} of filler: give a longer text or a shorter "
                           "--context")
    return ids


def _needle(tok: Tokens, name: str | None, key: str) -> tuple[list[int], list[int]]:
    """A needle's ids and the offsets of its key's tokens within them."""
    head = tok.encode(" The pass key is" if name is None else f" The pass key for {name} is")
    value = tok.encode(f" {key}")
    return head + value + tok.encode(". Remember it."), list(range(len(head),
                                                                 len(head) + len(value)))


def _question(tok: Tokens, name: str | None) -> list[int]:
    return tok.encode("\nWhat is the pass key? The pass key is" if name is None else
                      f"\nWhat is the pass key for {name}? The pass key for {name} is")


def build(task: str, tok: Tokens, context: int, depth: float, rng: random.Random,
          filler: list[int], needle: str | None = None, keys: int = 4,
          vocab: int = 0) -> Prompt:
    """The prompt of exactly `context` tokens with the needle at `depth` of the filler."""
    if task == "copy":
        half = context // 2
        seq = [rng.randrange(vocab // 8, vocab - vocab // 8) for _ in range(half)]
        return Prompt(seq + seq, "", list(range(half)), half, depth)
    names = [None] if task == "passkey" else rng.sample(NAMES, keys)
    values = [needle or str(rng.randrange(10_000, 100_000)) for _ in names]
    needles = [_needle(tok, n, v) for n, v in zip(names, values)]
    question = _question(tok, names[0])
    intro = tok.encode(INTRO)
    room = context - len(intro) - sum(len(ids) for ids, _ in needles) - len(question)
    if room < 0:
        raise KvbenchError(f"--context {context} is shorter than the instruction, needle and "
                           f"question ({context - room} tokens); give a longer --context")
    at = [round(depth * room)] + sorted(rng.randrange(room + 1) for _ in needles[1:])
    order = sorted(range(len(needles)), key=lambda i: (at[i], i))
    ids, done, asked = list(intro), 0, []
    for i in order:
        ids += filler[done:at[i]]
        done = at[i]
        if i == 0:
            asked = [len(ids) + k for k in needles[i][1]]
        ids += needles[i][0]
    ids += filler[done:room]
    start = len(ids)
    ids += question
    return Prompt(ids, values[0], asked, start, depth)


def score(task: str, prompt: Prompt, answer: str) -> float:
    """passkey, multikey: 1 when the answer's first number is the key, else 0."""
    found = re.search(r"\d+", answer)
    return float(found is not None and found.group() == prompt.key)


def kept_share(kept, needle: list[int]) -> float:
    """kept [H_kv, n] positions a layer's KV heads hold (-1: none): the share of heads that
    hold every needle position."""
    import torch

    want = torch.tensor(needle, device=kept.device)
    return (kept[..., None] == want).any(-2).all(-1).float().mean().item()


def window_share(window: int, sinks: int, length: int, needle: list[int]) -> float:
    """A sliding window at a cache of `length` positions: every head holds the sinks and the
    last `window`, so all heads or none hold the needle."""
    return float(all(p < sinks or p >= length - window for p in needle))


# ------------------------------------------------------------------------------ options


TASK, RUN = "Task", "Run and output"  # --help's panels (the caches': kvbench.options)


@dataclass(frozen=True)
class NeedleOptions:
    """kvbench needle's options, declared once (`flag`); the technique options are verify's
    (kvbench.options.needle_signature adds them, and they arrive in `techniques`)."""

    model: str = flag("smollm2-135m", "A trained model: smollm2-135m, or a checkpoint folder "
                      "or .gguf with its tokenizer.", panel=TASK)
    task: str = flag("passkey", "passkey (one key in the haystack, asked at the end), "
                     "multikey (--keys keys, one asked) or copy (a random token sequence "
                     "shown twice: the second copy predicted).", panel=TASK)
    context: str = flag(",".join(map(str, DEFAULT_CONTEXTS)), "Prompt lengths in tokens, a "
                        "comma list (each a column of the heatmap).", panel=TASK)
    depth: str = flag(",".join(f"{d:g}" for d in DEFAULT_DEPTHS), "Where the needle sits, "
                      "fractions of the filler: 0 right after the instruction, 1 just before "
                      "the question; a comma list.", panel=TASK)
    trials: int = flag(2, "Prompts per cell, each with its own seeded key and filler "
                       "placement.", panel=TASK)
    keys: int = flag(4, "--task multikey: how many keys the haystack holds.", panel=TASK)
    haystack: Path | None = flag(None, "A plain-text file as the filler. \\[default: RULER's "
                                 "pass-key filler sentences]", show_default=False, panel=TASK)
    needle: str | None = flag(None, "The key, digits (default: a seeded 5-digit number per "
                              "trial).", show_default=False, panel=TASK)
    question_after_compression: bool = flag(
        False, "Query-agnostic: prefill the haystack and needle, compress, then feed the "
        "question (a cache reused for any question). Default: query-aware, the question in "
        "the prompt the cache compresses.", "--question-after-compression", panel=TASK)
    impl: str = flag("static", "Cached implementations, a comma list (as verify takes them).",
                     panel="Caches and techniques")
    layers: int | None = flag(None, "Run the model's first N layers.", show_default=False,
                              panel=RUN)
    dtype: str = flag("float32", "float32, float16 or bfloat16.", panel=RUN)
    device: str = flag("auto", "auto, cpu, cuda or cuda:N.", panel=RUN)
    seed: int = flag(0, "Seed of the keys, their places and copy's tokens.", panel=RUN)
    csv: Path | None = flag(None, "Append rows to this CSV. \\[default: results/needle.csv]",
                            show_default=False, panel=RUN)
    no_csv: bool = flag(False, "Write no results file.", "--no-csv", panel=RUN)
    quiet: bool = flag(False, "No table, notes or progress.", "--quiet", "-q", panel=RUN)
    shard: str | None = flag(None, "Run only shard I of N (I/N): the cells whose index is I "
                             "modulo N; kvbench merge joins the CSVs.", show_default=False,
                             panel=RUN)
    ray: str | None = flag(None, "Each context and depth a Ray task, rows written as each "
                           "ends: local starts a cluster here, auto joins this machine's, "
                           "HOST:PORT another (the cluster extra).", show_default=False,
                           panel=RUN)
    retries: int = flag(2, "--ray: times a task whose worker died is run again.", panel=RUN)
    threads: int | None = flag(None, "--ray: CPU threads per task. \\[default: 1]",
                               show_default=False, panel=RUN)
    techniques: dict = field(default_factory=dict)  # kv_budget etc., as the CLI gives them

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise KvbenchError(f"unknown --task {self.task!r}; use {', '.join(TASKS)}")
        for d in self.depths:
            if not 0 <= d <= 1:
                raise KvbenchError(f"--depth {d:g} is outside [0, 1] (0: right after the "
                                   "instruction, 1: just before the question)")
        if self.trials < 1 or self.keys < 2 or self.keys > len(NAMES):
            what = ("--trials must be a positive integer" if self.trials < 1 else
                    f"--keys is 2 to {len(NAMES)} needles")
            raise KvbenchError(f"{what}; got {self.trials if self.trials < 1 else self.keys}")
        if self.needle is not None and not re.fullmatch(r"\d{1,12}", self.needle):
            raise KvbenchError(f"--needle {self.needle!r}: give the key as digits (1 to 12), "
                               "the number the answer must repeat")
        if self.task == "copy" and self.question_after_compression:
            raise KvbenchError("--task copy has no question: its second copy is always fed "
                               "after the first is cached; drop --question-after-compression")
        if self.task == "copy" and self.needle is not None:
            raise KvbenchError("--needle is passkey's and multikey's key; drop it for --task "
                               "copy")
        from kvbench.sizing.config import given_unread

        # what a task does not read, never silently ignored: one key has no count; copy's
        # one sequence has no depth, filler, or key
        unread = {"passkey": {"keys"}, "multikey": set(),
                  "copy": {"keys", "depth", "haystack"}}[self.task]
        if given := given_unread(self, set(self.__dataclass_fields__) - unread):
            why = ("one key in the haystack" if self.task == "passkey" else
                   "a random sequence shown twice, no key, filler or depth")
            raise KvbenchError(f"--task {self.task} reads no {', '.join(given)} ({why}); "
                               f"drop {'it' if len(given) == 1 else 'them'}")
        self.contexts  # noqa: B018 (parsed: refused here, before anything loads)

    @property
    def contexts(self) -> list[int]:
        values = _numbers(self.context, "--context", int, "token counts, e.g. 512,1024")
        if min(values) < 16:
            raise KvbenchError(f"--context {self.context}: each context is 16 tokens or more")
        return values

    @property
    def depths(self) -> list[float]:
        return _numbers(self.depth, "--depth", float, "fractions of the context, e.g. 0,0.5,1")


def _numbers(text: str, flag: str, kind, what: str) -> list:
    """A comma list of numbers, or one line naming the flag and what it takes."""
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(math.isnan(v) for v in values):
        raise KvbenchError(f"{flag} {text!r}: give {what}")
    return values


# ------------------------------------------------------------------------------ the run


@dataclass
class Cell:
    """One implementation at one context and depth: its trials' scores."""

    impl: str
    context: int
    depth: float
    scores: list[float] = field(default_factory=list)
    reference: list[float] = field(default_factory=list)  # path A's on the same prompts
    kept: list[float] = field(default_factory=list)  # needle kept, mean over layers
    kept_min: list[float] = field(default_factory=list)  # the layer that kept it least
    answers: list[str] = field(default_factory=list)
    gate: str = ""  # how the run was checked
    failures: list[str] = field(default_factory=list)
    kv_bytes: int = 0


def split(prompt: Prompt, task: str, agnostic: bool) -> tuple[int, list[int]]:
    """(the tokens prefilled, the tokens fed one by one after them): query-aware prefills
    the whole prompt, question included; query-agnostic prefills up to the question (the
    cache compresses there) and feeds the question after; copy prefills the first copy (its
    second is fed by copy_predictions)."""
    if task == "copy":
        return prompt.question, []
    if agnostic:
        return prompt.question, prompt.ids[prompt.question:]
    return len(prompt.ids), []


def greedy(cm, ids, P: int, feed: list[int], new: int) -> list[int]:
    """Prefill ids[:P], feed `feed` teacher-forced, then `new` greedy tokens."""
    import torch

    logits = cm.prefill(ids[:, :P])[:, -1]
    for t in feed:
        logits = cm.step(torch.tensor([[t]], device=ids.device))[:, -1]
    out = []
    for _ in range(new):
        nxt = int(logits.argmax(-1))
        out.append(nxt)
        if len(out) < new:
            logits = cm.step(torch.tensor([[nxt]], device=ids.device))[:, -1]
    return out


def copy_predictions(cm, ids, half: int) -> list[int]:
    """The first copy prefilled, the second fed teacher-forced: each next-token prediction."""
    logits = cm.prefill(ids[:, :half])[:, -1]
    preds = [int(logits.argmax(-1))]
    for j in range(half, ids.shape[1] - 1):
        preds.append(int(cm.step(ids[:, j:j + 1])[:, -1].argmax(-1)))
    return preds


def run_prompt(m, cls, config, options, prompt: Prompt, task: str, agnostic: bool,
               reference: list[int], gate: bool = True) -> tuple[float, float, float, str, str]:
    """One implementation on one prompt: (score, needle kept (mean over layers), the least
    any layer kept, its answer, what is wrong or ""). gate: a lossy cache's attention checked
    against float64 over what it kept (seconds a prompt: a cell gates its first)."""
    import torch

    from kvbench.experiments.model.run import TOLERANCES, _gate_layers, _record_layers
    from kvbench.layers.model.transformer import CachedModel

    ids = torch.tensor([prompt.ids], device=config.device)
    P, feed = split(prompt, task, agnostic)
    steps = len(feed) + ANSWER_TOKENS if task != "copy" else len(prompt.ids) - P
    shape = replace(config.shape, batch=1, prompt_len=P, decode_len=steps)
    config = replace(config, shape=shape)
    cm = CachedModel(m.model, cls, config, options)
    tapped = _record_layers(cm) if cls.lossy and gate else None
    if cls.lossy and not gate:  # what it kept, for the needle's share, without the gate
        for c in cm.caches:
            c.record = c.records_kept
    if task == "copy":
        got = copy_predictions(cm, ids, P)
        target = prompt.ids[P:]
        value = sum(a == b for a, b in zip(got, target)) / len(target)
        # its answer as passkey's is: the text itself (the first ANSWER_TOKENS predicted
        # tokens of the second copy; the score is the share of the whole copy)
        answer = m.text(got[:ANSWER_TOKENS])
    else:
        got = greedy(cm, ids, P, feed, ANSWER_TOKENS)
        answer = m.text(got)
        value = score(task, prompt, answer)
    wrong = ""
    if tapped is not None:
        rtol, atol = TOLERANCES[config.dtype]
        bad, _ = _gate_layers(cm, tapped, P, rtol, atol, replay_limit=0)  # (verify's)
        wrong = bad or ""
    elif not lossy(cls, config) and got != reference:
        wrong = (f"an exact cache's answer {answer!r} differs from path A's "
                 f"{m.text(reference)!r}")
    shares = []
    length = len(prompt.ids) + (ANSWER_TOKENS - 1 if task != "copy" else 0)
    for cache in cm.caches:
        own = cache.layer.shape  # the layer's: a hybrid model's sliding layer has its window
        if cache.records_kept and cache.kept:
            shares.append(kept_share(cache.kept[-1][0], prompt.needle))
        elif own.window is not None:
            shares.append(window_share(own.window, own.sinks, length, prompt.needle))
        else:
            shares.append(1.0)
    return value, sum(shares) / len(shares), min(shares), answer, wrong


def lossy(cls, config) -> bool:
    from kvbench.experiments.model.run import lossy as model_lossy

    return model_lossy(cls, config)


def path_a(m, prompt: Prompt, task: str) -> list[int]:
    """transformers' greedy answer (passkey, multikey) or its predictions over the second
    copy (copy), no kvbench code."""
    import torch

    from kvbench.experiments.model.run import _generate

    ids = torch.tensor([prompt.ids], device=m.model.device)
    if task == "copy":
        logits = m.hf(ids[:, :-1], use_cache=False).logits[0, prompt.question - 1:]
        return logits.argmax(-1).tolist()
    return _generate(m.hf, ids, ANSWER_TOKENS)[0, len(prompt.ids):].tolist()


def reference_score(m, prompt: Prompt, task: str, got: list[int]) -> float:
    if task == "copy":
        target = prompt.ids[prompt.question:]
        return sum(a == b for a, b in zip(got, target)) / len(target)
    return score(task, prompt, m.text(got))


def shard_of(spec: str | None) -> tuple[int, int]:
    if spec is None:
        return 0, 1
    from kvbench.planning.cluster import parse_shard

    return parse_shard(spec)


def check_output(o: NeedleOptions) -> Path | None:
    """The results file the rows go to, refused in one line if it cannot take them (checked
    before the model loads, and again before the first cell)."""
    from kvbench.report import results

    csv = None if o.no_csv else (o.csv or results.default_csv("needle"))
    if csv is not None:
        results.check_csv(csv, results.NEEDLE_COLUMNS, results.NEEDLE_FIRST)
    return csv


def run(o: NeedleOptions, planned) -> list[Cell]:
    """Every cell (implementation, context, depth) of the grid, each one's row written as it
    finishes; exit 1 if a cache fails its check. Ctrl-C keeps the finished rows. planned:
    (the model, its points at each context, the implementation options, notes), as
    kvbench.cli plans them (through kvbench.subjects.model). --ray: each (context, depth)
    a Ray task, rows written as tasks end."""
    from kvbench.measure.env import environment
    from kvbench.planning.lifecycle import Lifecycle, Output
    from kvbench.report import render, results

    index, count = shard_of(o.shard)
    ref, found, options, notes = planned
    csv = check_output(o)
    longest = max(c.shape.prompt_len for c, _ in found)
    limit = ref.arch.config.get("max_position_embeddings")
    if limit and longest + ANSWER_TOKENS > limit:
        raise KvbenchError(f"--context {longest} and its answer are longer than "
                           f"{ref.arch.name}'s {limit:,} positions; give a shorter --context")
    grid = [(config, names, depth) for config, names in found
            for depth in (o.depths if o.task != "copy" else [0.0])]
    mine = [g for i, g in enumerate(grid) if i % count == index]
    cells: list[Cell] = []
    if not o.quiet:
        for line in notes:
            render.note(line)
    lifecycle = Lifecycle(sum(len(names) for _, names, _ in mine), "cells",
                          [Output(csv, results.NEEDLE_COLUMNS, results.NEEDLE_FIRST)])

    def finished(new: list[Cell], new_rows: list[dict]) -> None:
        cells.extend(new)
        lifecycle.keep(new_rows, units=len(new))  # on disk as each (context, depth) ends

    with lifecycle:
        if o.ray is not None:
            _on_cluster(o, ref, options, mine, finished)
        else:
            env, stamp = environment(o.device), results.timestamp()
            prompts = sum(len(names) * o.trials for _, names, _ in mine)
            with render.counter(prompts, "prompts", enabled=not o.quiet) as bar:
                for config, names, depth in mine:
                    new = run_cell(o, ref, options, config, names, depth, bar)
                    finished(new, rows(o, ref, config, new, stamp, env))
    if not o.quiet:
        render.show(report(o, ref, cells))
        if lifecycle.written():
            render.note(str(lifecycle.written()))
    failed = [c for c in cells if c.failures]
    for c in failed:
        render.err.print(f"{c.impl} at {c.context} depth {c.depth:g}: {c.failures[0]}",
                         highlight=False, markup=False)
    if failed:
        raise SystemExit(1)
    return cells


def run_cell(o: NeedleOptions, ref, options, config, names, depth: float,
             bar=None) -> list[Cell]:
    """One context and depth: its prompts through path A, then each implementation (a Cell
    each). The model loads once per process (kvbench.experiments.model.run.load)."""
    import torch

    from kvbench.caches import IMPLEMENTATIONS
    from kvbench.experiments.model import run as model_run

    m = model_run.load(ref, config, o.layers, None)
    tok = Tokens(m.tokenizer)
    context = config.shape.prompt_len
    filler = haystack_ids(tok, o.haystack, context) if o.task != "copy" else []
    prompts = [build(o.task, tok, context, depth,
                     random.Random(f"{o.seed}:{context}:{depth}:{trial}"), filler, o.needle,
                     o.keys, ref.arch.vocab)
               for trial in range(o.trials)]
    _refuse_budget(o, config, prompts)
    out = []
    with torch.no_grad():
        answers = [path_a(m, p, o.task) for p in prompts]
        for name in names:
            cls = IMPLEMENTATIONS[name]
            if bar is not None:
                bar.describe(f"needle {name} {context} depth {depth:g}")
            cell = Cell(name, context, depth, gate=_gate(cls, config))
            for trial, (p, want) in enumerate(zip(prompts, answers)):
                value, kept, least, answer, wrong = run_prompt(
                    m, cls, config, options, p, o.task, o.question_after_compression, want,
                    gate=trial == 0)
                cell.scores.append(value)
                cell.reference.append(reference_score(m, p, o.task, want))
                cell.kept.append(kept)
                cell.kept_min.append(least)
                cell.answers.append(answer)
                if wrong:
                    cell.failures.append(wrong)
                if bar is not None:
                    bar.advance(1)
            planned = replace(config, shape=replace(config.shape, decode_len=ANSWER_TOKENS))
            cell.kv_bytes = model_run.planner_bytes(cls, planned, options.at(config),
                                                    m.model.arch)
            out.append(cell)
    return out


def _on_cluster(o: NeedleOptions, ref, options, grid, finished) -> None:
    """Each (context, depth) a Ray task (kvbench.planning.cluster): the model loaded once per
    worker, the rows made there with its environment, handed back as tasks end."""
    from functools import partial

    from kvbench.planning.lifecycle import on_cluster

    points = [(config, (tuple(names), depth)) for config, names, depth in grid]
    assert o.ray is not None
    on_cluster(o, points, partial(_cell_task, o, ref, options),
               lambda i, outcome: finished(*outcome))


def _cell_task(o: NeedleOptions, ref, options, config, cell, env) -> tuple[list, list]:
    """A Ray task's cell: its Cells and rows."""
    from kvbench.report import results

    names, depth = cell
    new = run_cell(o, ref, options, config, list(names), depth)
    return new, rows(o, ref, config, new, results.timestamp(), env)


def _gate(cls, config) -> str:
    if cls.lossy and cls.records_kept:
        return "attention exact over what it kept (the first trial gated)"
    if lossy(cls, config):
        return "not gated (a window or a format: lossy by design)"
    return "exact: path A's answer"


def _refuse_budget(o: NeedleOptions, config, prompts: list[Prompt]) -> None:
    s = config.shape
    budget = s.kv_budget
    if budget is None:
        return
    P = min(split(p, o.task, o.question_after_compression)[0] for p in prompts)
    if budget >= P:
        raise KvbenchError(f"--kv-budget {budget} keeps the whole prompt of {P} tokens at "
                           f"--context {s.prompt_len}: nothing is dropped; give a budget below "
                           f"{P}")
    if o.task != "copy" and (n := max(len(p.needle) for p in prompts)) > budget:
        raise KvbenchError(f"the needle's key is {n} tokens, more than --kv-budget {budget} "
                           "can keep; give a larger budget or a shorter --needle")


def rows(o: NeedleOptions, ref, config, cells: list[Cell], stamp: str,
         env: dict[str, object]) -> list[dict[str, object]]:
    from kvbench.sizing.config import technique_cells

    out = []
    for c in cells:
        n = len(c.scores)
        out.append({
            "timestamp": stamp, "command": "needle", "task": o.task, "model": ref.label,
            "impl": c.impl, "context": c.context,
            "depth": None if o.task == "copy" else c.depth, "trials": n,
            "query": "agnostic" if o.question_after_compression else "aware",
            "accuracy": sum(c.scores) / n, "full_accuracy": sum(c.reference) / n,
            "needle_kept": sum(c.kept) / n, "needle_kept_min_layer": min(c.kept_min),
            "kv_bytes": c.kv_bytes, "passed": not c.failures, "gate": c.gate,
            "answers": " | ".join(a.strip() for a in c.answers),
            **technique_cells(config.shape), "kv_dtype": config.kv_dtype,
            "layers": o.layers, "dtype": config.dtype, "device": config.device,
            "seed": o.seed, "haystack": str(o.haystack) if o.haystack else None,
            **env})
    return out


def report(o: NeedleOptions, ref, cells: list[Cell]) -> Report:
    from kvbench.report.render import new_table, plural

    mode = ("query-agnostic: the question after compression" if o.question_after_compression
            else "query-aware: the question in the prompt")
    if o.task == "copy":  # no question: the second copy is fed once the first is cached
        mode = "the second copy predicted once the first is cached"
    t = new_table(f"needle  {o.task} on {ref.label}, {o.trials} {plural(o.trials, 'trial')} "
                  f"a cell; {mode}")
    for name in ("impl", "context", "depth", "accuracy", "full", "needle kept", "check"):
        t.add_column(name, justify="left" if name in ("impl", "check") else "right")
    for c in cells:
        n = len(c.scores)
        t.add_row(c.impl, f"{c.context:,}", "" if o.task == "copy" else f"{c.depth:g}",
                  f"{sum(c.scores) / n:.0%}", f"{sum(c.reference) / n:.0%}",
                  f"{sum(c.kept) / n:.0%}", "PASS" if not c.failures else "[red]FAIL[/]")
    t.caption = ("accuracy: answers whose first number is the key (copy: the second copy's "
                 "tokens predicted); full: the full cache's accuracy (full_accuracy), path A, "
                 "transformers' greedy answer on the same prompts; "
                 "needle kept: the share of KV heads holding every token of the key, mean over "
                 "layers, at the last step")
    return Report([t])
