"""The model, pure math and its state: the decoder (``decoder.py``: CloverModel, its three modes,
random weights and packed CPU weights), its layers (``layers/``), the committed-prefix cache
(``cache.py``), the forward's layout (``context.py``) and committed drafts (``drafts.py``).
Nothing here schedules a generation (``engine/``) or reads a checkpoint (``checkpoint/``)."""
