"""The experiments, one module per command: verify (path A against path B, token by token),
bench (timing, bandwidth, cost per step), memory (payload, allocated, reserved), capacity (the
planner's command and the allocation check), tune (the Triton kernel's configurations) and
serve-sim (a serving trace on a paged pool); `model/` runs verify, bench and memory on a whole
decoder. Each computes its result and owns its rows (what it writes to its CSV) and its
tables; kvbench.report holds what they share: the columns of every file, the table kit, the
CSV files themselves, plot and compare.

May import: planning, serving and everything below them; not subjects, options or the CLI.
"""
