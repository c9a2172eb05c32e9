"""The draft model and its checkpoints: the bottom of the package.

Configuration, the draft model, the target layer families it reuses, checkpoint layouts (read and write), the
draft-vocabulary mapping (d2t/t2d) and growing a draft's depth (`depth`). Nothing here imports
`eagle3_hf.generation`, `eagle3_hf.training` or the top-level modules; they import this.
"""
