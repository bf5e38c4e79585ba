"""The packages that import parts on first use (headwater, headwater.client,
headwater.engine.kinds) through headwater._lazy.lazy_getattr."""

from __future__ import annotations

import subprocess
import sys
from types import ModuleType

import pytest

import headwater
import headwater.client
import headwater.engine.kinds


def test_a_lazy_name_is_the_submodule_object_and_kept_in_the_package() -> None:
    from headwater.client.producer import Producer
    from headwater.engine.kinds.service import KindsEngine

    assert headwater.Producer is Producer
    assert headwater.client.Producer is Producer
    assert headwater.engine.kinds.KindsEngine is KindsEngine
    assert vars(headwater)["Producer"] is Producer  # later lookups skip __getattr__
    assert vars(headwater.engine.kinds)["KindsEngine"] is KindsEngine


@pytest.mark.parametrize("package", [headwater, headwater.client, headwater.engine.kinds])
def test_an_unknown_name_is_an_attribute_error_naming_the_package(package: ModuleType) -> None:
    with pytest.raises(AttributeError, match=rf"module '{package.__name__}' has no attribute 'x'"):
        package.x  # noqa: B018 (the lookup is what is tested)
    assert not hasattr(package, "x")


def test_kinds_engine_loads_only_when_asked_for() -> None:
    probe = (
        "import sys, headwater.engine.kinds as k; "
        "assert 'headwater.engine.kinds.service' not in sys.modules; "
        "k.KindsEngine; assert 'headwater.engine.kinds.service' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", probe], check=True)
