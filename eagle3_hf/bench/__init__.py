"""The benchmark behind `eagle3-hf bench`: the runner, its report, the batched bench and the
bench cards. Above generation/, training/ and the top-level modules (target loading), below commands/.
"""
