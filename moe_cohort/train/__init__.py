"""Traces -> expert profiles (or pairs with overlap targets) -> a fine-tuned sentence encoder (`cohort train`, moe_cohort/cli/train.py).

    targets.py   expert-frequency profiles and pair targets (pure numpy; default: weighted Jaccard)
    pairs.py     split by request; near-neighbour, hard-negative and random pairs (pure numpy)
    finetune.py  sentence-transformers training (SentenceTransformerTrainer), checkpoints, resume
    profile_loss.py  the default objective: predict each request's expert profile (torch)

The saved folder is a normal sentence-transformers model: `cohort plan --encoder DIR` and
`encoder.embedding.Embedder(DIR)` load it.
"""
