"""From options to points, and running them: `plan` (points, implementation options, notes),
`sweep` (sweep files), `preflight` (each phase's memory before anything is allocated) and
`runner` (the progress bar, rows written as each point ends, device errors, Ctrl-C) and
`cluster` (the points as Ray tasks with --ray, or one shard of them with --shard).

May import: layers, report and everything below; never an experiment (they import this).
"""
