"""`kvbench serve-sim`: continuous batching on a seeded request trace, timed on real decode
steps and verified request by request.

The same trace and the same pool of KV blocks are served once per way of reserving
(kvbench.serving.scheduler): paged takes blocks as sequences grow, prealloc reserves --max-len
per request as a cache preallocated to the maximum length does, oracle reserves each
request's own prompt + output (which no server can know), both from blocks anywhere in the
pool. The vLLM paper's baselines reserve contiguous space, so free blocks between
reservations go unused: orca-max (--max-len), orca-pow2 (prompt + output rounded up to a
power of two) and orca-oracle (prompt + output), each one run of consecutive blocks, first
fit; static batches requests as orca-max reserves them and admits a batch only when the one
before has finished. Every step
is carried out by kvbench.serving.engine on one attention layer and timed; the clock the requests
arrive and are served on is the sum of those step times (arrivals at --rate requests per
second; with no --rate all arrive at once, a throughput run). Each finished request's outputs
are compared with path A, the request recomputed alone; the check is not timed.

kvbench/experiments/servesim/: options.py (SimOptions, declared once), checks.py (what
SimOptions refuses), runs.py (one reserve run on the trace, and its figures), loop.py (the
command's run), tables.py and rows.py (what it shows and writes).
"""

from kvbench.experiments.servesim.checks import (  # noqa: F401
    DECODE_KERNELS,
    RESERVATIONS,
    RESERVES,
)
from kvbench.experiments.servesim.loop import (  # noqa: F401  (the command's entry points)
    LONG_RUN_S,
    _before,
    _estimate,
    expected_steps,
    expected_time,
    host_bytes,
    layer_shape,
    preflight,
    run,
    trace_preflight,
    write_profile,
)
from kvbench.experiments.servesim.options import (  # noqa: F401
    DEFAULT_POSITIONS,
    ONE_LAYER,
    WARMUP_REQUESTS,
    SimOptions,
)
from kvbench.experiments.servesim.rows import (  # noqa: F401
    decision_cells,
    serve_rows,
    serve_step_rows,
)
from kvbench.experiments.servesim.runs import (  # noqa: F401
    Served,
    _served,
    _subject,
    count,
    decode_kernel,
    latencies,
    met_slo,
    prepare_kernel,
    replay,
    requests,
    serve,
    tolerance,
)
from kvbench.experiments.servesim.tables import (  # noqa: F401
    by_reserve,
    ratio_line,
    scheduler_line,
    serve_report,
    serve_table,
    steps_table,
)
