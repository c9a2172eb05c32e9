"""Trainer callbacks shared by the training tests and the two-process worker (not a test module)."""

from transformers import TrainerCallback


class StopAt(TrainerCallback):
    """Stop training after `step` (its checkpoint is written first): a kill right after a save."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True
        return control
