"""Issue 15: the bad-input suite covers at least 66 kinds, each named once over all ``test_bad_inputs_*`` tables.

A module's ``CASES`` (:class:`tests.bad_inputs.Case`) and ``CLI_CASES`` (:class:`tests.bad_inputs.CliCase`) are
table rows; ``OTHER_KINDS`` maps a kind that needs its own test (a fault, two processes) to that test's name.
"""

import importlib
import pkgutil

import tests


def all_kinds() -> list[str]:
    kinds = []
    for module in pkgutil.iter_modules(tests.__path__):
        if module.name.startswith("test_bad_inputs_") and module.name != "test_bad_inputs_count":
            loaded = importlib.import_module(f"tests.{module.name}")
            kinds += [case.kind for case in getattr(loaded, "CASES", [])]
            kinds += [case.kind for case in getattr(loaded, "CLI_CASES", [])]
            for kind, test_name in getattr(loaded, "OTHER_KINDS", {}).items():
                assert callable(getattr(loaded, test_name, None)), f"{module.name}: no test {test_name} for {kind}"
                kinds.append(kind)
    return kinds


def test_at_least_66_kinds_each_named_once():
    kinds = all_kinds()
    duplicates = sorted({k for k in kinds if kinds.count(k) > 1})
    assert not duplicates, f"kinds named twice: {duplicates}"
    assert len(kinds) >= 66, f"only {len(kinds)} kinds of bad input are covered"
