"""A Hugging Face directory <-> a CloverModel: reading one (``loading.py``, through the tensor
names of ``names.py``; block-scaled FP8 ones through ``fp8.py``), writing one (``saving.py``; an
FP8 copy with ``quantize.py``) and what a directory implies for generation beyond its weights
(``defaults.py``). Import the modules themselves: this package imports nothing, so that
``loading`` and ``quantize`` never import each other through it."""
