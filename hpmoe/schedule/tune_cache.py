"""The tuned choices on disk: ``$HPMOE_TUNE_CACHE`` or ``~/.cache/hpmoe/tune.json``.

Keyed like vLLM's tuned configs (device, shape) plus the software versions: an entry
whose key matches but was measured with other versions, or on another machine, is
stale: ignored, with a note saying why.  Written by ``hpmoe tune`` and by layers that
finish tuning (group rank 0), atomically (a temporary file renamed over the old one).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from .tune import TuneKey, TuneResult

CACHE_ENV = "HPMOE_TUNE_CACHE"
FORMAT = 1


def cache_path() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "hpmoe" / "tune.json"


@dataclass(frozen=True)
class Entry:
    key: TuneKey
    versions: dict
    result: TuneResult

    def to_json(self) -> dict:
        return {"key": self.key.to_json(), "versions": self.versions, "result": self.result.to_json()}

    @staticmethod
    def from_json(doc: dict) -> Entry:
        return Entry(TuneKey(**doc["key"]), dict(doc["versions"]), TuneResult.from_json(doc["result"]))


@dataclass(frozen=True)
class Lookup:
    """A cache hit (``result``) or a miss, with ``note`` saying why a near entry is stale."""

    result: TuneResult | None
    note: str | None = None


class TuneCache:
    """The entries of one cache file (missing file: none)."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else cache_path()

    def entries(self) -> list[Entry]:
        if not self.path.exists():
            return []
        try:
            doc = json.loads(self.path.read_text())
            if doc.get("format") != FORMAT:
                return []
            return [Entry.from_json(e) for e in doc["entries"]]
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{CACHE_ENV} file {self.path} is not a tuning cache ({err}); delete it "
                             "or point the variable elsewhere") from None

    def lookup(self, key: TuneKey, versions: dict) -> Lookup:
        """The entry for ``key`` measured with ``versions``; else a note on stale ones."""
        notes = []
        for e in self.entries():
            if e.key == key and e.versions == versions:
                return Lookup(replace(e.result, source="cache"))
            if e.key == key:
                notes.append(f"measured with {_show(e.versions)}, this is {_show(versions)}")
            elif replace(e.key, machine=key.machine) == key:
                notes.append(f"measured on another machine ({e.key.machine})")
        note = f"stale tuning cache entries in {self.path} ignored: {'; '.join(notes)}" if notes else None
        return Lookup(None, note)

    def store(self, key: TuneKey, versions: dict, result: TuneResult) -> None:
        """Add (or replace) the entry of ``key`` and ``versions``."""
        keep = [e for e in self.entries() if not (e.key == key and e.versions == versions)]
        doc = {"format": FORMAT, "entries": [e.to_json() for e in [*keep, Entry(key, versions, result)]]}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tune-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, self.path)


def _show(versions: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(versions.items()))
