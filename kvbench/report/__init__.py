"""Results as users read them: the CSV files, every kind's columns and the cells rows share
(`results`), the terminal's kit (`render`: tables that fit 80 columns, notes, progress, the
preflight's plans), reading results back (`load`), `compare` and `plot`. Each command's own
rows and tables are in its experiment.

May import: caches (plot names implementations), measure, sizing, formats; never an experiment.
"""
