"""The shape-file format (what ``provisionctl apply -f`` reads) as Python data,
and its conversion to the wire message ``provisioning.v1.ClusterShape``.

A shape is a mapping::

    {
        "run_id": "demo",                  # required
        "generation": 3,                   # optional: the client picks one
        "labels": {"team": "ml"},          # optional: the run's labels
        "groups": [{
            "id": "workers", "count": 2,   # required
            "template": {
                "role": "worker",
                "image": "registry.local/node:1.0",          # required
                "provider": {"name": "fake", "cpu": 4, "memory_gib": 16,
                             "machine_type": "standard-4", "zone": "local-a",
                             "accelerators": [{"kind": "a100", "count": 1}],
                             "labels": {"pool": "general"}},  # name required
                "boot": {"kernel_args": "quiet"},
                "join": {"token": {"value": "s3cret", "secret": True}},
            },
            "health": {"probe": "tcp", "interval": "10s", "timeout": "2s",
                       "unhealthy_after": "30s", "startup_grace": 0},
            "remediation": {"max_in_flight": 1, "max_unhealthy": "40%"},
            "rollout": {"max_unavailable": 1, "max_surge": "25%", "canary": 0,
                        "progress_deadline": "10m", "failure_threshold": 0,
                        "auto_revert": False},
        }],
    }

As in ``provisionctl``: unknown fields are errors; a parameter is text (a
whole number or a boolean is taken as its text; a decimal number is refused,
since its text would not survive) or ``{value | from_env | from_file,
secret}``; durations are milliseconds or text with a unit (``500ms``, ``10s``,
``2m``, ``1h``); budgets are a count or a percentage (``"40%"``).

Only the format is checked here (field names, types, required fields, and
that a secret is not the ``<redacted>`` marker of a shape read back from the
server). Values are checked by the driver, which names the offending field
the same way (``shape.groups[0].count must not be negative``), so there is one
set of rules. Errors never show a parameter's value.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import grpc
import yaml

from . import _protos
from .errors import REDACTED, InvalidShape

pb = _protos.load()

#: Whether the contract has run labels (``ClusterShape.labels``); a shape
#: with ``labels`` is refused by a client generated from a proto without them.
HAS_LABELS = "labels" in pb.ClusterShape.DESCRIPTOR.fields_by_name


def _fail(path: str, problem: str) -> InvalidShape:
    return InvalidShape(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"{path} {problem} (found by the client; nothing was sent)",
        path,
    )


def _key_path(path: str, key: str) -> str:
    """``path["key"]``, the driver's notation for a map entry."""
    return f"{path}[{json.dumps(key)}]"


def _type_name(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "a whole number"
    if isinstance(value, float):
        return "a decimal number"
    if isinstance(value, str):
        return "text"
    if isinstance(value, Mapping):
        return "a map"
    if isinstance(value, (list, tuple)):
        return "a list"
    return type(value).__name__


def _fields(value: Any, path: str, what: str, allowed: tuple[str, ...], required: tuple[str, ...]) -> Mapping:
    """``value`` checked to be a mapping with only ``allowed`` keys and every
    ``required`` one."""
    if not isinstance(value, Mapping):
        raise _fail(path, f"must be a map ({what}), not {_type_name(value)}")
    for key in value:
        if not isinstance(key, str):
            raise _fail(path, f"has a key that is {_type_name(key)}; keys are field names")
        if key not in allowed:
            raise _fail(
                f"{path}.{key}" if path else key,
                f"is not a field of {what} (expected one of: {', '.join(allowed)})",
            )
    for key in required:
        if key not in value or value[key] is None:
            raise _fail(f"{path}.{key}" if path else key, "is required")
    return value


class _YamlInt(int):
    """A whole number read from YAML, keeping its text for a field that wants text."""

    text: str


class _YamlFloat(float):
    """A decimal number read from YAML, keeping its text for a field that wants text."""

    text: str


def _text(value: Any, path: str, default: str = "") -> str:
    if value is None:
        return default
    if isinstance(value, str):
        return str(value)
    # YAML has no quotes to tell `image: 1.0` from text; provisionctl takes
    # the text as written, and so does this.
    if isinstance(value, (_YamlInt, _YamlFloat)):
        return value.text
    raise _fail(path, f"must be text, not {_type_name(value)}")


def _whole(value: Any, path: str, *, lo: int, hi: int, default: int | None = None) -> int:
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(path, f"must be a whole number, not {_type_name(value)}")
    if not lo <= value <= hi:
        raise _fail(path, f"must be a whole number from {lo} to {hi}")
    return int(value)


_I64 = (-(2**63), 2**63 - 1)
_U32 = (0, 2**32 - 1)
_U64 = (0, 2**64 - 1)


def _number(value: Any, path: str) -> float:
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(path, f"must be a number, not {_type_name(value)}")
    return float(value)


def _flag(value: Any, path: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _fail(path, f"must be true or false, not {_type_name(value)}")
    return value


_DURATION = re.compile(r"^(\d+)\s*(ms|s|m|h)?$")
_SCALE = {None: 1, "ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000}


def parse_duration_ms(value: Any, path: str = "duration") -> int:
    """Milliseconds from a duration: a whole number of milliseconds, or text
    such as ``"500ms"``, ``"10s"``, ``"2m"``, ``"1h"`` (``"90"`` is 90 ms, as in
    the shape-file format). Raises :class:`InvalidShape` naming ``path``."""
    if isinstance(value, str) and not isinstance(value, (_YamlInt, _YamlFloat)):
        m = _DURATION.match(value.strip())
        if m:
            ms = int(m.group(1)) * _SCALE[m.group(2)]
            if ms <= _U64[1]:
                return ms
        raise _fail(path, 'must be a duration: milliseconds, or text such as "500ms", "10s", "2m", "1h"')
    return _whole(value, path, lo=0, hi=_U64[1])


def _budget(value: Any, path: str):
    """A ``Budget`` message from a count (``3``, ``"3"``) or a percentage (``"40%"``)."""
    if isinstance(value, str) and not isinstance(value, (_YamlInt, _YamlFloat)):
        text = value.strip()
        percent = text.endswith("%")
        digits = text[:-1].strip() if percent else text
        if digits.isdigit() and int(digits) <= _U32[1]:
            n = int(digits)
            return pb.Budget(percent=n) if percent else pb.Budget(count=n)
        raise _fail(path, 'must be a count of nodes (3) or a percentage ("40%")')
    if isinstance(value, bool) or not isinstance(value, int) or not _U32[0] <= value <= _U32[1]:
        raise _fail(path, 'must be a count of nodes (3) or a percentage ("40%")')
    return pb.Budget(count=int(value))


def _param(value: Any, path: str):
    """A ``Param`` from text, a whole number, a boolean, or
    ``{value | from_env | from_file, secret}``. Never shows the value."""
    if isinstance(value, bool):
        return pb.Param(value="true" if value else "false")
    if isinstance(value, int):
        return pb.Param(value=str(int(value)))
    if isinstance(value, float):
        raise _fail(
            path, "is a decimal number, which is not a valid parameter value; quote it to keep its exact text"
        )
    if isinstance(value, str):
        return pb.Param(value=str(value))
    if not isinstance(value, Mapping):
        raise _fail(
            path,
            f"must be text, or a map {{value | from_env | from_file, secret}}, not {_type_name(value)}",
        )
    spec = _fields(value, path, "a parameter", ("value", "from_env", "from_file", "secret"), ())
    sources = [k for k in ("value", "from_env", "from_file") if spec.get(k) is not None]
    if len(sources) != 1:
        raise _fail(path, "must give its value once: one of value, from_env or from_file")
    secret = _flag(spec.get("secret"), f"{path}.secret")
    source = sources[0]
    if source == "value":
        raw = spec["value"]
        if isinstance(raw, (_YamlInt, _YamlFloat)):
            text = raw.text  # YAML: the number as written, as provisionctl reads it
        elif isinstance(raw, bool):
            text = "true" if raw else "false"
        elif isinstance(raw, (str, int)) and not isinstance(raw, float):
            text = str(raw) if isinstance(raw, str) else str(int(raw))
        else:
            raise _fail(f"{path}.value", f"must be text, not {_type_name(raw)}")
    elif source == "from_env":
        name = _text(spec["from_env"], f"{path}.from_env")
        if name not in os.environ:
            raise _fail(f"{path}.from_env", f"names the environment variable {name}, which is not set")
        text = os.environ[name]
    else:
        file = _text(spec["from_file"], f"{path}.from_file")
        try:
            text = Path(file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise _fail(f"{path}.from_file", f"cannot be read ({file}: {type(e).__name__})") from None
        # One trailing newline dropped, as provisionctl does.
        if text.endswith("\r\n"):
            text = text[:-2]
        elif text.endswith("\n"):
            text = text[:-1]
    if secret and text == REDACTED:
        raise _fail(
            path,
            "is the redaction marker of a shape read back from the server, not a value: give the value "
            "inline, or as {from_env: VARIABLE, secret: true} or {from_file: PATH, secret: true}",
        )
    return pb.Param(value=text, secret=secret)


def _params(value: Any, path: str, target) -> None:
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise _fail(path, f"must be a map of parameters, not {_type_name(value)}")
    for key, v in value.items():
        if not isinstance(key, str):
            raise _fail(path, f"has a key that is {_type_name(key)}; parameter names are text")
        target[key].CopyFrom(_param(v, _key_path(path, key)))


def _health(value: Any, path: str):
    h = _fields(
        value,
        path,
        "a health policy",
        ("probe", "interval", "timeout", "unhealthy_after", "startup_grace"),
        (),
    )
    msg = pb.HealthPolicy()
    probe = h.get("probe")
    if probe is not None:
        if probe == "tcp":
            msg.probe = pb.PROBE_TCP
        elif probe == "none":
            msg.probe = pb.PROBE_NONE
        else:
            raise _fail(f"{path}.probe", "must be tcp or none")
    for key, attr in (
        ("interval", "interval_ms"),
        ("timeout", "timeout_ms"),
        ("unhealthy_after", "unhealthy_after_ms"),
        ("startup_grace", "startup_grace_ms"),
    ):
        if h.get(key) is not None:
            setattr(msg, attr, parse_duration_ms(h[key], f"{path}.{key}"))
    return msg


def _remediation(value: Any, path: str):
    r = _fields(value, path, "a remediation policy", ("max_in_flight", "max_unhealthy"), ())
    msg = pb.RemediationPolicy()
    if r.get("max_in_flight") is not None:
        msg.max_in_flight = _whole(r["max_in_flight"], f"{path}.max_in_flight", lo=_U32[0], hi=_U32[1])
    if r.get("max_unhealthy") is not None:
        msg.max_unhealthy.CopyFrom(_budget(r["max_unhealthy"], f"{path}.max_unhealthy"))
    return msg


def _rollout(value: Any, path: str):
    r = _fields(
        value,
        path,
        "a rollout policy",
        ("max_unavailable", "max_surge", "canary", "progress_deadline", "failure_threshold", "auto_revert"),
        (),
    )
    msg = pb.RolloutPolicy()
    for key in ("max_unavailable", "max_surge"):
        if r.get(key) is not None:
            getattr(msg, key).CopyFrom(_budget(r[key], f"{path}.{key}"))
    msg.canary = _whole(r.get("canary"), f"{path}.canary", lo=_U32[0], hi=_U32[1], default=0)
    if r.get("progress_deadline") is not None:
        msg.progress_deadline_ms = parse_duration_ms(r["progress_deadline"], f"{path}.progress_deadline")
    msg.failure_threshold = _whole(
        r.get("failure_threshold"), f"{path}.failure_threshold", lo=_U32[0], hi=_U32[1], default=0
    )
    msg.auto_revert = _flag(r.get("auto_revert"), f"{path}.auto_revert")
    return msg


def _template(value: Any, path: str, msg) -> None:
    t = _fields(
        value, path, "a node template", ("role", "image", "provider", "boot", "join"), ("image", "provider")
    )
    msg.role = _text(t.get("role"), f"{path}.role")
    msg.image = _text(t["image"], f"{path}.image")
    ppath = f"{path}.provider"
    p = _fields(
        t["provider"],
        ppath,
        "a provider shape",
        ("name", "machine_type", "cpu", "memory_gib", "accelerators", "zone", "labels"),
        ("name",),
    )
    prov = msg.provider
    prov.name = _text(p["name"], f"{ppath}.name")
    prov.machine_type = _text(p.get("machine_type"), f"{ppath}.machine_type")
    prov.cpu = _number(p.get("cpu"), f"{ppath}.cpu")
    prov.memory_gib = _number(p.get("memory_gib"), f"{ppath}.memory_gib")
    prov.zone = _text(p.get("zone"), f"{ppath}.zone")
    accelerators = p.get("accelerators")
    if accelerators is not None:
        if not isinstance(accelerators, (list, tuple)):
            raise _fail(f"{ppath}.accelerators", f"must be a list, not {_type_name(accelerators)}")
        for i, a in enumerate(accelerators):
            apath = f"{ppath}.accelerators[{i}]"
            a = _fields(a, apath, "an accelerator", ("kind", "count"), ("kind", "count"))
            prov.accelerators.add(
                kind=_text(a["kind"], f"{apath}.kind"),
                count=_whole(a["count"], f"{apath}.count", lo=_I64[0], hi=_I64[1]),
            )
    labels = p.get("labels")
    if labels is not None:
        if not isinstance(labels, Mapping):
            raise _fail(f"{ppath}.labels", f"must be a map of text to text, not {_type_name(labels)}")
        for k, v in labels.items():
            key = _text(k, f"{ppath}.labels")
            prov.labels[key] = _text(v, _key_path(f"{ppath}.labels", key))
    _params(t.get("boot"), f"{path}.boot", msg.boot)
    _params(t.get("join"), f"{path}.join", msg.join)


def shape_to_proto(shape: Mapping, generation: int | None = None):
    """The ``ClusterShape`` message for a shape in the shape-file format.

    The generation is the shape's own ``generation`` if it has one, else
    ``generation`` (else 0, which the driver refuses: :meth:`Client.apply`
    picks one). Field paths in errors start with ``shape.``, as the driver's
    do. The message carries secret values as they are: do not log it.
    """
    top = ("run_id", "generation", "labels", "groups") if HAS_LABELS else ("run_id", "generation", "groups")
    s = _fields(shape, "shape", "a shape", top, ("run_id",))
    msg = pb.ClusterShape(run_id=_text(s["run_id"], "shape.run_id"))
    labels = s.get("labels")
    if labels is not None:
        if not isinstance(labels, Mapping):
            raise _fail("shape.labels", f"must be a map of text to text, not {_type_name(labels)}")
        for k, v in labels.items():
            key = _text(k, "shape.labels")
            msg.labels[key] = _text(v, _key_path("shape.labels", key))
    if s.get("generation") is not None:
        msg.generation = _whole(s["generation"], "shape.generation", lo=_U64[0], hi=_U64[1])
    elif generation is not None:
        msg.generation = generation
    groups = s.get("groups")
    if groups is None:
        return msg
    if not isinstance(groups, (list, tuple)):
        raise _fail("shape.groups", f"must be a list, not {_type_name(groups)}")
    for i, g in enumerate(groups):
        path = f"shape.groups[{i}]"
        g = _fields(
            g,
            path,
            "a group",
            ("id", "count", "template", "health", "remediation", "rollout"),
            ("id", "count", "template"),
        )
        group = msg.groups.add(
            id=_text(g["id"], f"{path}.id"),
            count=_whole(g["count"], f"{path}.count", lo=_I64[0], hi=_I64[1]),
        )
        _template(g["template"], f"{path}.template", group.template)
        if g.get("health") is not None:
            group.health.CopyFrom(_health(g["health"], f"{path}.health"))
        if g.get("remediation") is not None:
            group.remediation.CopyFrom(_remediation(g["remediation"], f"{path}.remediation"))
        if g.get("rollout") is not None:
            group.rollout.CopyFrom(_rollout(g["rollout"], f"{path}.rollout"))
    return msg


def secret_values(shape) -> list[str]:
    """The secret parameter values a ``ClusterShape`` carries, to keep out of messages."""
    out = []
    for g in shape.groups:
        for params in (g.template.boot, g.template.join):
            out.extend(p.value for p in params.values() if p.secret and p.value)
    return out


# ---------------------------------------------------------------------------
# Comparing a shape with the one the driver holds
# ---------------------------------------------------------------------------

# The defaults the driver fills in for a group's unset policies (README,
# "Shape files"); a shape that leaves them unset equals one that spells them out.
_HEALTH_DEFAULTS = {"interval_ms": 10_000, "timeout_ms": 2_000, "unhealthy_after_ms": 30_000}
_PROGRESS_DEADLINE_MS = 600_000


def _budget_key(b, has: bool, default: tuple[str, int]) -> tuple[str, int]:
    if not has or b.WhichOneof("value") is None:
        return default
    kind = b.WhichOneof("value")
    return (kind, getattr(b, kind))


def _group_key(g) -> tuple:
    t = g.template
    p = t.provider

    def params(m) -> tuple:
        return tuple(sorted((k, REDACTED if v.secret else v.value, v.secret) for k, v in m.items()))

    template = (
        t.role,
        t.image,
        p.name,
        p.machine_type,
        p.cpu,
        p.memory_gib,
        tuple((a.kind, a.count) for a in p.accelerators),
        p.zone,
        tuple(sorted(p.labels.items())),
        params(t.boot),
        params(t.join),
    )
    h = g.health
    health = (
        pb.PROBE_TCP if h.probe == pb.PROBE_TCP else pb.PROBE_NONE,
        h.interval_ms or _HEALTH_DEFAULTS["interval_ms"],
        h.timeout_ms or _HEALTH_DEFAULTS["timeout_ms"],
        h.unhealthy_after_ms or _HEALTH_DEFAULTS["unhealthy_after_ms"],
        h.startup_grace_ms,
    )
    r = g.remediation
    remediation = (
        r.max_in_flight if r.HasField("max_in_flight") else 1,
        _budget_key(r.max_unhealthy, r.HasField("max_unhealthy"), ("percent", 100)),
    )
    o = g.rollout
    rollout = (
        _budget_key(o.max_unavailable, o.HasField("max_unavailable"), ("percent", 25)),
        _budget_key(o.max_surge, o.HasField("max_surge"), ("percent", 25)),
        o.canary,
        o.progress_deadline_ms or _PROGRESS_DEADLINE_MS,
        o.failure_threshold,
        o.auto_revert,
    )
    return (g.id, g.count, template, health, remediation, rollout)


def same_content(a, b) -> bool:
    """Whether two ``ClusterShape`` messages have the same content once secret
    values are redacted on both sides, ignoring the generation, with unset
    policies read as the driver's defaults.

    A change of a secret value alone cannot be seen (the driver never returns
    one); the driver tells it apart, and :meth:`Client.apply` asks it.
    """
    if a.run_id != b.run_id or len(a.groups) != len(b.groups):
        return False
    if HAS_LABELS and dict(a.labels) != dict(b.labels):
        return False
    return all(_group_key(x) == _group_key(y) for x, y in zip(a.groups, b.groups))


# ---------------------------------------------------------------------------
# Shape files
# ---------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """YAML read as the YAML 1.2 core schema, as ``provisionctl`` reads it:
    only ``true``/``false`` are booleans (``yes``, ``no``, ``on``, ``off`` are
    text), no dates, no sexagesimal numbers; numbers keep their text for
    fields that want text."""


_Loader.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag not in ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:int",
                                                   "tag:yaml.org,2002:float", "tag:yaml.org,2002:timestamp")]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789")
)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> _YamlInt:
    text = loader.construct_scalar(node)
    if text.startswith("0o"):
        value = int(text[2:], 8)
    elif text.startswith("0x"):
        value = int(text[2:], 16)
    else:
        value = int(text, 10)
    out = _YamlInt(value)
    out.text = text
    return out


def _construct_float(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> _YamlFloat:
    text = loader.construct_scalar(node)
    lower = text.lower()
    if lower.endswith(".inf"):
        value = -math.inf if lower.startswith("-") else math.inf
    elif lower == ".nan":
        value = math.nan
    else:
        value = float(text)
    out = _YamlFloat(value)
    out.text = text
    return out


_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_Loader.add_constructor("tag:yaml.org,2002:float", _construct_float)


def parse_shape_text(text: str, source: str = "<text>") -> dict:
    """A shape-file text (YAML or JSON) as a mapping.

    JSON when ``source`` ends in ``.json``, YAML when it ends in ``.yaml`` or
    ``.yml``, else JSON if the text starts with ``{``, else YAML: as
    ``provisionctl`` decides. Raises :class:`InvalidShape` (``field`` unset)
    for text that does not parse, saying where; the message never quotes the
    text.
    """
    lower = source.lower()
    if lower.endswith(".json"):
        as_json = True
    elif lower.endswith((".yaml", ".yml")):
        as_json = False
    else:
        as_json = text.lstrip().startswith("{")
    if not text.strip():
        raise InvalidShape(grpc.StatusCode.INVALID_ARGUMENT, f"{source}: the file is empty")
    try:
        data = json.loads(text) if as_json else yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader)
    except json.JSONDecodeError as e:
        raise InvalidShape(
            grpc.StatusCode.INVALID_ARGUMENT, f"{source}:{e.lineno}:{e.colno}: not valid JSON: {e.msg}"
        ) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or "not valid YAML"
        raise InvalidShape(
            grpc.StatusCode.INVALID_ARGUMENT, f"{source}{where}: not valid YAML: {problem}"
        ) from None
    if not isinstance(data, Mapping):
        raise InvalidShape(
            grpc.StatusCode.INVALID_ARGUMENT, f"{source}: a shape file holds a map, not {_type_name(data)}"
        )
    return dict(data)


def load_shape_file(path: str | os.PathLike) -> dict:
    """The shape in a YAML or JSON file, as a mapping (see :func:`parse_shape_text`)."""
    p = Path(path)
    return parse_shape_text(p.read_text(encoding="utf-8"), str(p))
