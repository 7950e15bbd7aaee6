"""The `profile` training objective: fine-tune the encoder to predict a request's expert profile.

The pair objectives (CoSENT and the others in train.finetune) teach the encoder that cosine tracks
expert overlap; what admission reads, though, is the profile head's prediction (encoder.profile).
This objective trains for that directly: a linear layer on the unit embedding gives per-layer
logits [L, E], and the loss is the cross-entropy between each layer's softmax and the request's
expert frequencies normalised to sum to one (train.targets.profiles / top_k). The layer exists only
while training (the saved folder is the encoder alone); `cohort train` then fits the ridge head on
the fine-tuned embeddings as for any encoder. It starts at the training side's mean profile (zero
weights, bias log mean) and learns at its own, larger rate (finetune.PROFILE_LAYER_LR), the encoder at
the usual fine-tuning rate. A resumed run restarts the layer there (checkpoints hold the encoder and
the optimiser; the layer relearns in a few steps).
"""

from __future__ import annotations

import numpy as np
import torch

PROFILE_LAYER = "profile_layer"


class ProfileLoss(torch.nn.Module):
    """Cross-entropy of softmax(profile_layer(unit embedding)) per layer against the profile / top_k."""

    def __init__(self, model, mean_profile: np.ndarray):
        super().__init__()
        self.model = model
        self.shape = mean_profile.shape  # (L, E)
        self.profile_layer = torch.nn.Linear(model.get_embedding_dimension(), mean_profile.size)
        with torch.no_grad():
            self.profile_layer.weight.zero_()
            self.profile_layer.bias.copy_(torch.log(torch.as_tensor(mean_profile, dtype=torch.float32).clamp_min(1e-4)).ravel())

    def forward(self, sentence_features, labels: torch.Tensor) -> torch.Tensor:
        emb = self.model(sentence_features[0])["sentence_embedding"]  # [B, D]
        logits = self.profile_layer(torch.nn.functional.normalize(emb, dim=-1)).view(-1, *self.shape)  # [B, L, E]
        target = labels.view(-1, *self.shape).to(logits.dtype)  # [B, L, E], rows sum to 1 (or 0: no token)
        return -(target * torch.log_softmax(logits, dim=-1)).sum(dim=-1).mean()


def profile_targets(prof: np.ndarray) -> np.ndarray:  # [N, L, E] -> [N, L, E] float32
    """Expert frequencies with each layer's row summing to one (a row without tokens stays zero)."""
    total = prof.sum(axis=-1, keepdims=True)
    return (prof / np.where(total > 0, total, 1.0)).astype(np.float32)
