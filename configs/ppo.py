"""PPO with a critic: GAE advantages from token-level rewards and a value
head on its own copy of the Qwen2.5-VL backbone, trained with the clipped value loss; the KL to
the reference policy is subtracted from the reward with the adaptive controller.

    python -m jaxvrl.train --config configs/ppo.py

A real model and data: add --config.model.path=/ckpt/Qwen2.5-VL-7B-Instruct
--config.data.train_files=train.jsonl --config.critic.lr=1e-5 --config.critic.warmup_steps=10
(the critic learns alone for the first steps). On one accelerator add LoRA to both policy and
critic: --config.lora.rank=8.
"""

from configs import base


def get_config(arg=None):
    c = base.get_config(arg)
    c.name = "ppo"
    c.algorithm.adv_estimator = "gae"
    c.algorithm.gamma = 1.0
    c.algorithm.lam = 0.95
    c.algorithm.use_kl_in_reward = True
    c.algorithm.kl_ctrl.type = "adaptive"
    c.algorithm.kl_ctrl.kl_coef = 0.01
    c.algorithm.kl_ctrl.target_kl = 6.0
    c.algorithm.kl_ctrl.horizon = 10000
    c.actor.loss_agg_mode = "token-mean"  # verl's PPO default
    c.critic.lr = 1e-4  # the embedded tiny model; 1e-5 for billions of parameters
    c.critic.warmup_steps = 0
    return c
