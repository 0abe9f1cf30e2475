"""Held-out evaluation: sample completions for test prompts, score them with reward functions,
and summarise them as pass@k, mean@k, maj@k and greedy accuracy."""
