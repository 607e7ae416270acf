"""Hardware profile files: a calibrated ``HardwareModel`` on disk (``hpmoe calibrate``
writes one; the ``cpu`` preset and AUTO read it)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .hardware import HardwareModel

PROFILE_ENV = "HPMOE_PROFILE"
PROFILE_VERSION = 1


def default_profile_path() -> Path:
    """``$HPMOE_PROFILE`` if set, else ``~/.cache/hpmoe/cpu.json``."""
    env = os.environ.get(PROFILE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "hpmoe" / "cpu.json"


def save_profile(model: HardwareModel, path: str | os.PathLike | None = None) -> Path:
    """Write ``model`` as JSON to ``path`` (default: ``default_profile_path()``); returns the path."""
    out = Path(path) if path is not None else default_profile_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile_document(model), indent=2) + "\n")
    return out


def profile_document(model: HardwareModel) -> dict:
    """The JSON document of a profile file (what ``hpmoe calibrate --json`` prints)."""
    return {"version": PROFILE_VERSION, "hardware": model.to_dict()}


def load_profile(path: str | os.PathLike | None = None) -> HardwareModel:
    """Read a profile written by ``save_profile`` (default path: ``default_profile_path()``)."""
    src = Path(path) if path is not None else default_profile_path()
    if not src.is_file():
        raise FileNotFoundError(
            f"no hardware profile at {src} (set by ${PROFILE_ENV} or the default "
            f"~/.cache/hpmoe/cpu.json): run `hpmoe calibrate` to measure this machine, "
            f"or point {PROFILE_ENV} at an existing profile")
    try:
        doc = json.loads(src.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"profile {src} is not JSON ({err}): write it with `hpmoe calibrate`") from None
    if not isinstance(doc, dict) or doc.get("version") != PROFILE_VERSION or "hardware" not in doc:
        got = doc.get("version") if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f"profile {src}: version={got!r}, expected a document with version "
                         f"{PROFILE_VERSION} and 'hardware' (write it with `hpmoe calibrate`)")
    try:
        return HardwareModel.from_dict(doc["hardware"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"profile {src}: {type(err).__name__}: {err}") from None
