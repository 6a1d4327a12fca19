"""Generates and imports the Python code for the provider protocol.

The protocol is defined once, in ``proto/provisioning/provider/v1/provider.proto``
at the root of the repository. Rather than checking generated files in, this
module runs ``grpc_tools.protoc`` on that file into a temporary directory,
imports the two generated modules and removes the directory again (once
imported, a module no longer needs its file).

Usage::

    import protos
    pb, pb_grpc = protos.load()
    stub = pb_grpc.ProviderStub(channel)
"""

from __future__ import annotations

import importlib
import importlib.resources
import sys
import tempfile
from pathlib import Path
from types import ModuleType

#: The root of the repository's proto tree (``<repo>/proto``).
PROTO_ROOT = Path(__file__).resolve().parents[2] / "proto"

#: The provider protocol, relative to :data:`PROTO_ROOT`.
PROVIDER_PROTO = "provisioning/provider/v1/provider.proto"

_PACKAGE = "provisioning.provider.v1"
_loaded: tuple[ModuleType, ModuleType] | None = None


def load() -> tuple[ModuleType, ModuleType]:
    """Returns ``(provider_pb2, provider_pb2_grpc)``, generating them on first use.

    Raises ``RuntimeError`` when ``protoc`` rejects the proto file.
    """
    global _loaded
    if _loaded is not None:
        return _loaded

    from grpc_tools import protoc  # imported here: only this function needs it

    well_known = importlib.resources.files("grpc_tools") / "_proto"
    with tempfile.TemporaryDirectory(prefix="python-provider-protos-") as out:
        status = protoc.main(
            [
                "grpc_tools.protoc",
                f"--proto_path={PROTO_ROOT}",
                f"--proto_path={well_known}",
                f"--python_out={out}",
                f"--grpc_python_out={out}",
                PROVIDER_PROTO,
            ]
        )
        if status != 0:
            raise RuntimeError(f"protoc failed on {PROTO_ROOT / PROVIDER_PROTO} (status {status})")
        # The generated modules live in the namespace package
        # `provisioning.provider.v1` under `out`, and the `_grpc` module
        # imports its sibling by that name, so `out` must be on the path
        # while both are imported.
        sys.path.insert(0, out)
        try:
            pb2 = importlib.import_module(f"{_PACKAGE}.provider_pb2")
            pb2_grpc = importlib.import_module(f"{_PACKAGE}.provider_pb2_grpc")
        finally:
            sys.path.remove(out)
    _loaded = (pb2, pb2_grpc)
    return _loaded
