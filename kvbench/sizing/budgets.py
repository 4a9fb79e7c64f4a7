"""Per-layer eviction budgets (--layer-budgets, with --model): each layer's cache keeps its own
number of positions per KV head.

- a list: one budget per layer, bottom first;
- `pyramid` (PyramidKV, Cai et al. 2024): budgets falling linearly from the bottom layer to
  the top with the mean at --kv-budget N, so the model holds what N everywhere would. The top
  layer keeps N / BETA (at least 1) and the bottom 2N minus that; where the bottom's would be
  more positions than there are to keep, it keeps them all and the top the rest of 2N. Layer i
  of L keeps round(bottom − i·(bottom − top)/(L − 1)). kvpress's PyramidKVPress computes the
  same line and falls back to N everywhere when the top layer's budget would be below its
  observation window; kvbench draws the pyramid whatever the window.
- `pyramid` under --kv-reference kvpress: PyramidKVPress's budgets, whose every layer keeps
  its window of W positions (--kv-recent, default KVPRESS_WINDOW) within its budget: the
  bottom keeps at most the prompt less W; the top's budget is N / BETA, or where the bottom
  is capped the rest of 2N; where the top would then be below W (or the bottom below the
  top), every layer keeps N.
"""

from __future__ import annotations

from dataclasses import replace

from kvbench.errors import KvbenchError

BETA = 20  # the pyramid's steepness: the bottom layer keeps about 2·BETA − 1 times the top's
KVPRESS_WINDOW = 64  # PyramidKVPress's window_size


def positions(shape) -> int:
    """The positions a budget applies to: the prompt under --kv-compress prefill, else the
    longest sequence."""
    return shape.prompt_len if shape.kv_compress == "prefill" else max(shape.row_lens)


def pyramid(mean: int, layers: int, held: int, reference: str | None = None,
            window: int = KVPRESS_WINDOW) -> tuple[int, ...]:
    """Budgets for `layers` layers averaging `mean`, none above `held` positions (under
    --kv-reference kvpress: PyramidKVPress's, with its `window`)."""
    if reference == "kvpress":
        return kvpress_pyramid(mean, layers, held, window)
    if layers == 1:
        return (mean,)
    top = max(1, round(mean / BETA))
    bottom = 2 * mean - top
    if bottom > held:
        bottom, top = held, 2 * mean - held
    step = (bottom - top) / (layers - 1)
    return tuple(round(bottom - i * step) for i in range(layers))


def kvpress_pyramid(mean: int, layers: int, held: int, window: int) -> tuple[int, ...]:
    """PyramidKVPress.get_layer_budget for each layer, as kvpress 0.5.5 computes it."""
    low = mean / BETA
    high = 2 * mean - low
    if high >= held - window:
        high = held - window
        low = 2 * mean - high
    if not held >= high >= low >= window:
        return (mean,) * layers
    step = (high - low) / (layers - 1) if layers > 1 else 0.0  # one layer: the bottom's
    return tuple(round(high - i * step) for i in range(layers))


def parse(spec: str | None, layers: int) -> tuple[int, ...] | str | None:
    """--layer-budgets: "pyramid", or a list of one positive budget per layer."""
    if spec is None or spec.strip().lower() == "pyramid":
        return None if spec is None else "pyramid"
    try:
        budgets = tuple(int(v) for v in spec.split(","))
    except ValueError:
        budgets = ()
    if not budgets or min(budgets) < 1:
        raise KvbenchError(f"--layer-budgets takes pyramid or positive budgets separated by "
                           f"commas, got {spec!r}")
    if len(budgets) != layers:
        raise KvbenchError(f"--layer-budgets gives {len(budgets)} budgets for a model of "
                           f"{layers} layers; give one per layer, or pyramid")
    return budgets


def resolve(shape, spec: tuple[int, ...] | str, layers: int):
    """The shape with each layer's budget (LayerShape.layer_budgets)."""
    held = positions(shape)
    window = shape.kv_recent if shape.kv_recent is not None else KVPRESS_WINDOW
    budgets = (pyramid(shape.kv_budget, layers, held, shape.kv_reference, window)
               if spec == "pyramid" else spec)
    for i, b in enumerate(budgets):
        if b > held:
            raise KvbenchError(f"--layer-budgets: layer {i}'s budget {b} is above the {held} "
                               "positions it would apply to; use at most "
                               f"{held}")
        if shape.kv_recent is not None and b < shape.kv_recent:
            raise KvbenchError(f"--layer-budgets: layer {i}'s budget {b} is below --kv-recent "
                               f"{shape.kv_recent}; lower --kv-recent or raise the budget")
    return replace(shape, layer_budgets=budgets)


def per_layer(config, layers: int) -> list:
    """Each layer's RunConfig: the point's, with the layer's own --kv-budget where
    --layer-budgets gives one."""
    budgets = config.shape.layer_budgets
    if budgets is None:
        return [config] * layers
    return [replace(config, shape=replace(config.shape, kv_budget=b, layer_budgets=None))
            for b in budgets]
