"""The default model: the installed trained target, else the random tiny preset with one warning."""

from __future__ import annotations

import logging

import pytest

from deltaserve.config.engine_config import EngineConfig
from deltaserve.engine.processor import ModelInfo
from deltaserve.model_files import default_model as trained
from deltaserve.model_files.embedded import embedded_model_dir


@pytest.fixture
def fresh_warning(monkeypatch):
    monkeypatch.setattr(trained, "_warned", False)


def test_no_weights_falls_back_to_random_tiny_with_one_warning(tmp_path, monkeypatch, fresh_warning, caplog):
    monkeypatch.setenv(trained.TRAINED_DIR_ENV, str(tmp_path))
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("{}")  # a config without weights is not installed
    assert trained.installed_trained_dir("target") is None
    with caplog.at_level(logging.WARNING, logger=trained.__name__):
        assert trained.default_model_dir() == embedded_model_dir()
        assert trained.default_model_dir() == embedded_model_dir()
    warnings = [r for r in caplog.records if r.name == trained.__name__]
    assert len(warnings) == 1 and "random tiny preset" in warnings[0].getMessage()
    assert str(tmp_path / "target") in warnings[0].getMessage()
    info = ModelInfo.load(EngineConfig())
    assert info.model_dir == embedded_model_dir() and info.model_config.vocab_size == 512


def test_installed_weights_are_the_default(tmp_path, monkeypatch, fresh_warning):
    from deltaserve.model_files.make_model import make_model

    make_model("tiny", str(tmp_path / "target"), seed=5)  # stands in for the trained export
    monkeypatch.setenv(trained.TRAINED_DIR_ENV, str(tmp_path))
    assert trained.default_model_dir() == str(tmp_path / "target")
    assert ModelInfo.load(EngineConfig()).model_dir == str(tmp_path / "target")
    assert ModelInfo.load(EngineConfig(model="random:tiny")).model_dir == "random:tiny"  # still reachable
    assert trained.reference_path() == str(tmp_path / "reference.json")


def test_the_package_directory_is_the_default_root(monkeypatch):
    monkeypatch.delenv(trained.TRAINED_DIR_ENV, raising=False)
    assert trained.trained_path("draft") == f"{trained.PACKAGE_TRAINED_DIR}/draft"
    with pytest.raises(ValueError, match="role='nope'"):
        trained.trained_path("nope")
