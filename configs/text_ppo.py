"""PPO with GAE on a text-only model: token-level rewards, a value head on its own copy of the
backbone trained with the clipped value loss, GAE with gamma 0.99 and lambda 0.95; the KL to
the reference policy is subtracted from the reward with the adaptive controller.

    python -m jaxvrl.train --config configs/text_ppo.py

On the embedded default: the tiny text-only Llama and the built-in arithmetic task (one-digit
sums, scored by `accuracy`). The real run, Llama 2 7B (a base model: no chat template, so
prompts are the plain text) with 512-token prompts, 256-token responses and 256 prompts per
update: --config.model.path=meta-llama/Llama-2-7b-hf --config.model.dtype=bfloat16
--config.data.train_files=train.jsonl --config.data.val_files=val.jsonl
--config.data.max_prompt_length=512 --config.rollout.max_new_tokens=256
--config.prompts_per_step=256 --config.rollout.num_generations=1
--config.critic.lr=1e-5 --config.critic.warmup_steps=10 --config.model.remat_policy=full
"""

from configs import ppo


def get_config(arg=None):
    c = ppo.get_config(arg)
    c.name = "text_ppo"
    c.data.builtin_task = "arithmetic"
    c.rollout.max_new_tokens = 24  # "<think>a + b = s</think> Answer: s" and its EOS
    c.algorithm.gamma = 0.99
    c.algorithm.lam = 0.95
    c.reward.funcs = ("accuracy",)
    c.reward.weights = (1.0,)
    return c
