"""Block-scaled FP8 checkpoints: ``checkpoint.py`` reads them (the loader's FP8 part),
``quantize.py`` writes one from any checkpoint the loader reads. Import the modules themselves:
this package imports nothing, so that ``loading`` and ``quantize`` never import each other
through it."""
