"""Every private Keras/keras-hub touchpoint exists in the installed versions,
and no other module of the package reaches into `keras.src`/`keras_hub.src`."""

import pathlib
import re

from keras_hub_autodist import compat

PACKAGE = pathlib.Path(compat.__file__).parent


def test_every_touchpoint_exists_in_the_installed_keras_and_keras_hub():
    assert compat.check_touchpoints() == []


def test_a_missing_touchpoint_is_named():
    original = compat.TOUCHPOINTS
    try:
        compat.TOUCHPOINTS = original + (("keras.src.saving.saving_lib", "Nope"),)
        assert compat.check_touchpoints() == [
            "keras.src.saving.saving_lib.Nope: no such attribute"
        ]
    finally:
        compat.TOUCHPOINTS = original


def test_only_compat_imports_private_modules():
    private = re.compile(r"^\s*(from|import)\s+(keras|keras_hub)\.src\b", re.M)
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if path.name != "compat.py" and private.search(path.read_text())
    ]
    assert offenders == []
