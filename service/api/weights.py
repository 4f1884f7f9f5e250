"""`model.init_from` at submit: the weights must be inside the data root (the same containment rule
as data.path, service.api.data_root) and hold exactly the tensors the model spec needs. Both are
checked without torch (safetensors headers are JSON; a torch file's shapes are read from its pickle
without running it: training.interop.names), so a mismatch is a 422 naming the first bad tensor."""

from __future__ import annotations

import os

from service.errors import InvalidRequest
from service.settings import Settings
from training.config.spec import ModelSpec
from training.data.confined import ConfinedPathError, inside
from training.interop.names import InteropError, check_weights

FIELD = "model.init_from.path"


def _refuse(field: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"{field}: {message}", errors=[{"field": field, "message": message}])


def resolve_init_from(settings: Settings, path: str, fmt: str, spec: ModelSpec) -> str:
    """The real absolute path of the weights, checked against `spec`; InvalidRequest otherwise."""
    root = os.path.realpath(settings.data_root_path)
    real = os.path.realpath(path if os.path.isabs(path) else os.path.join(root, path))
    if not inside(real, root) or real == root:
        raise _refuse(FIELD, f"{path!r} must be inside the data root (a path relative to it, or an "
                             "absolute path under it; no '..' or links out of it)")
    try:
        check_weights(spec, real, fmt, root)
    except InteropError as e:
        message = str(e).replace(real, path)  # the user's path, never the server's layout
        for prefix in (f"{FIELD}: ", f"{FIELD} ", "model.init_from: "):
            message = message.removeprefix(prefix)
        about_path = "does not exist" in message or isinstance(e.__cause__, ConfinedPathError)
        raise _refuse(FIELD if about_path else "model.init_from", message) from e
    return real


def resolve_validation_path(settings: Settings, path: str, seq_len: int, dtype: str) -> str:
    """data.validation.path under the data.path rules (service.api.data_root), errors naming it."""
    from service.api.data_root import resolve_data_path

    try:
        return resolve_data_path(settings, path, seq_len=seq_len, dtype=dtype)
    except InvalidRequest as e:
        field = "data.validation.path"
        message = e.detail.removeprefix("data.path: ")
        raise _refuse(field, message) from e
