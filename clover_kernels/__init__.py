"""clover_kernels: the production kernel core of clover_lab (torch + Triton only).

Per op, one folder: ``naive.py`` the readable reference (loops, the spec's formulas),
``torch.py`` the production torch path where it differs (chunked, grouped, oneDNN), and the
Triton kernels (``commit.py``, ``preview.py``, ``fused.py``, ``rms.py``, ``split_kv.py``; shared device
functions in ``common.py``). Every op is one entry of the table in ``ops.py`` (name, torch
reference, Triton implementation, its calls at any model's sizes, ``shapes.py``); calling it
(``ops.rms_norm(x, w)``) dispatches between the two (``dispatch.py``). ``dense.py``: the CPU GEMMs.

Nothing is re-exported here: import a name from the module that defines it.
"""
