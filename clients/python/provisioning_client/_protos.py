"""Generates and imports the Python code for ``provisioning/v1/provisioning.proto``.

The contract is defined once, in ``proto/provisioning/v1/provisioning.proto`` at
the root of the repository; nothing generated is checked in. On first use this
module runs ``grpc_tools.protoc`` on the proto into a temporary directory,
imports the generated message module and removes the directory again (once
imported, a module no longer needs its file).

Only the message module (``--python_out``) is generated: the client builds its
calls of the public ``Provisioning`` service from the service's descriptor
(see ``client.py``), so the internal ``Decider`` and ``Executor`` services in
the same file have no stubs in this package at all.

Where the proto is looked for, first match wins:

1. the directory in ``PROVISIONING_PROTO_DIR`` (a proto root: it holds
   ``provisioning/v1/provisioning.proto``);
2. the copy installed with the package (``provisioning_client/proto/``, put
   there by ``setup.py`` when a wheel is built from the repository);
3. the repository the package sits in (``clients/python/../../proto``), for a
   checkout used without installing.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import os
import tempfile
import threading
from pathlib import Path
from types import ModuleType

#: The contract, relative to a proto root.
PROTO_FILE = "provisioning/v1/provisioning.proto"

#: The environment variable that names a proto root to use instead.
PROTO_DIR_ENV = "PROVISIONING_PROTO_DIR"

#: The name the generated module is imported under (it is not put in
#: ``sys.modules``, so it cannot clash with another copy of the same code).
MODULE_NAME = "provisioning_client.provisioning_pb2"

_lock = threading.Lock()
_loaded: ModuleType | None = None


def proto_roots() -> list[Path]:
    """The proto roots searched, in order (see the module documentation)."""
    roots = []
    override = os.environ.get(PROTO_DIR_ENV, "").strip()
    if override:
        roots.append(Path(override))
    here = Path(__file__).resolve().parent
    roots.append(here / "proto")
    roots.append(here.parents[2] / "proto")
    return roots


def find_proto_root() -> Path:
    """The first proto root that holds the contract.

    Raises ``FileNotFoundError`` naming every place looked at. A
    ``PROVISIONING_PROTO_DIR`` that does not hold it is an error, not a reason
    to fall back: the variable says which contract to use.
    """
    override = os.environ.get(PROTO_DIR_ENV, "").strip()
    if override:
        root = Path(override)
        if not (root / PROTO_FILE).is_file():
            raise FileNotFoundError(f"{PROTO_DIR_ENV}={override} does not hold {PROTO_FILE}")
        return root
    roots = proto_roots()
    for root in roots:
        if (root / PROTO_FILE).is_file():
            return root
    looked = ", ".join(str(r / PROTO_FILE) for r in roots)
    raise FileNotFoundError(
        f"cannot find {PROTO_FILE} (looked at {looked}); set {PROTO_DIR_ENV} to the "
        "repository's proto directory"
    )


def load() -> ModuleType:
    """Returns the generated ``provisioning_pb2`` module, generating it on first use.

    Raises ``FileNotFoundError`` when the proto cannot be found and
    ``RuntimeError`` when ``protoc`` rejects it.
    """
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        from grpc_tools import protoc  # imported here: only this function needs it

        root = find_proto_root()
        well_known = importlib.resources.files("grpc_tools") / "_proto"
        with tempfile.TemporaryDirectory(prefix="provisioning-client-protos-") as out:
            status = protoc.main(
                [
                    "grpc_tools.protoc",
                    f"--proto_path={root}",
                    f"--proto_path={well_known}",
                    f"--python_out={out}",
                    PROTO_FILE,
                ]
            )
            if status != 0:
                raise RuntimeError(f"protoc failed on {root / PROTO_FILE} (status {status})")
            path = Path(out) / PROTO_FILE.replace(".proto", "_pb2.py")
            spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
            if spec is None or spec.loader is None:
                raise RuntimeError(f"cannot import the generated {path}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        _loaded = module
        return module
