"""Training a draft: conversations and chat templates, regeneration, the draft vocabulary, target features, the
TTT forward and loss, and the `Trainer` subclass.

Imports only `eagle3_hf.modeling` and `eagle3_hf.utils` (and itself); target loading and the command line sit above.
"""
