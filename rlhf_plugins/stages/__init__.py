"""The stages before RL -- supervised fine-tuning, reward-model training, DPO -- run by TRL's
trainers under this project's conventions (``rlhf sft``, ``rlhf rm``, ``rlhf dpo``)."""
