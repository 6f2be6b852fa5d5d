"""Simple preference optimisation (SimPO) on pairs of a preferred and a non-preferred output.

No reference model: the implicit reward of a side is beta times its mean token log-probability under the policy,
and the loss asks the preferred side's reward to exceed the other's by a target margin gamma:
  -log sigmoid(beta * (log p(chosen) / |chosen| - log p(rejected) / |rejected|) - gamma),
gamma = gamma_beta_ratio * beta, plus `sft_weight` times the preferred output's mean token negative
log-likelihood. The pairs and the metrics are the preference methods' (preference.py); this is the formula.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusetune.worker.train.methods.preference import PairScores, PreferenceMethod


class SimplePreferenceOptimization(PreferenceMethod):
    type = "simpo"

    def pair_losses(self, scores: PairScores) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        beta = self.settings.beta
        chosen_reward = beta * scores.chosen / scores.chosen_tokens
        rejected_reward = beta * scores.rejected / scores.rejected_tokens
        gamma = self.settings.gamma_beta_ratio * beta
        losses = -F.logsigmoid(chosen_reward - rejected_reward - gamma)
        losses = losses + self.sft_term(scores, self.settings.sft_weight)
        return losses, chosen_reward.detach(), rejected_reward.detach()
