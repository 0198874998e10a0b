import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# Triton kernels run in the interpreter on machines without a GPU; the variable must be set before triton is
# imported anywhere in the process (torch.compile and the triton tests both import it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The run compiles its layer step by default (seconds per configuration with inductor). Most tests decode many
# configurations on tiny models, where that would dominate: they run the same step eagerly, and the tests of the
# compiled step (tests/test_layer_step.py and friends) ask for compiling explicitly.
os.environ.setdefault("QADA_COMPILE", "0")

if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter without its repeated patching (same results)
    from qada.attention.interpreter import skip_repeated_patching

    skip_repeated_patching()

settings.register_profile(
    "qada",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("qada")



def threads_per_worker() -> int:
    """The torch threads of one test process: at most 2, the cores shared among pytest-xdist's workers (``-n``), so
    that the workers together use no more threads than there are cores."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, min(2, os.cpu_count() or 1) // max(1, workers))


torch.set_num_threads(threads_per_worker())


def pytest_addoption(parser):
    parser.addoption("--program-order", default=None, choices=["natural", "reversed", "shuffled", "interleaved"],
                     help="run every Triton launch of every test with its programs in this order (Triton's "
                          "interpreter only; qada.attention.interpreter.program_order, seeded by the test's id)")


@pytest.fixture(autouse=True)
def _program_order(request):
    """With ``--program-order``: the test runs inside :func:`qada.attention.interpreter.program_order` (not a module
    with ``OWN_PROGRAM_ORDER``: its tests set the order themselves, or instrument the programs)."""
    order = request.config.getoption("--program-order")
    own = getattr(request.module, "OWN_PROGRAM_ORDER", False)
    if order is None or os.environ.get("TRITON_INTERPRET") != "1" or own:
        yield
        return
    import zlib

    from qada.attention.interpreter import program_order

    with program_order(order, seed=zlib.crc32(request.node.nodeid.encode())):
        yield


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    if not torch.cuda.is_available():
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """``(path, tokenizer)``: a tiny random Llama saved with the embedded model's tokenizer (for CLI tests)."""
    from transformers import AutoTokenizer

    from qada.models.loading import model_directory
    from tests.tiny_models import tiny_model

    tokenizer = AutoTokenizer.from_pretrained(model_directory(None))
    path = tmp_path_factory.mktemp("tiny")
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, tokenizer
