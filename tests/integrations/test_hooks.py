"""integrations.hooks: a callback runs when a watched module finishes loading (or at once when it is loaded), with
no early import; versions are read from package metadata."""

from __future__ import annotations

import sys

from ppo_critic.integrations.hooks import after_import, installed_version


def test_a_callback_runs_after_the_module_loads_and_not_before(tmp_path, monkeypatch):
    package = tmp_path / "hookprobe"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "engines.py").write_text("REGISTRY = {'fsdp': 1}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    after_import("hookprobe.engines", lambda module: seen.append(dict(module.REGISTRY)))
    assert seen == [] and "hookprobe.engines" not in sys.modules  # nothing imported early
    import hookprobe.engines

    assert seen == [{"fsdp": 1}]  # after the module's own code ran
    assert hookprobe.engines.__loader__.get_source("hookprobe.engines") == "REGISTRY = {'fsdp': 1}\n"
    after_import("hookprobe.engines", lambda module: seen.append("already loaded"))
    assert seen[-1] == "already loaded"
    for name in ("hookprobe.engines", "hookprobe"):
        sys.modules.pop(name)


def test_installed_version_reads_metadata():
    assert installed_version("torch").startswith("2.")
    assert installed_version("surely-not-installed-ppo-critic-probe") is None
