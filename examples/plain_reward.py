"""The simplest rlhf-plugins plugin: a file with plain reward functions.

Any public function with TRL's signature ``(prompts, completions, **kwargs)``
becomes a reward function named after it; dataset columns arrive as keyword
arguments (the label column as ``label``)::

    rlhf train --plugin examples/plain_reward.py
"""


def bare_number(prompts, completions, **kwargs):
    """1.0 when the completion is just a number (no stray text)."""
    return [1.0 if c.strip().isdigit() else 0.0 for c in completions]
