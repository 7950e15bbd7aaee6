"""Traces -> training pairs with overlap targets -> a fine-tuned sentence encoder (`cohort train`).

    targets.py   expert-frequency profiles and pair targets (pure numpy; default: expected overlap)
    pairs.py     split by request; near-neighbour, hard-negative and random pairs (pure numpy)
    finetune.py  sentence-transformers training (CoSENT, SentenceTransformerTrainer), checkpoints, resume
    cli.py       `cohort train --traces PATH --base NAME_OR_PATH --output DIR`

The saved folder is a normal sentence-transformers model: `cohort plan --encoder DIR` and
`encoder.embedding.Embedder(DIR)` load it.
"""
