"""Measuring and the cost model: timing (`timing`), the copy bandwidth (`bandwidth`), the
allocation check (`allocation`), each phase's bytes from the shape (`footprint`), the bytes and
FLOPs a step must cost (`costs`), devices and dtypes (`device`), host memory (`hostmem`), the
environment on every row (`env`), and tensor parallelism's process group (`distributed`).

May import: sizing, formats and errors.
"""
