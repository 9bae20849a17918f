"""vLLM's own OpenAI-server tests that apply to any OpenAI-compatible server, run against
``clover-lab serve`` (the embedded model) with only their launcher replaced (``launcher.py``).

Their code is theirs (Apache-2.0) and is not committed here: the script reads it from a vLLM checkout
(``--vllm DIR``, or ``$VLLM_SRC``), else fetches vLLM's tests (a shallow sparse ``git clone`` of
github.com/vllm-project/vllm into ``~/.cache/clover-lab/vllm``); where neither can be had it says so
and exits 0 (skipped). Each file of :data:`APPLY` is copied into a scratch folder with three kinds of
line changed, and nothing else: vLLM's ``RemoteOpenAIServer`` and ``get_tokenizer`` imports become
``launcher``'s; imports of vLLM's own package (used by the unit tests of its request classes, which
are not run) and of sibling test modules are dropped. The tests named in :data:`APPLY` run (by node id); the table of docs/serving-agents.md ("Peers' own tests") is their result, and
:data:`NOT_APPLY` says why each other test of those files does not apply.

    python tests/peers/run_vllm.py [--vllm DIR] [--only responses/] [--junit FILE]

Needs the ``peers`` extra (pytest-asyncio, requests) and ``jsonschema``, ``regex``."""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = "https://github.com/vllm-project/vllm"
ROOT = "tests/entrypoints"

# file under tests/entrypoints -> the tests of it that apply to any OpenAI-compatible server
APPLY = {
    "openai/test_tokenization.py": ["test_tokenize_completions", "test_tokenize_chat", "test_tokenize_chat_with_tools",
                                    "test_tokenize_with_return_token_strs", "test_detokenize"],
    "openai/completion/test_completion.py": ["test_no_logprobs", "test_zero_logprobs", "test_some_logprobs",
                                             "test_too_many_completion_logprobs", "test_echo_logprob_completion",
                                             "test_invalid_json_schema", "test_invalid_regex", "test_invalid_grammar"],
    "openai/chat_completion/test_chat.py": [
        "test_no_logprobs_chat", "test_zero_logprobs_chat", "test_some_logprobs_chat", "test_too_many_chat_logprobs",
        "test_structured_outputs_choice_chat", "test_structured_outputs_json_chat",
        "test_structured_outputs_regex_chat", "test_structured_outputs_type_error",
        "test_structured_outputs_choice_chat_logprobs", "test_response_format_text",
        "test_chat_completion_n_parameter_non_streaming", "test_chat_completion_n_parameter_streaming",
        "test_chat_completion_n_with_seed", "test_chat_completion_n_equals_1"],
    "openai/basic/test_basic.py": ["test_check_health", "test_request_wrong_content_type"],
    "openai/responses/test_basic.py": ["test_chat_with_input_type", "test_logprobs", "test_streaming"],
    "openai/responses/test_function_call.py": ["test_max_tokens_with_tool_choice_required", "test_named_tool_use",
                                               "test_function_calling_with_streaming_types"],
}
# the other tests of those files, and why they do not apply to any OpenAI-compatible server
NOT_APPLY = {
    "test_tokenizer_info_*": "vLLM's own /tokenizer_info route (behind its --enable-tokenizer-info-endpoint)",
    "test_show_version": "compares /version to vLLM's version number (the route is served: {\"version\": ...})",
    "test_server_load": "vLLM's /load route (--enable-server-load-tracking)",
    "test_health_check_engine_dead_error": "a unit test of vLLM's health handler",
    "test_request_cancellation": "asks for 10,000 tokens of a model with 10,100 positions (--max-model-len); the "
                                 "embedded model has 4,096",
    "test_single_completion, test_single_chat_session": "count opt-125m's and zephyr's prompt tokens (6, 37)",
    "test_completion_truncation_side_controls_prompt_truncation": "vLLM's truncate_prompt_tokens, truncation_side",
    "test_prompt_logprobs_*": "vLLM's prompt_logprobs field",
    "test_completion_streaming, test_chat_streaming": "expect the finish reason in the chunk with the last text; "
                                                      "OpenAI's API (and this server) may send it in a chunk of its own",
    "test_parallel_*": "expect 50-token samples to end at different lengths (a model that stops early)",
    "test_*_stream_options": "vLLM's continuous_usage_stats and min_characters",
    "test_batch_completions": "vLLM's use_beam_search",
    "test_response_format_json_object, test_response_format_json_schema, test_complex_message_content":
        "check zephyr's answer ({\"result\": 2}, \"2\")",
    "test_extra_fields_allowed, test_custom_role": "vLLM accepts unknown message fields and roles; OpenAI's API and "
                                                   "this server refuse them (a 400 naming the field)",
    "test_long_seed": "reads pydantic's error type names in vLLM's message",
    "test_invocations": "vLLM's SageMaker /invocations route",
    "test_chat_completion_request_n_parameter_*": "unit tests of vLLM's request classes",
    "test_simple_input, test_instructions, test_chat (responses)": "check a reasoning model's answers (312, QED, "
                                                                   "a reasoning item)",
    "test_function_tool_use, test_function_calling_with_streaming_expected_arguments":
        "a reasoning model's reasoning item, or its choice to call under tool_choice auto",
}
# the server fixtures vLLM's responses/ tests take from a conftest of their own (which starts vLLM):
# the launcher's, under the name the module serves (a module's own fixtures override these)
FIXTURES = """

import pytest_asyncio as _pytest_asyncio


@pytest.fixture(scope="module")
def server(request):
    from launcher import RemoteOpenAIServer

    with RemoteOpenAIServer(getattr(request.module, "MODEL_NAME", "clover-stdlib")) as remote:
        yield remote


@_pytest_asyncio.fixture
async def client(server):
    async with server.get_async_client() as c:
        yield c
"""


def vllm_tests(given: str | None) -> Path | None:
    """The folder holding vLLM's tests/entrypoints: given, or fetched (None where it cannot be had)."""
    if given:
        root = Path(given)
        return root if (root / ROOT).is_dir() else None
    cache = Path.home() / ".cache" / "clover-lab" / "vllm"
    if not (cache / ROOT).is_dir():
        shutil.rmtree(cache, ignore_errors=True)
        try:
            subprocess.run(["git", "clone", "--depth", "1", "--filter=blob:none", "--sparse", REPO, str(cache)],
                           check=True, timeout=300, capture_output=True)
            subprocess.run(["git", "-C", str(cache), "sparse-checkout", "set", ROOT], check=True, timeout=300,
                           capture_output=True)
        except (OSError, subprocess.SubprocessError) as e:
            print(f"skipped: vLLM's tests could not be fetched ({type(e).__name__}); give a checkout with --vllm DIR")
            return None
    return cache


LAUNCHER = re.compile(r"^from (tests|\.+)\.?utils import RemoteOpenAIServer\s*$", re.M)
TOKENIZER = re.compile(r"^from vllm\.(tokenizers|transformers_utils\.tokenizer) import get_tokenizer\s*$", re.M)
VLLM = re.compile(r"^(from vllm[\w.]* import \([^)]*\)|from vllm[\w.]* import .*|import vllm.*|from \.\S* import .*)$",
                  re.M)


def copy(source: Path, target: Path) -> None:
    """``source`` with its launcher replaced (and vLLM's own imports dropped) as ``target``."""
    text = source.read_text()
    text = LAUNCHER.sub("from launcher import RemoteOpenAIServer", text)
    text = TOKENIZER.sub("from launcher import get_tokenizer", text)
    text = VLLM.sub("", text)
    target.write_text(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm", default=os.environ.get("VLLM_SRC"), help="a vLLM checkout (its tests/entrypoints)")
    ap.add_argument("--junit", help="write pytest's JUnit XML here too")
    ap.add_argument("--only", default="", help="run the files of APPLY whose path holds this text")
    args = ap.parse_args(argv)
    src = vllm_tests(args.vllm)
    if src is None:
        if args.vllm:
            print(f"skipped: {args.vllm} holds no {ROOT}")
        return 0
    commit = subprocess.run(["git", "-C", str(src), "rev-parse", "--short=8", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "?"
    with tempfile.TemporaryDirectory(prefix="clover-vllm-tests-") as scratch:
        scratch, selected = Path(scratch), []
        conftest = src / ROOT / "conftest.py"  # its sample schemas, regexes and choices
        if conftest.is_file():
            copy(conftest, scratch / "conftest.py")
        else:
            (scratch / "conftest.py").write_text("import pytest\n")
        with open(scratch / "conftest.py", "a") as f:
            f.write(FIXTURES)
        for rel, tests in APPLY.items():
            if args.only not in rel:
                continue
            path = src / ROOT / rel
            if not path.is_file():
                print(f"skipped {rel}: not in this checkout of vLLM ({commit})")
                continue
            target = scratch / ("vllm_" + rel.replace("/", "_"))
            copy(path, target)
            text = target.read_text()
            for name in tests:  # by node id: a -k substring would pick up tests that do not apply
                if re.search(rf"^(async )?def {name}\(", text, re.M):
                    selected.append(f"{target}::{name}")
                else:
                    print(f"skipped {rel}::{name}: not in this checkout of vLLM ({commit})")
        junit = scratch / "junit.xml"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
        subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rN", "-o", "addopts=",
                        "--rootdir", str(scratch), f"--junitxml={junit}", *selected], env=env, cwd=scratch)
        if args.junit:
            shutil.copy(junit, args.junit)
        print(f"\nvLLM {commit}: test | result")
        for case in ET.parse(junit).getroot().iter("testcase"):
            failed = case.find("failure") if case.find("failure") is not None else case.find("error")
            skipped = case.find("skipped")
            result = "pass" if failed is None and skipped is None else "skip" if failed is None else \
                "FAIL: " + (failed.get("message") or "").splitlines()[0][:150] if failed.get("message") else "FAIL"
            print(f"{case.get('classname').split('.')[-1]}::{case.get('name')} | {result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
