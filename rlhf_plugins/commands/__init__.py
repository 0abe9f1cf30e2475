"""``rlhf`` subcommands beyond ``train`` and ``plugins``: each module adds its parser and runs it."""
