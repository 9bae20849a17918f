"""Training small Clover models: the corpus (``corpus.py``), the block-diffusion objective and
held-out evaluation (``objective.py``), the training loop, export and command line (``loop.py``),
self-distillation data (``distill.py``) and the model card (``card.py``).

    python -m clover_lab.train --out runs/stdlib --minutes 90
"""
from .corpus import (CHAT_TEMPLATE, SPECIAL_TOKENS, encode_files, is_heldout, read_text, split_corpus, stdlib_files,
                     train_tokenizer)
from .loop import export, lr_at, main, prepare, train, training_batch
from .objective import (TrainSettings, block_diffusion_loss, evaluate, load_balance_loss, mask_blocks,
                        unigram_accuracy)

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "encode_files", "is_heldout", "read_text", "split_corpus", "stdlib_files",
           "train_tokenizer", "export", "lr_at", "main", "prepare", "train", "training_batch", "TrainSettings",
           "block_diffusion_loss", "evaluate", "load_balance_loss", "mask_blocks", "unigram_accuracy"]
