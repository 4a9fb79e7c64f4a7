"""The experiments, one module per command: verify (path A against path B, token by token),
bench (timing, bandwidth, cost per step), memory (payload, allocated, reserved), capacity (the
planner's command and the allocation check), tune (the Triton kernel's configurations) and
serve-sim (a serving trace on a paged pool); `model/` runs verify, bench and memory on a whole
decoder. Each computes its result; kvbench.report turns results into rows and tables.

May import: planning, serving and everything below them; not subjects, options or the CLI.
"""
