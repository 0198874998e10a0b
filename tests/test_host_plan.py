"""The host-skipping ``sdpa`` executor's one host read, packed by the layer step (:func:`pack_host_plan`): the same
plan as the executor packs itself, asked for only where the executor reads one."""

from __future__ import annotations

import pytest
import torch

import qada.attention  # noqa: F401  (registers every executor)
from qada.attention.sdpa import HostPlan, pack_host_plan
from qada.models import build_run
from qada.models.layer_step import layer_step
from qada.step import DecodeStep
from qada.window import Window

WINDOW = Window(8, 2)


def buffer_step(seed: int, buffered: bool, starts: bool) -> DecodeStep:
    g = torch.Generator().manual_seed(seed)
    b, H_kv, G, C, d = 3, 2, 2, 40, 8
    end = torch.tensor([40, 31, 12]) if buffered else None
    start = torch.tensor([0, 5, 2]) if buffered and starts else None
    return DecodeStep(torch.randn(b, H_kv * G, d, generator=g), torch.randn(b, H_kv, C, d, generator=g), d**-0.5,
                      WINDOW, start=start, end=end, values=torch.randn(b, H_kv, C, d, generator=g))


@pytest.mark.parametrize("buffered, starts", [(False, False), (True, False), (True, True)])
def test_the_plan_read_from_the_packed_vector_equals_the_plan_packed_by_the_executor(buffered, starts):
    step = buffer_step(0, buffered, starts)
    local = torch.rand(3, 4, generator=torch.Generator().manual_seed(1)) < 0.5
    read = ~local.view(3, 2, 2).all(-1)
    own = HostPlan.read(step, local, read)
    shared = buffer_step(0, buffered, starts)
    packed = pack_host_plan(local, read, shared.start, shared.end)
    assert packed.dtype == torch.int64 and packed.shape == (6 + 12 + (3 if buffered else 0) + (3 if starts else 0),)
    shared.share(window_keys=None, window_valid=None, window_values=None, t_bulk=None, real=None, host_plan=packed)
    assert shared.host_plan is packed
    assert HostPlan.read(shared, local, read) == own
    if buffered:
        assert own.reach == 40 and not own.unmasked


@pytest.mark.parametrize("executor, asks", [("sdpa", None), ({"name": "sdpa", "host_skip": True}, True),
                                            ({"name": "sdpa", "host_skip": False}, False), ("flex", False),
                                            ("reference", False)])
def test_the_layer_step_packs_the_plan_only_where_the_executor_reads_one(executor, asks):
    run = build_run(criterion={"name": "oracle", "tau": 0.5}, executor=executor, compile=False)
    assert run.layer_step._bound["host_plan"] is asks
    step = buffer_step(2, True, True)
    result = layer_step(step.query[:, :, None], step.keys, step.values, step.start, step.end, step.scale,
                        torch.tensor(0), None, {}, criterion=run.criterion, moments=None, window=WINDOW,
                        policy="exact", host_plan=asks)
    if asks is False:  # (None: on the CPU, where this step is)
        assert result.host_plan is None
    else:
        assert torch.equal(result.host_plan, pack_host_plan(result.local, result.read, step.start, step.end))


def test_the_read_lean_settings_are_what_the_ruler_tables_ran():
    """``READ_LEAN`` is the ``/lean-floor`` setting of the RULER tables (``results/criteria/run.py``: ``/lean`` with
    sizes never shrunk below 8k), and it builds both tail-aware criteria."""
    import importlib.util
    from pathlib import Path

    from qada.criteria import CRITERIA, READ_LEAN

    path = Path(__file__).resolve().parent.parent / "results" / "criteria" / "run.py"
    spec = importlib.util.spec_from_file_location("criteria_run", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert READ_LEAN == module.LEAN_FLOOR
    for criterion in ({"name": "qada_tail", "tau": 0.3}, {"name": "qada_tail_budget", "sparsity": 0.85}):
        built = CRITERIA.build({**criterion, "attend_exact": True, **READ_LEAN})
        assert built.super_page == 16 and not built.shrink_exact
