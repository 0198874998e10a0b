from dataclasses import dataclass

import pytest
import torch

from qada import load_config
from qada.criteria import CRITERIA, HeadCriterion, OracleCriterion, register_criterion


def test_unknown_name_lists_the_choices():
    with pytest.raises(ValueError, match=r"unknown criterion 'qdaa'; expected one of \[.*'oracle'.*'qada'"):
        CRITERIA.build("qdaa")


def test_unknown_parameter_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['tua'\]; expected some of \['tau'\]"):
        CRITERIA.build("qada", tua=0.5)


@pytest.mark.parametrize("tau", [-0.01, 1.01])
def test_bad_tau_from_a_config(tau):
    with pytest.raises(ValueError, match=r"expected tau in \[0, 1\]"):
        CRITERIA.build({"name": "oracle", "tau": tau})


def test_config_without_name():
    with pytest.raises(ValueError, match="with a 'name' key"):
        CRITERIA.build({"tau": 0.5})


def test_instances_pass_through_and_reject_extra_params():
    oracle = OracleCriterion(0.3)
    assert CRITERIA.build(oracle) is oracle
    with pytest.raises(ValueError, match="together with a built criterion"):
        CRITERIA.build(oracle, tau=0.2)


def test_register_guards_against_silent_override():
    @register_criterion("test_always_local")
    @dataclass
    class AlwaysLocal(HeadCriterion):
        def decide(self, ctx):
            return torch.ones(ctx.batch_size, ctx.num_heads, dtype=torch.bool)

    try:
        with pytest.raises(ValueError, match="already registered"):

            @register_criterion("test_always_local")
            @dataclass
            class Other(HeadCriterion):
                def decide(self, ctx):
                    raise NotImplementedError

        @register_criterion("test_always_local", override=True)
        @dataclass
        class Replacement(AlwaysLocal):
            pass

        assert CRITERIA.get("test_always_local") is Replacement
        with pytest.raises(TypeError, match="subclass of HeadCriterion"):
            register_criterion("test_not_a_criterion")(int)
    finally:
        CRITERIA._classes.pop("test_always_local", None)


def test_yaml_config(tmp_path):
    path = tmp_path / "criterion.yaml"
    path.write_text("name: layer_override\nbase: {name: qada, tau: 0.7}\noverrides:\n  0: dense\n")
    criterion = CRITERIA.build(load_config(path))
    assert criterion.base.tau == 0.7 and 0 in criterion.overrides
    assert CRITERIA.build(load_config("{name: oracle, tau: 0.2}")).tau == 0.2
    with pytest.raises(ValueError, match="YAML mapping"):
        load_config("- a\n- b\n")


def test_import_modules_imports_and_names_a_missing_module(tmp_path, monkeypatch):
    from qada.registry import import_modules

    (tmp_path / "qada_test_import_me.py").write_text("IMPORTED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import_modules(["qada_test_import_me"])
    import sys

    assert sys.modules["qada_test_import_me"].IMPORTED
    sys.modules.pop("qada_test_import_me")
    with pytest.raises(ValueError, match=r"could not import module 'no_such_qada_module' given by --import/imports: "):
        import_modules(["json", "no_such_qada_module"])


def test_load_config_imports_then_drops_the_key(tmp_path, monkeypatch):
    import sys

    (tmp_path / "qada_test_config_module.py").write_text(
        "from dataclasses import dataclass\n"
        "import torch\n"
        "from qada.criteria import HeadCriterion, register_criterion\n"
        "@register_criterion('test_from_config_import')\n"
        "@dataclass\n"
        "class FromConfig(HeadCriterion):\n"
        "    def decide(self, ctx):\n"
        "        return torch.ones(ctx.batch_size, ctx.num_heads, dtype=torch.bool)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = tmp_path / "run.yaml"
    config.write_text("imports: qada_test_config_module\ncriterion: test_from_config_import\n")
    try:
        loaded = load_config(config)
        assert loaded == {"criterion": "test_from_config_import"}
        assert CRITERIA.build(loaded["criterion"]).registry_name == "test_from_config_import"
        assert load_config({"imports": ["json"], "criterion": "qada"}) == {"criterion": "qada"}
        assert load_config('{"imports": [], "executor": "sdpa"}') == {"executor": "sdpa"}
        with pytest.raises(ValueError, match="expected 'imports' to be a module name or a list"):
            load_config("imports: {a: 1}")
        with pytest.raises(ValueError, match="could not import module 'no_such_qada_module'"):
            load_config("imports: [no_such_qada_module]\ncriterion: qada")
    finally:
        CRITERIA._classes.pop("test_from_config_import", None)
        sys.modules.pop("qada_test_config_module", None)


def test_apply_config_with_imports(tmp_path, monkeypatch):
    """``qada.apply(config=...)`` goes through load_config, so ``imports:`` works from Python too."""
    import sys

    from qada.models.apply import build_run

    (tmp_path / "qada_test_apply_module.py").write_text(
        "from dataclasses import dataclass\n"
        "from qada.criteria import LocalCriterion, register_criterion\n"
        "register_criterion('test_from_apply_import')(dataclass(type('FromApply', (LocalCriterion,), {})))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        run = build_run(config="imports: [qada_test_apply_module]\ncriterion: test_from_apply_import\nmoments: none\n")
        assert run.criterion.registry_name == "test_from_apply_import"
    finally:
        CRITERIA._classes.pop("test_from_apply_import", None)
        sys.modules.pop("qada_test_apply_module", None)
