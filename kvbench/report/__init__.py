"""Results as users read them: the CSV files, every kind's columns and the cells rows share
(`results`), what a command shows as data (`tables`: a Report of tables and lines, which an
experiment fills) and the terminal's kit that draws it (`render`: tables that fit 80
columns, notes, progress, the preflight's plans), reading results back (`load`), `compare`
and `plot`. Each command's own rows and Report are built in its experiment.

May import: measure, sizing, formats; never a cache, layer or kernel (import-linter's
contract: a caller passes what it needs, as `plot` takes the planner of older rows), never
an experiment.
"""
