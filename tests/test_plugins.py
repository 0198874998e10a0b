"""Components from outside the tree: entry points, ``--import``, ``imports:`` in configs, mappings on the CLI.

``tests/plugins/qada_topk_plugin`` is a tiny installable package declaring ``[project.entry-points."qada.criteria"]``;
it is installed with pip into a temporary folder (offline, no build isolation) and used from fresh processes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import torch

from qada.cli import main
from qada.criteria import (
    CRITERIA,
    AnyOf,
    DenseCriterion,
    LayerOverride,
    LocalCriterion,
    Not,
    OracleCriterion,
    QAdACriterion,
)
from qada.registry import PluginError, Registry

MODULE_REGISTRY: list[Registry] = []  # the registry a fake plugin module registers into
REPO = Path(__file__).resolve().parent.parent
PLUGIN = REPO / "tests" / "plugins" / "qada_topk_plugin"

# layer 0: QAdA or a static mask; layer 1: local exactly where the oracle says dense (not(oracle))
COMPOSED_YAML = (
    "{name: layer_override, base: {name: any_of, criteria: [{name: qada, tau: 0.4}, "
    "{name: static, mask: [[true, false, false, false], [false, false, false, false]]}]}, "
    "overrides: {1: {name: not, criterion: {name: oracle, tau: 0.5}}}}"
)




@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    """The plugin installed (offline) into a folder of its own, to put on PYTHONPATH."""
    root = tmp_path_factory.mktemp("plugin")
    source = root / "src"
    shutil.copytree(PLUGIN, source)  # build in a copy: no build/ or egg-info in the repository
    site = root / "site"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "--quiet",
         "--disable-pip-version-check", "--target", str(site), str(source)],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr
    assert (site / "qada_topk.py").exists()
    return site


def _env(*paths: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), str(REPO)])  # REPO: the qada under test
    return env


def _qada(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qada", *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=300)


@pytest.fixture
def scratch_criteria():
    """Forget criteria a test registers in this process."""
    before = dict(CRITERIA._classes)
    yield
    CRITERIA._classes.clear()
    CRITERIA._classes.update(before)


def _write_module(folder: Path, module: str, criterion: str) -> None:
    (folder / f"{module}.py").write_text(textwrap.dedent(f'''
        from dataclasses import dataclass

        import torch

        from qada.criteria import HeadCriterion, register_criterion


        @register_criterion("{criterion}")
        @dataclass
        class FirstHeadLocal(HeadCriterion):
            """Head 0 local, the others dense."""

            def decide(self, ctx):
                local = torch.zeros(ctx.batch_size, ctx.num_heads, dtype=torch.bool)
                local[:, 0] = True
                return local
    '''))


# --- installed plugins, fresh processes ---------------------------------------------------------------------


def test_an_installed_plugin_is_listed_without_import(plugin_site, tmp_path):
    result = _qada(["criteria"], _env(plugin_site), tmp_path)
    assert result.returncode == 0, result.stderr
    assert "topk" in result.stdout and "(k: int = 4)" in result.stdout


def test_import_flag_lists_a_module_without_entry_point(tmp_path):
    _write_module(tmp_path, "my_first_head", "first_head")
    listed = _qada(["criteria", "--import", "my_first_head"], _env(tmp_path), tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert "first_head" in listed.stdout and "needs: nothing" in listed.stdout
    assert "first_head" not in _qada(["criteria"], _env(tmp_path), tmp_path).stdout  # not installed: needs --import


def test_eval_with_an_installed_plugin_and_config_imports(plugin_site, tiny_model_dir, tmp_path):
    """One fresh process: ``topk`` comes from the entry point, ``first_head`` from the config's ``imports:``."""
    path, _ = tiny_model_dir
    modules = tmp_path / "modules"
    modules.mkdir()
    _write_module(modules, "my_first_head", "first_head")
    config = tmp_path / "run.yaml"
    config.write_text("imports: [my_first_head]\n"
                      "criterion: {name: all_of, criteria: [{name: topk, k: 4}, first_head]}\n"
                      "window: {t_local: 64, t_sink: 4}\n")
    out = tmp_path / "r.json"
    result = _qada(["eval", "--config", str(config), "--task", "niah_single_2", "--length", "300", "--samples", "1",
                    "--model", str(path), "--out", str(out)], _env(plugin_site, modules), tmp_path)
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["criterion"]["name"] == "all_of" and record["window"] == {"t_local": 64, "t_sink": 4}
    assert record["moments"] is None  # neither criterion declares a need for moments
    assert record["sparsity"] == pytest.approx(0.25)  # topk with k=4 keeps all 4 heads local: head 0 only


def test_the_topk_plugin_decides_per_row(monkeypatch, scratch_criteria):
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(str(PLUGIN))
    sys.modules.pop("qada_topk", None)
    try:
        import qada_topk

        scores = torch.tensor([[[0.0, 5.0], [1.0, 0.0], [9.0, -1.0]], [[0.0, 0.0], [3.0, 3.0], [-2.0, 1.0]]])
        ctx = SimpleNamespace(local_scores=scores, batch_size=2, num_heads=3)
        local = CRITERIA.build({"name": "topk", "k": 2}).decide(ctx)
        assert local.tolist() == [[True, False, True], [False, True, True]]
        assert qada_topk.TopKCriterion(k=9).decide(ctx).all()
    finally:
        sys.modules.pop("qada_topk", None)


def test_a_missing_import_is_a_clear_error(tmp_path):
    result = _qada(["criteria", "--import", "no_such_module_for_qada"], _env(), tmp_path)
    assert result.returncode == 2
    assert "could not import module 'no_such_module_for_qada' given by --import/imports" in result.stderr
    assert "Traceback" not in result.stderr


def test_criteria_survives_a_closed_pipe(tmp_path):
    process = subprocess.Popen([sys.executable, "-m", "qada", "criteria"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=_env(), cwd=tmp_path)
    process.stdout.close()  # like `| head` that has already left
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=120) == 0
    assert "BrokenPipeError" not in stderr and "Traceback" not in stderr, stderr


@pytest.mark.slow
def test_an_installed_plugin_on_the_embedded_model(plugin_site, tmp_path):
    out = tmp_path / "topk.json"
    result = _qada(["eval", "--task", "niah_single_2", "--length", "512", "--samples", "1", "--criterion", "topk",
                    "--out", str(out)], _env(plugin_site), tmp_path)
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["criterion"] == {"name": "topk"} and record["sparsity"] == pytest.approx(4 / 9)


# --- in this process ------------------------------------------------------------------------------------


def test_import_flag_in_process(tmp_path, monkeypatch, capsys, scratch_criteria):
    _write_module(tmp_path, "my_first_head_in_process", "first_head_in_process")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["criteria", "--import", "my_first_head_in_process"]) == 0
    assert "first_head_in_process" in capsys.readouterr().out


def test_a_composed_mapping_on_the_command_line_equals_the_composition_in_python(tiny_model_dir, tmp_path):
    from qada.criteria import StaticCriterion
    from qada.eval.configs import EvalConfig
    from qada.eval.evaluator import Evaluator
    from qada.eval.tasks import TASKS
    from qada.models import load_model

    path, _ = tiny_model_dir
    out = tmp_path / "cli.json"
    assert main(["eval", "--task", "niah_single_2", "--length", "300", "--samples", "2", "--criterion", COMPOSED_YAML,
                 "--moments", "current", "--model", str(path), "--out", str(out)]) == 0
    cli = json.loads(out.read_text())

    mask = torch.zeros(2, 4, dtype=torch.bool)
    mask[0, 0] = True
    composed = LayerOverride(AnyOf([QAdACriterion(0.4), StaticCriterion(mask)]), {1: Not(OracleCriterion(0.5))})
    assert composed.needs_moments and composed.needs_full_scores
    model, tokenizer = load_model(str(path))
    samples = TASKS.build("niah_single_2").generate(tokenizer, 300, 2, 0)
    config = EvalConfig("composed", composed, "current", "sdpa", family="composed")
    python = Evaluator(model, tokenizer, [config], tmp_path / "python.parts").evaluate(samples)["composed"]

    assert CRITERIA.build(cli["criterion"]).to_config() == composed.to_config()
    assert cli["moments"] == "current"
    for key in ("score", "sparsity", "kv_sparsity"):
        assert cli[key] == python[key], key
    assert 0 < cli["sparsity"] < 1


def test_a_composed_criterion_from_a_json_file_equals_the_inline_mapping(tiny_model_dir, tmp_path):
    import yaml

    path, _ = tiny_model_dir
    spec = tmp_path / "composed.json"
    spec.write_text(json.dumps(yaml.safe_load(COMPOSED_YAML)))
    records = []
    for criterion, name in ((COMPOSED_YAML, "inline.json"), (str(spec), "file.json")):
        assert main(["eval", "--task", "niah_single_2", "--length", "300", "--samples", "1", "--criterion", criterion,
                     "--moments", "current", "--model", str(path), "--out", str(tmp_path / name)]) == 0
        records.append(json.loads((tmp_path / name).read_text()))
    inline, from_file = records
    assert CRITERIA.build(inline["criterion"]).to_config() == CRITERIA.build(from_file["criterion"]).to_config()
    for key in ("score", "sparsity", "kv_sparsity"):
        assert inline[key] == from_file[key], key


def test_tau_with_a_mapping_is_an_error(tiny_model_dir, tmp_path, capsys):
    path, _ = tiny_model_dir
    assert main(["eval", "--task", "niah_single_2", "--length", "300", "--samples", "1", "--criterion",
                 "{name: qada}", "--tau", "0.3", "--model", str(path), "--out", str(tmp_path / "r.json")]) == 2
    assert "--tau goes with a criterion name" in capsys.readouterr().err


def test_flags_override_the_config_file(tiny_model_dir, tmp_path):
    path, _ = tiny_model_dir
    config = tmp_path / "run.yaml"
    config.write_text("criterion: {name: qada, tau: 0.9}\nmoments: current\nexecutor: reference\n")
    out = tmp_path / "r.json"
    assert main(["eval", "--config", str(config), "--criterion", "local", "--task", "niah_single_2", "--length",
                 "300", "--samples", "1", "--model", str(path), "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["criterion"] == {"name": "local"} and record["moments"] is None
    assert record["executor"] == "reference" and record["sparsity"] == 1.0


def test_generate_takes_a_config_and_a_mapping(tiny_model_dir, tmp_path, capsys):
    path, _ = tiny_model_dir
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The pass key is 12345. " * 40 + "What is the pass key? The pass key is")
    config = tmp_path / "run.yaml"
    config.write_text("criterion: {name: any_of, criteria: [local, {name: qada, tau: 0.3}]}\nmoments: current\n"
                      "window: {t_local: 64, t_sink: 4}\n")
    assert main(["generate", "--prompt-file", str(prompt), "--model", str(path), "--config", str(config),
                 "--max-new-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "'name': 'any_of'" in out and "moments: current" in out and "sparsity: 1.000" in out
    assert main(["generate", "--prompt-file", str(prompt), "--model", str(path), "--config", str(config),
                 "--criterion", "{name: dense}", "--max-new-tokens", "2"]) == 0
    assert "unmodified model" in capsys.readouterr().out


# --- entry point discovery with fake entry points ----------------------------------------------------------


@dataclass
class PluginLocal(LocalCriterion):
    """A criterion class for entry points that name a class."""


@dataclass
class PluginDense(DenseCriterion):
    """Another one."""


@dataclass
class FakeDistribution:
    name: str = "fake-dist"


@dataclass
class FakeEntryPoint:
    """What the registry reads of an ``importlib.metadata.EntryPoint``: name, value, group, dist, load()."""

    name: str
    value: str
    group: str = "qada.criteria"
    dist: FakeDistribution = field(default_factory=FakeDistribution)

    def load(self):
        return EntryPoint(self.name, self.value, self.group).load()


def _entry_point(name: str, value: str) -> FakeEntryPoint:
    return FakeEntryPoint(name, value)


@pytest.fixture
def fresh_registry(monkeypatch):
    """A criterion registry of its own, with ``importlib.metadata.entry_points`` answering from a list."""
    from qada.criteria import HeadCriterion

    found: list[FakeEntryPoint] = []
    calls: list[str] = []

    def entry_points(group):
        calls.append(group)
        return [e for e in found if e.group == group]

    monkeypatch.setattr("importlib.metadata.entry_points", entry_points)
    registry = Registry("criterion", HeadCriterion)
    return registry, found, calls


def test_default_entry_point_groups():
    from qada.criteria import HeadCriterion

    assert Registry("criterion", HeadCriterion).entry_point_group == "qada.criteria"
    assert Registry("executor", HeadCriterion).entry_point_group == "qada.executors"
    assert Registry("moment source", HeadCriterion).entry_point_group == "qada.moment_sources"
    assert Registry("task", HeadCriterion).entry_point_group == "qada.tasks"
    assert Registry("criterion", HeadCriterion, entry_point_group="mine").entry_point_group == "mine"
    assert CRITERIA.entry_point_group == "qada.criteria"


def test_discovery_is_lazy_and_runs_once(fresh_registry):
    registry, found, calls = fresh_registry
    found.append(_entry_point("lazy_local", f"{__name__}:PluginLocal"))
    assert calls == []  # nothing at construction
    assert "lazy_local" in registry
    assert registry.get("lazy_local") is PluginLocal
    registry.names(), registry.build("lazy_local"), registry.parameters("lazy_local")
    assert calls == ["qada.criteria"]


@pytest.mark.parametrize("method", ["names", "get", "contains", "parameters", "build"])
def test_every_lookup_discovers(fresh_registry, method):
    registry, found, calls = fresh_registry
    found.append(_entry_point("lazy_local", f"{__name__}:PluginLocal"))
    lookup = {"names": lambda: registry.names(), "get": lambda: registry.get("lazy_local"),
              "contains": lambda: "lazy_local" in registry, "parameters": lambda: registry.parameters("lazy_local"),
              "build": lambda: registry.build("lazy_local")}[method]
    lookup()
    assert calls == ["qada.criteria"] and "lazy_local" in registry._classes


def test_a_class_that_registered_itself_is_not_registered_twice(fresh_registry):
    registry, found, _ = fresh_registry
    registry.register("already")(PluginDense)
    found.append(_entry_point("other_name", f"{__name__}:PluginDense"))
    assert registry.names() == ["already"]


def test_a_module_entry_point_registers_by_import(fresh_registry, tmp_path, monkeypatch):
    registry, found, _ = fresh_registry
    (tmp_path / "fake_plugin_module.py").write_text(
        f"import {__name__} as t\nt.MODULE_REGISTRY[0].register('from_module')(t.PluginLocal)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    MODULE_REGISTRY[:] = [registry]
    found.append(_entry_point("whatever", "fake_plugin_module"))
    try:
        assert registry.names() == ["from_module"]  # the module registered; its entry point name is not used
    finally:
        sys.modules.pop("fake_plugin_module", None)


def test_a_broken_plugin_names_the_entry_point_and_distribution(fresh_registry):
    registry, found, _ = fresh_registry
    found.append(_entry_point("broken", "no_such_plugin_module_for_qada"))
    for _ in range(2):  # not cached as discovered: the next lookup fails the same way
        with pytest.raises(PluginError, match=r"entry point broken = 'no_such_plugin_module_for_qada' "
                                              r"\(group 'qada.criteria'\) of fake-dist.*ModuleNotFoundError"):
            registry.names()


def test_a_plugin_that_is_not_a_criterion_is_an_error(fresh_registry):
    registry, found, _ = fresh_registry
    found.append(_entry_point("wrong", "qada.attention.base:AttentionExecutor"))
    with pytest.raises(PluginError, match="not a subclass of HeadCriterion"):
        registry.names()
    found[:] = [_entry_point("function", "json:dumps")]
    with pytest.raises(PluginError, match="expected a module or a subclass of HeadCriterion"):
        registry.names()


def test_a_plugin_name_clash_is_an_error(fresh_registry):
    registry, found, _ = fresh_registry
    registry.register("taken")(PluginDense)
    found.append(_entry_point("taken", f"{__name__}:PluginLocal"))
    with pytest.raises(PluginError, match="could not register .* already registered"):
        registry.names()
