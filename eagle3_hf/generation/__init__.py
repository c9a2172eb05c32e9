"""EAGLE-3 tree decoding: pure tree and acceptance functions, the draft-side state, the cost model and the loop.

Imports only `eagle3_hf.modeling` and `eagle3_hf.utils`. Importing this package registers the router that sends
`target.generate(..., assistant_model=draft)` to EAGLE-3 (`modeling.target_fit.route_generate`); `eagle3_hf` imports
it on first use of a public name, so users never do it themselves.
"""

from eagle3_hf.generation.decoding import ContextLookup, Eagle3GenerateOutput, bind_target, eagle3_decoding

__all__ = ["ContextLookup", "Eagle3GenerateOutput", "bind_target", "eagle3_decoding"]
