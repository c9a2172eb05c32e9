"""EAGLE-3 tree decoding: pure tree and acceptance functions, the draft-side state, the cost model and the loop.

Imports only `eagle3_hf.modeling` and `eagle3_hf.utils`. `bind_target(draft, target)` (also `eagle3_hf.bind_target`)
routes `target.generate(..., assistant_model=draft)` to EAGLE-3 on that target instance.
"""

from eagle3_hf.generation.decoding import ContextLookup, Eagle3GenerateOutput, bind_target, eagle3_decoding

__all__ = ["ContextLookup", "Eagle3GenerateOutput", "bind_target", "eagle3_decoding"]
