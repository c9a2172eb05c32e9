"""The draft model and its checkpoints: the bottom of the package.

Configuration, the draft model, the target layer families it reuses, checkpoint layouts (read and write) and the
draft-vocabulary mapping (d2t/t2d). Nothing here imports `eagle3_hf.generation`, `eagle3_hf.training` or the
top-level modules; they import this.
"""
