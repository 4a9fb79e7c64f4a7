"""A whole decoder: its architecture (`spec`), checkpoints and GGUF files (`load`), and its
forward with one cache per layer (`transformer`).
"""
