"""One module per `eagle3-hf` subcommand: parse its options, load the target (and draft), call the subpackage.

This is the top of the data flow: the only code besides `benchmark` that loads targets by name and so may import
`modeling`, `generation` and `training` together. Each module exposes `add_cli_arguments(parser)` and
`run_cli(args) -> int`; `eagle3_hf.cli` dispatches to them.
"""
