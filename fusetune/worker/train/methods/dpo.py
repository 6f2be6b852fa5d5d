"""Direct preference optimisation (DPO, and IPO's loss) on pairs of a preferred and a non-preferred output.

The pairs, the reference pass and the metrics are the preference methods' (preference.py); this is the formula.
With h = (log p(chosen) - log ref(chosen)) - (log p(rejected) - log ref(rejected)):
- "sigmoid" (DPO): -log sigmoid(beta * h).
- "ipo": (h' - 1 / (2 beta))^2, where h' takes each side's log-probabilities divided by its token count.
plus `sft_weight` times the preferred output's mean token negative log-likelihood. The rewards are beta times
each side's log-ratio to the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusetune.worker.train.methods.preference import PairScores, PreferenceMethod


class DirectPreferenceOptimization(PreferenceMethod):
    type = "dpo"

    def pair_losses(self, scores: PairScores) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        chosen_ratio = scores.chosen - scores.reference[:, 0]
        rejected_ratio = scores.rejected - scores.reference[:, 1]
        beta = self.settings.beta
        if self.settings.loss_type == "ipo":
            margin = chosen_ratio / scores.chosen_tokens - rejected_ratio / scores.rejected_tokens
            losses = (margin - 1 / (2 * beta)) ** 2
        else:
            losses = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
        losses = losses + self.sft_term(scores, self.settings.sft_weight)
        return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
