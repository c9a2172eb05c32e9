"""EAGLE-3 tree decoding: pure tree and acceptance functions, the draft-side state, the cost model and the loop.

Imports only `eagle3_hf.modeling`. Importing this package registers `bind_target` as what `Eagle3DraftModel.bind`
runs (`eagle3_hf` imports it on first use of a public name, so users never do it themselves).
"""

from eagle3_hf.generation.decoding import ContextLookup, Eagle3GenerateOutput, bind_target, eagle3_decoding

__all__ = ["ContextLookup", "Eagle3GenerateOutput", "bind_target", "eagle3_decoding"]
