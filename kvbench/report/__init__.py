"""Results as users read them: the CSV files and their columns (`results`), the terminal's
tables (`render`), reading results back (`load`), `compare` and `plot`.

May import: caches (plot names implementations), measure, sizing, formats; never an experiment.
"""
