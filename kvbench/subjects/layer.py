"""One attention layer: GQA, or MLA with --attention mla (kvbench.layers), including an MLA
preset's one layer (--model deepseek-v3 --layers 1)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvbench.errors import KvbenchError

if TYPE_CHECKING:
    from kvbench.options import RunOptions
    from kvbench.report.tables import Report


def attention_model(o: RunOptions) -> RunOptions:
    """--model NAME of a preset whose whole model kvbench does not run but whose attention
    layer it does (an MLA model's [attention] table): with --layers 1, the options of that
    one layer (--attention mla, the preset's heads, hidden size and MLA dims). Otherwise o."""
    if o.model is None:
        return o
    from kvbench.planning.plan import MLA_OPTIONS
    from kvbench.sizing.capacity import PRESET_DIR
    from kvbench.sizing.files import read_toml

    path = PRESET_DIR / f"{o.model.lower()}.toml"
    if not path.is_file():
        return o
    data = read_toml(path, "preset")
    layer = data.get("attention")
    if not isinstance(layer, dict):
        return o
    if o.layers != 1:
        raise KvbenchError(f"--model {o.model}: kvbench runs this model's attention layer, "
                           "not the whole model (its MoE is capacity-only); add --layers 1")
    given = [n for n in ("hidden", "q_heads", "kv_heads", "head_dim", *MLA_OPTIONS)
             if getattr(o, n) is not None]
    if given:
        raise KvbenchError(f"--model {o.model} sets the layer's shape; drop "
                           f"--{given[0].replace('_', '-')}")
    return o.but(model=None, layers=None, attention="mla", hidden=str(layer["hidden"]),
                 q_heads=str(data["q_heads"]), **{n: layer[n] for n in MLA_OPTIONS})


class Layer:
    name = "layer"

    def take(self, o: RunOptions) -> RunOptions | None:
        o = attention_model(o)  # an MLA preset's one attention layer
        return o if o.model is None else None

    def expand(self, o: RunOptions, command: str):
        from kvbench.experiments.bench import BenchOptions
        from kvbench.measure.device import resolve_device
        from kvbench.planning import plan

        if o.layer_budgets is not None:
            raise KvbenchError("--layer-budgets gives each layer of a model its budget; add "
                               "--model (one layer takes --kv-budget)")
        if o.all_full:
            raise KvbenchError("--all-full takes a model's sliding layers' windows away; add "
                               "--model (one layer has a window only with --window)")
        if o.pp != 1 or o.pp_layers is not None:
            raise KvbenchError("--pp splits a model's layers into pipeline stages; add --model")
        if o.nproc is not None:
            from kvbench.measure import distributed

            if distributed.launched():
                raise KvbenchError("--nproc starts the ranks itself; under torchrun drop it")
            if o.nproc != o.tp:
                raise KvbenchError(f"--nproc {o.nproc}: --tp {o.tp} runs {o.tp} ranks; use "
                                   f"--nproc {o.tp}")
            import sys

            import typer

            from kvbench.planning.launch import launch

            raise typer.Exit(launch(o.nproc, sys.argv[1:]))

        if command == "verify":
            return (*plan.expand(o, reference_cases=True), None)
        if command == "bench":
            if o.graph and not resolve_device(o.device).startswith("cuda"):
                raise KvbenchError("bench --graph times CUDA graphs, and there is no CUDA "
                                   "device here; verify --graph checks the captured steps on "
                                   "the CPU")
            options = BenchOptions(o.warmup, o.rounds, o.recompute, o.prefill)
            return (*plan.expand(o, measure="bench"), options)
        return (*plan.expand(o, measure="memory"), None)

    def point(self, command: str, o: RunOptions, impl_options, bench_options):
        from kvbench.caches import IMPLEMENTATIONS
        from kvbench.experiments.bench import bench, bench_rows, bench_warnings
        from kvbench.experiments.memory import memory, memory_rows
        from kvbench.experiments.verify import verify, verify_rows
        from kvbench.report import render

        if command == "verify":
            def run_point(config, names, env):
                report = verify(config, {n: IMPLEMENTATIONS[n] for n in names}, impl_options)
                return report, verify_rows(report, env)
        elif command == "bench":
            def run_point(config, names, env):
                result = bench(config, names, bench_options, impl_options)
                if o.format != "table" and not o.quiet:  # the table prints its own
                    for line in bench_warnings(result):
                        render.warn(line)
                return result, bench_rows(result, env)
        else:
            def run_point(config, names, env):
                result = memory(config, names, impl_options)
                return result, memory_rows(result, env)
        return run_point

    def plans(self, command, o, impl_options, bench_options):
        return None  # the preflight's own: one layer's phases

    def report(self, command: str, result) -> Report:
        from kvbench.experiments.bench import bench_report
        from kvbench.experiments.memory import memory_report
        from kvbench.experiments.verify import verify_report

        return {"verify": verify_report, "bench": bench_report,
                "memory": memory_report}[command](result)

    def failed(self, report, check) -> str:
        from kvbench.report.render import describe

        where = "prefill" if check.first_bad_step == 0 else f"step {check.first_bad_step}"
        return f"{check.impl} at {where} ({describe(report.config)}): {check.message}"

    def refused(self, report, check) -> str:
        from kvbench.report.render import describe

        return f"it disagrees with recompute ({describe(report.config)}: {check.message})"

