"""The numerics of the RL loop: advantage estimators, policy losses, KL estimators
and the objective that combines them. Plain torch functions on ``[B, T]`` tensors
masked by ``action_mask``; the builtin plugins register them by name."""

#: loss aggregation modes (``--algo.policy_loss.aggregation``)
AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
