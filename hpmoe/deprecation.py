"""The one way a moved or retired public name says so: it keeps working for one release
with a ``DeprecationWarning`` that names what replaces it."""

from __future__ import annotations

import warnings


def deprecated(old: str, instead: str) -> None:
    """Warn that ``old`` is deprecated (``instead``: what to use now) and goes in the next
    release, pointing at the caller of the deprecated name."""
    warnings.warn(f"{old} is deprecated: {instead}; it goes in the next release", DeprecationWarning,
                  stacklevel=3)
