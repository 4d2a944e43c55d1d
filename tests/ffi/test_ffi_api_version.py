"""The XLA FFI API version the library was built against, and what a library
built against another jaxlib gets when XLA would refuse its handlers."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jaxlib
import pytest

from jaxfog import JaxfogError, ffi

pytestmark = pytest.mark.jax_internals


def test_the_library_and_this_jaxlib_agree():
    built, running = ffi.ffi_api_version(), ffi.jaxlib_ffi_api_version()
    header = (Path(jax.ffi.include_dir()) / "xla/ffi/api/c_api.h").read_text()
    assert running == (int(re.search(r"XLA_FFI_API_MAJOR (\d+)", header).group(1)),
                       int(re.search(r"XLA_FFI_API_MINOR (\d+)", header).group(1)))
    # Built against this jaxlib (--no-build-isolation) or, by pip's isolated
    # build, against the oldest jaxlib of the window: an API this one accepts.
    assert built[0] == running[0] and built[1] <= running[1], (built, running)
    if ffi.build_info()["jaxlib"] == jaxlib.__version__:
        assert built == running
    ffi.check_ffi_api_version(built, running, jaxlib.__version__)  # nothing to raise


@pytest.mark.parametrize("built, running", [((0, 3), (0, 5)), ((0, 5), (0, 5))])
def test_an_older_minor_version_is_accepted(built, running):
    # What XLA does too: jaxlib 0.12 (API 0.5) runs a library built against 0.10's (0.3).
    ffi.check_ffi_api_version(built, running, "0.10.2")
    ffi.check_ffi_api_version(built, None, "0.10.2")  # headers unreadable: XLA decides


@pytest.mark.parametrize("built, running", [((0, 5), (0, 3)), ((1, 0), (0, 5)), ((0, 5), (1, 5))])
def test_a_newer_minor_or_another_major_version_is_a_clear_error(built, running):
    with pytest.raises(ffi.FfiLibraryError) as caught:
        ffi.check_ffi_api_version(built, running, "0.12.0.1")
    message = str(caught.value)
    assert isinstance(caught.value, JaxfogError)
    assert "built against jaxlib 0.12.0.1 (XLA FFI API %d.%d)" % built in message
    assert f"this is jaxlib {jaxlib.__version__} (XLA FFI API %d.%d)" % running in message
    assert "rebuild jaxfog against this jaxlib, in this environment" in message
    assert "pip install --no-build-isolation" in message


def test_a_registration_xla_refuses_is_a_clear_error(monkeypatch):
    # XLA's own check also has a minimum version, which it does not publish.
    refusal = ("INVALID_ARGUMENT: XLA FFI handler registration for jaxfog_rank on platform "
               "Host (canonical host) failed because the handler's API version (0.0) is "
               "incompatible with the framework's API version (0.5). Minimum supported API "
               "version is (0.1).")

    def register_ffi_target(*args, **kwargs):
        raise RuntimeError(refusal)

    monkeypatch.setattr(jax.ffi, "register_ffi_target", register_ffi_target)
    with pytest.raises(ffi.FfiLibraryError, match="rebuild jaxfog against this jaxlib") as caught:
        ffi.register_handlers.__wrapped__()
    assert refusal in str(caught.value)

    def other_failure(*args, **kwargs):
        raise RuntimeError("something else")

    monkeypatch.setattr(jax.ffi, "register_ffi_target", other_failure)
    with pytest.raises(RuntimeError, match="something else"):
        ffi.register_handlers.__wrapped__()
