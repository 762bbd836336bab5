"""Setting ``native`` (KVLOOKUP_NATIVE): validated at startup, applied by the processes that hash."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvlookup import native
from kvlookup.config import load


@pytest.mark.parametrize(("value", "mode"), [
    ("auto", "auto"), ("on", "on"), ("off", "off"), ("0", "off"), ("1", "on"), ("false", "off"), ("YES", "on"),
    ("", "auto"), (" Off ", "off")])
def test_env_values(value, mode, monkeypatch):
    monkeypatch.setattr(native, "_MODULE", native._MODULE or object())  # "on" needs it built
    assert load(None, env={"KVLOOKUP_NATIVE": value}).native == mode


@pytest.mark.parametrize(("yaml_text", "mode"), [("native: off\n", "off"), ("native: on\n", "on"),
                                                 ("native: 0\n", "off"), ("native: auto\n", "auto")])
def test_yaml_values_bare_booleans_included(tmp_path, yaml_text, mode, monkeypatch):
    monkeypatch.setattr(native, "_MODULE", native._MODULE or object())
    path = tmp_path / "kvlookup.yaml"
    path.write_text(yaml_text)
    assert load(str(path), env={}).native == mode


@pytest.mark.parametrize("value", ["maybe", "2", "native"])
def test_bad_values_name_the_setting(value):
    with pytest.raises(ValueError, match=rf"^native: '{value}' is not one of auto, on, off \(or 1/0\)$"):
        load(None, env={"KVLOOKUP_NATIVE": value})


def test_on_without_the_extension_refuses_to_start(monkeypatch):
    monkeypatch.setattr(native, "_MODULE", None)
    monkeypatch.setattr(native, "WHY_NOT", "kvlookup._native is not built (test)")
    with pytest.raises(ValueError, match=r"^native: on, but kvlookup._native is not built \(test\)"):
        load(None, env={"KVLOOKUP_NATIVE": "on"})
    assert load(None, env={"KVLOOKUP_NATIVE": "auto"}).native == "auto"  # auto: pure Python, no error
    with pytest.raises(RuntimeError, match="native: on, but"):
        native.configure("on")
    assert native.configure("auto") is None


def test_configure_off_and_auto(monkeypatch):
    monkeypatch.setattr(native, "ext", native.ext)  # restored after the test
    assert native.configure("off") is None and native.ext is None
    assert native.configure("auto") is native._MODULE


def test_env_picks_the_mode_at_import():
    code = "from kvlookup import native; print(native.ext is None, native.available())"
    for value, off in (("0", True), ("off", True), ("auto", False), ("bogus", False)):
        out = subprocess.run([sys.executable, "-c", code], env={"KVLOOKUP_NATIVE": value}, capture_output=True,
                             text=True, check=True).stdout.split()
        built = out[1] == "True"
        assert out[0] == str(off or not built), value
