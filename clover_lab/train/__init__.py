"""Training small Clover models: the corpus (``corpus.py``), the block-diffusion objective and
held-out evaluation (``objective.py``), the training loop, export and command line (``loop.py``),
self-distillation data (``distill.py``), functions as (head, body) pairs for prompt following
(``functions.py``) and the model card (``card.py``).

    python -m clover_lab.train --out runs/stdlib --minutes 90
"""
from clover_lab.train.loop import export, lr_at, main, prepare, train, training_batch
from clover_lab.train.objective import (
    TrainSettings,
    block_diffusion_loss,
    evaluate,
    load_balance_loss,
    mask_blocks,
    unigram_accuracy,
)
from clover_lab.train.stdlib_corpus import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    encode_files,
    is_heldout,
    read_text,
    split_corpus,
    stdlib_files,
    train_tokenizer,
)

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "encode_files", "is_heldout", "read_text", "split_corpus", "stdlib_files",
           "train_tokenizer", "export", "lr_at", "main", "prepare", "train", "training_batch", "TrainSettings",
           "block_diffusion_loss", "evaluate", "load_balance_loss", "mask_blocks", "unigram_accuracy"]
