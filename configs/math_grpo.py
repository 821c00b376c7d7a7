"""Math GRPO on a text-only model: group-normalised advantages, the loss only on the 30% of
each completion's tokens with the highest entropy (arXiv 2506.01939: math needs more
exploration than the default 20%), and two PPO epochs over each rollout batch.

    python -m jaxvrl.train --config configs/math_grpo.py

On the embedded default: the tiny text-only Llama and the built-in arithmetic task (one-digit
sums, scored by `accuracy`). The real run, DeepSeek-Math 7B (a Llama-architecture base model:
no chat template, so prompts are the plain text) on GSM8K with 1,024 new tokens:
--config.model.path=deepseek-ai/deepseek-math-7b-base --config.model.dtype=bfloat16
--config.data.train_files=openai/gsm8k:main@train --config.data.val_files=openai/gsm8k:main@test
--config.data.prompt_key=question --config.data.answer_key=answer
--config.data.max_prompt_length=512 --config.rollout.max_new_tokens=1024
--config.model.remat_policy=full --config.workdir=gs://bucket/runs/math-grpo-7b
"""

from configs import base


def get_config(arg=None):
    c = base.get_config(arg)
    c.name = "math_grpo"
    c.data.builtin_task = "arithmetic"
    c.rollout.max_new_tokens = 24  # "<think>a + b = s</think> Answer: s" and its EOS
    c.reward.funcs = ("accuracy",)
    c.reward.weights = (1.0,)
    c.tprl.enable_entropy_filtering = True
    c.tprl.top_p_entropy_tokens = 0.3
    c.actor.ppo_epochs = 2
    return c
