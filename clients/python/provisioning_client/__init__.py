"""A Python client of the provisioning driver's public gRPC API
(``provisioning.v1.Provisioning``, defined in ``proto/provisioning/v1/provisioning.proto``).

Importing the package generates the protobuf code from the proto file (see
``_protos``); :data:`pb` is the generated module, for the message classes and
enums (``pb.RUN_PHASE_CONVERGED``, ``pb.RunPhase.Name(...)``)::

    from provisioning_client import Client

    with Client("127.0.0.1:7000", insecure=True) as c:
        c.apply({"run_id": "demo", "groups": [...]})
        status = c.wait("demo", timeout=120)
"""

__version__ = "0.1.0"

from . import _protos

pb = _protos.load()

from .client import Client, TlsConfig, parse_bool, settings_from_env  # noqa: E402
from .errors import (  # noqa: E402
    Conflict,
    InvalidArgument,
    InvalidShape,
    NotFound,
    OutcomeUnknown,
    PermissionDenied,
    ProvisioningError,
    ResourceExhausted,
    Stalled,
    Timeout,
    Unauthenticated,
    Unavailable,
)
from .shape import load_shape_file, parse_shape_text, shape_to_proto  # noqa: E402

__all__ = [
    "Client",
    "TlsConfig",
    "pb",
    "settings_from_env",
    "parse_bool",
    "shape_to_proto",
    "load_shape_file",
    "parse_shape_text",
    "ProvisioningError",
    "InvalidArgument",
    "InvalidShape",
    "NotFound",
    "Conflict",
    "Unauthenticated",
    "PermissionDenied",
    "Unavailable",
    "ResourceExhausted",
    "OutcomeUnknown",
    "Timeout",
    "Stalled",
]
