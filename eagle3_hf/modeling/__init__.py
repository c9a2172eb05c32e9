"""The draft model and its checkpoints, just above `eagle3_hf.utils`.

Configuration, the draft model, the target layer families it reuses, checkpoint layouts (read and write), the
draft-vocabulary mapping (d2t/t2d), growing a draft's depth (`depth`), the draft fitted to its target (`target_fit`)
and what the package ships (`shipped`). Nothing here imports more of eagle3_hf than `eagle3_hf.utils`;
`eagle3_hf.generation`, `eagle3_hf.training` and the layers above import this.
"""
