"""Shapes and sizes, without torch: a point's typed configuration (`config`), the capacity
planner and the model presets (`capacity`), serving length distributions (`lengths`), and
reading TOML files (`files`).

May import: formats and errors.
"""
