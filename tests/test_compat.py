"""Every TensorFlow/Keras internal tf_distrib relies on is there, or fails loudly."""

import types

import pytest

from tf_distrib import _compat


def test_every_internal_is_present_in_the_installed_versions():
    assert _compat.check() == []


def test_a_missing_internal_names_the_version_and_the_feature():
    fake = types.SimpleNamespace(__name__="keras.src.somewhere")
    with pytest.raises(_compat.CompatibilityError) as error:
        _compat._require(fake, "_gone", "gradient accumulation", "keras")
    message = str(error.value)
    assert "gradient accumulation needs keras.src.somewhere._gone" in message
    assert "keras 3.15" in message and "tested with TensorFlow 2.21" in message


def test_patches_replace_once():
    owner = types.SimpleNamespace(method=lambda: "original")
    wrap = lambda original: lambda: f"wrapped {original()}"  # noqa: E731
    _compat._patch(owner, "method", wrap, "a feature", "tensorflow")
    _compat._patch(owner, "method", wrap, "a feature", "tensorflow")
    assert owner.method() == "wrapped original"
