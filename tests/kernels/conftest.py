"""Kernel tests run the Triton kernels against their torch references.

Without CUDA they run in Triton's interpreter on CPU tensors. ``TRITON_INTERPRET`` is read
when triton is first imported (its standard library is decorated then) and when a kernel is
decorated, so it is set here, at conftest import. In a plain ``pytest`` run this directory is
collected before the other test modules, so that comes first. It changes nothing for code
that does not run Triton on CPU tensors (the dispatch still sends CPU tensors to the torch
references unless the Triton backend is forced: ``dispatch.use_backend("triton")``). If triton was already imported without the
interpreter (another module imported it first, e.g. through torch._dynamo), the kernels
cannot run on CPU in this process and these tests skip, saying so.
"""
import os
import sys

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
INTERPRETER_UNAVAILABLE = None
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton.language" in sys.modules:
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(sys.modules["triton.language"].sum, InterpretedFunction):
            INTERPRETER_UNAVAILABLE = (
                "triton was imported before tests/kernels/conftest.py could set TRITON_INTERPRET=1: "
                "run tests/kernels first, in its own process, or with TRITON_INTERPRET=1 exported")

DEVICE = "cuda" if ON_CUDA else "cpu"
# the interpreter's bf16 tl.dot is wrong: bf16 runs only on CUDA
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])

TOLERANCES = {
    # (atol, rtol) on outputs of magnitude ~1
    torch.float32: (2e-4, 1e-4),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (5e-2, 3e-2),
}


def assert_close(actual, expected, dtype, scale=1.0, what=""):
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol * scale, rtol=rtol,
                               msg=lambda m: f"{what}: {m}")


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(autouse=True)
def _no_forced_backend(monkeypatch):
    if INTERPRETER_UNAVAILABLE:
        pytest.skip(INTERPRETER_UNAVAILABLE)
    # a CLOVER_KERNELS from the caller's shell (the dispatch's default, read at import) must not
    # change what these tests compare; a test forces a path with dispatch.use_backend
    from clover_kernels import dispatch

    with dispatch.use_backend(None):
        yield


def pytest_generate_tests(metafunc):
    if "dtype" in metafunc.fixturenames:
        metafunc.parametrize("dtype", DTYPES, ids=[str(d).removeprefix("torch.") for d in DTYPES])


@pytest.fixture
def close():
    return assert_close
