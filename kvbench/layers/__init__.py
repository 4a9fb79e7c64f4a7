"""What is cached: one GQA attention layer with path A (`attention`), DeepSeek's MLA layer
(`mla`), and a whole decoder (`model/`: its spec, checkpoint loading, its forward with a cache
per layer).

May import: report (a checkpoint's conversion notes), caches and everything below.
"""
